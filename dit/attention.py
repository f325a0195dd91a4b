"""Attention hooks: the one plug-in point through which every kind of KV reuse works.

A model block computes q/k/v for the tokens it actually runs (layout ``[text, image,
reference...]``) and hands them to ``hook.attend``. The hook may append keys/values of
tokens that are *not* computed in this call (cached unmasked template tokens, cached
reference or prefix tokens), decides who sees whom (reference and block-causal rules), and
may record K/V or attention mass. Hooks also see the hidden states before and after each
block (used to capture and to pin states in the slow reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Roles of key/query segments. "cache" = unmasked image tokens supplied from a template
# cache; it is visible exactly like "img". References are "ref:<i>".
TXT, IMG, CACHE = "txt", "img", "cache"


@dataclass(frozen=True)
class Layout:
    """Sizes of the computed segments in one call, in order ``[txt, img, ref]``.

    ``ref_sizes`` splits the ``ref`` tokens into separate reference images (default: one).
    """

    txt: int
    img: int
    ref: int = 0
    ref_sizes: tuple[int, ...] = ()

    def query_segments(self) -> list[tuple[str, int]]:
        segs = [(TXT, self.txt), (IMG, self.img)]
        sizes = self.ref_sizes or ((self.ref,) if self.ref else ())
        segs += [(f"ref:{i}", n) for i, n in enumerate(sizes)]  # empty ones are dropped
        return [(r, n) for r, n in segs if n]


@dataclass
class KVSegment:
    """Keys/values ``[B or 1, H, L, D]`` of tokens not computed in this call."""

    role: str
    k: torch.Tensor
    v: torch.Tensor


def _ref_index(role: str) -> int:
    return int(role.split(":", 1)[1])


def visible(mode: str, q_role: str, k_role: str) -> bool:
    """Whether a query of ``q_role`` may attend to a key of ``k_role`` (outside causal text)."""
    if q_role.startswith("ref:"):
        if mode == "joint":
            return k_role == q_role
        # block_causal: a reference sees the text and every reference up to itself.
        return k_role == TXT or (k_role.startswith("ref:") and _ref_index(k_role) <= _ref_index(q_role))
    if q_role == TXT and mode == "block_causal":
        return k_role == TXT  # the prefix never sees the latents
    return True


def build_mask(mode: str, q_segs: list[tuple[str, int]],
               k_segs: list[tuple[str, int]]) -> torch.Tensor | None:
    """Boolean mask ``[Tq, Tk]`` (True = attend), or None when everything is visible."""
    causal_text = mode == "block_causal"
    blocks_all = all(visible(mode, q, k) for q, _ in q_segs for k, _ in k_segs)
    has_text_q = any(q == TXT for q, _ in q_segs) and any(k == TXT for k, _ in k_segs)
    if blocks_all and not (causal_text and has_text_q):
        return None
    rows = []
    for q_role, nq in q_segs:
        cols = []
        for k_role, nk in k_segs:
            if causal_text and q_role == TXT and k_role == TXT:
                # Text keys are [cached text prefix..., fresh text...]; with fresh text
                # only, this is the usual lower triangle.
                cols.append(torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq))
            else:
                cols.append(torch.full((nq, nk), visible(mode, q_role, k_role)))
        rows.append(torch.cat(cols, dim=1))
    return torch.cat(rows, dim=0)


def segment_span(segs: list[tuple[str, int]], role: str) -> tuple[int, int] | None:
    """``(start, end)`` of the (last) segment of ``role`` in ``segs``, or None."""
    start, span = 0, None
    for r, n in segs:
        if r == role:
            span = (start, start + n)
        start += n
    return span


def cache_mass(probs: torch.Tensor, q_segs: list[tuple[str, int]],
               k_segs: list[tuple[str, int]]) -> torch.Tensor | None:
    """Attention mass of the image queries on the cached keys, per cached token ``[U]``
    (float32, summed over batch, heads and queries, on ``probs``' device): what importance
    profiling accumulates. None when the call has no image queries or no cached keys."""
    q_rng, k_rng = segment_span(q_segs, IMG), segment_span(k_segs, CACHE)
    if q_rng is None or k_rng is None:
        return None
    return probs[:, :, q_rng[0]:q_rng[1], k_rng[0]:k_rng[1]].float().sum(dim=(0, 1, 2))


class AttentionHook:
    """Base hook: plain attention over the computed tokens plus any extra segments."""

    def __init__(self, mode: str = "joint"):
        self.mode = mode
        self._mask_cache: dict = {}

    # -- extension points ---------------------------------------------------------------

    def extra_kv(self, block: int) -> list[KVSegment]:
        """Keys/values of tokens not computed here, appended after the computed ones."""
        return []

    def on_kv(self, block: int, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> None:
        """Called with the K/V of the computed tokens (after norm + rope)."""

    def on_probs(self, block: int, probs: torch.Tensor, q_segs, k_segs) -> None:
        """Called with attention probabilities when ``needs_probs`` is True."""

    needs_probs = False

    def before_block(self, block: int, seg):
        """Called with the block's input segments; may return modified segments."""
        return seg

    def after_block(self, block: int, seg):
        """Called with the block's output segments; may return modified segments."""
        return seg

    # -- the attention ------------------------------------------------------------------

    def gather(self, block: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               layout: Layout):
        """The keys a block's queries attend to: ``on_kv`` sees the fresh K/V, the hook's
        ``extra_kv`` segments are appended. Returns ``(k, v, q_segs, k_segs, mask)``, the
        mask from the visibility rules (None: everything visible). :meth:`attend` and the
        probing hooks of regional execution share it."""
        self.on_kv(block, k, v, layout)
        q_segs = layout.query_segments()
        k_segs = list(q_segs)
        extra = self.extra_kv(block)
        if extra:
            b = q.shape[0]
            k = torch.cat([k] + [e.k.expand(b, -1, -1, -1) for e in extra], dim=2)
            v = torch.cat([v] + [e.v.expand(b, -1, -1, -1) for e in extra], dim=2)
            k_segs += [(e.role, e.k.shape[2]) for e in extra]
        key = (tuple(q_segs), tuple(k_segs))
        if key not in self._mask_cache:
            self._mask_cache[key] = build_mask(self.mode, q_segs, k_segs)
        return k, v, q_segs, k_segs, self._mask_cache[key]

    def attend(self, block: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               layout: Layout) -> torch.Tensor:
        k, v, q_segs, k_segs, mask = self.gather(block, q, k, v, layout)
        if self.needs_probs:
            scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = scores.softmax(dim=-1)
            self.on_probs(block, probs, q_segs, k_segs)
            return probs @ v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class PlainAttention(AttentionHook):
    """No reuse: what training and full generation use."""
