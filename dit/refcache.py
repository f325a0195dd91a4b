"""Reference-image KV caching (Flux.2-klein KV semantics) and the text-KV approximation.

Reference tokens carry a fixed timestep (t = 0) and attend only to themselves, so their
per-block K/V do not depend on the denoising step: they are extracted once and every step
reuses them (exact). Text tokens, in contrast, attend to the noisy image in joint mode, so
reusing their step-0 K/V later is an approximation: it is the explicit flag
``reuse_text_kv`` and its error is measured in ``sakura bench kv``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sakura.dit.attention import TXT, AttentionHook, KVSegment, Layout
from sakura.dit.model import MMDiT, Segments, TokenBatch, grid_positions, patchify


def reference_tokens(model: MMDiT, images: torch.Tensor):
    """Patchify reference images ``[K, 3, h, w]`` -> tokens ``[1, sum, P]``, positions, sizes.
    Only a model with the normalized (segment, row, col) positions places references (a
    segment each); one with FLUX's integer ids (the converted sakura-flux2) was trained
    without them."""
    if model.cfg.positions != "normalized":
        raise ValueError(f"reference images need a model with normalized positions; this "
                         f"one has {model.cfg.positions!r} (trained without references)")
    p, span = model.cfg.patch_size, model.cfg.pos_span
    toks, pos, sizes = [], [], []
    for i, img in enumerate(images):
        t = patchify(img[None].float(), p)
        toks.append(t)
        pos.append(grid_positions(img.shape[-1] // p, span, float(i + 1)))
        sizes.append(t.shape[1])
    return torch.cat(toks, dim=1), torch.cat(pos), tuple(sizes)


class _Record(AttentionHook):
    """Records K/V of the computed tokens of a given role range per block."""

    def __init__(self, mode: str, start: int, stop: int | None, extra=None):
        super().__init__(mode)
        self.start, self.stop = start, stop
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.extra = extra or {}

    def extra_kv(self, block: int):
        return list(self.extra.get(block, []))

    def on_kv(self, block: int, k, v, layout: Layout) -> None:
        stop = self.stop if self.stop is not None else k.shape[2]
        self.k[block] = k[:, :, self.start : stop].clone()
        self.v[block] = v[:, :, self.start : stop].clone()


@dataclass
class ReferenceKV:
    """Per-block K/V of each reference image (batch dim = guidance branches)."""

    k: list[dict[int, torch.Tensor]]
    v: list[dict[int, torch.Tensor]]

    @classmethod
    @torch.inference_mode()
    def extract(cls, model: MMDiT, req, guidance: float) -> ReferenceKV:
        """One pass over the reference tokens only (the "extract" step)."""
        txt = req.txt
        if req.txt_uncond is not None and guidance != 1.0:
            txt = torch.cat([req.txt, req.txt_uncond])
        b = txt.shape[0]
        ks, vs = [], []
        for i, img in enumerate(req.ref_images):
            toks, pos, sizes = reference_tokens(model, img[None])
            pos[:, 0] = float(i + 1)
            batch = TokenBatch(img=toks[:, :0].expand(b, -1, -1), img_pos=torch.zeros(0, 3),
                               txt=txt, t=torch.zeros(b), ref=toks.expand(b, -1, -1),
                               ref_pos=pos, text_tokens=False)
            seg = model.embed(batch)
            angles = {"txt": model.angles(torch.zeros(0, 3)), "img": model.angles(torch.zeros(0, 3)),
                      "ref": model.angles(pos)}
            hook = _Record(model.cfg.attention_mode, 0, None)
            model.run_blocks(seg, angles, hook, Layout(txt=0, img=0, ref=sizes[0]))
            ks.append(hook.k)
            vs.append(hook.v)
        return cls(ks, vs)

    def segments(self) -> dict[int, list[KVSegment]]:
        out: dict[int, list[KVSegment]] = {}
        for i, (kd, vd) in enumerate(zip(self.k, self.v)):
            for b in kd:
                out.setdefault(b, []).append(KVSegment(f"ref:{i}", kd[b], vd[b]))
        return out


def text_kv_segments(k: dict[int, torch.Tensor], v: dict[int, torch.Tensor]) -> dict[int, list[KVSegment]]:
    return {b: [KVSegment(TXT, k[b], v[b])] for b in k}


__all__ = ["ReferenceKV", "reference_tokens", "text_kv_segments", "Segments"]
