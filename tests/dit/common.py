"""Tiny seeded models and templates for the dit tests (random weights only in tests)."""

from __future__ import annotations

import torch
from sakura.dit.editing import EditRequest, Template
from sakura.dit.model import MMDiT, MMDiTConfig


def tiny_model(mode: str = "joint", seed: int = 0, double_blocks: int = 2,
               single_blocks: int = 2, text_dim: int = 32, text_tokens: int = 5) -> MMDiT:
    torch.manual_seed(seed)
    cfg = MMDiTConfig(hidden_size=48, num_heads=3, double_blocks=double_blocks,
                      single_blocks=single_blocks, mlp_ratio=2.0, text_dim=text_dim,
                      text_tokens=text_tokens, rope_axes=(4, 6, 6), attention_mode=mode)
    model = MMDiT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    return model.eval()


def text_width_model() -> MMDiT:
    """The one tiny model whose text stream takes the real text encoder's ``[16, 384]``
    embeddings (MiniLM), for the tests that run the device's text encoder: the
    ``sakura-edge`` binary's world (``tests/native/test_sakura_edge.py``), the replays
    (``tests/edge/test_replay.py``) and ``sakura edit`` (``tests/edge/test_bench_cli.py``).
    One model, so its graph sets are exported once per suite into the shared compiled cache
    (the full and template sets are the same keys for all three): with a model per file the
    serial part of ``./scripts/test`` exported 49 s of graphs the parallel part had made for
    another model, and the binary's 4-block world 240 s (2026-12-07, empty cache)."""
    return tiny_model(seed=3, double_blocks=1, single_blocks=1, text_dim=384, text_tokens=16)


def tiny_template(model: MMDiT, size: int = 32, seed: int = 1, steps: int = 4) -> Template:
    g = torch.Generator().manual_seed(seed)
    image = torch.rand(3, size, size, generator=g) * 2 - 1
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[8:20, 4:16] = True
    txt = torch.randn(1, model.cfg.text_tokens, model.cfg.text_dim, generator=g)
    return Template(image=image, mask=mask, txt=txt, seed=seed, steps=steps, guidance=2.0)


def tiny_request(model: MMDiT, seed: int = 7, refs: int = 0, size: int = 16) -> EditRequest:
    g = torch.Generator().manual_seed(seed)
    txt = torch.randn(1, model.cfg.text_tokens, model.cfg.text_dim, generator=g)
    unc = torch.randn(1, model.cfg.text_tokens, model.cfg.text_dim, generator=g)
    ref = torch.rand(refs, 3, size, size, generator=g) * 2 - 1 if refs else None
    return EditRequest(txt=txt, txt_uncond=unc, seed=seed, ref_images=ref)
