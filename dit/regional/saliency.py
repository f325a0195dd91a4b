"""Saliency (FlashDiff step 2, first half): which prompt tokens count, and the attention
mass of image queries on groups of keys, measured by the fused attention kernel.

:func:`salient_token_mask` picks the salient prompt tokens (special tokens, punctuation
and function words excluded); the saliency of an image token is its attention mass on
them. :func:`fused_masses` measures attention mass on groups of keys (the prompt tokens
for saliency, a patch's own tokens for the gate's probe) without materialising the
attention matrix; the backends (``dit.regional_mmdit``, ``dit.adapters.regional``) call it.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

# Function words excluded from saliency (plus anything without a letter or digit).
FUNCTION_WORDS = frozenset(
    "a an the and or but nor of to in on at by for with without from into onto over under "
    "as is are was were be been being it its this that these those his her their our your "
    "my he she they we you i me him them us some any each every no not than then so very "
    "up down out off about above below near next".split()
)


# ----------------------------------------------------------------------------- tokens


def salient_token_mask(tokenizer, prompt: str, max_tokens: int) -> torch.Tensor:
    """Which of the ``max_tokens`` text positions carry content (bool ``[max_tokens]``).

    Uses the same tokenisation as ``dit.text.TextEncoder`` (lower-cased, padded to
    ``max_tokens``). Special tokens (CLS/SEP/PAD), punctuation and :data:`FUNCTION_WORDS`
    are excluded; a word piece ``##x`` follows the word it continues. If nothing is left
    (an empty or all-function-word prompt) every non-special token counts.
    """
    enc = tokenizer(prompt.lower(), padding="max_length", truncation=True,
                    max_length=max_tokens)
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"])
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    out = torch.zeros(max_tokens, dtype=torch.bool)
    nonspecial = torch.zeros(max_tokens, dtype=torch.bool)
    head_salient = False
    for i, tok in enumerate(tokens[:max_tokens]):
        if tok in special:
            head_salient = False
            continue
        nonspecial[i] = True
        if tok.startswith("##"):
            out[i] = head_salient
            continue
        head_salient = bool(re.search(r"[a-z0-9]", tok)) and tok not in FUNCTION_WORDS
        out[i] = head_salient
    return out if out.any() else nonspecial


def fused_masses(q: torch.Tensor, k: torch.Tensor, indicator: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
    """Attention mass of every query of the first batch row on groups of keys, mean over
    heads: ``[queries, m]``, from the fused attention kernel, never materialising the
    attention matrix. ``indicator`` ``[K, m]`` (1 where key j belongs to group i) is used
    as the values: ``softmax(q k^T) @ indicator`` is the mass. It is zero-padded to the
    head dimension and split into head-dimension-wide chunks, because the fused kernels
    want values as wide as the keys (wider values fall back to PyTorch's materialising
    path, which is what this avoids)."""
    d, m = q.shape[-1], indicator.shape[1]
    chunks = max(1, -(-m // d))
    pad = indicator.new_zeros(indicator.shape[0], chunks * d)
    pad[:, :m] = indicator
    h = q.shape[1]
    outs = [F.scaled_dot_product_attention(
                q[:1], k[:1], pad[:, c * d:(c + 1) * d][None, None].expand(1, h, -1, -1),
                attn_mask=mask)
            for c in range(chunks)]
    return torch.cat(outs, dim=-1)[0, :, :, :m].mean(0)
