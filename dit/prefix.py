"""Block-causal prefix caching (QwenImage 2.1 semantics).

The sequence is ``[text, reference_1, ..., reference_K, latents]``: text is causal, each
reference image is bidirectional within itself and sees the text and the references
before it, the noisy latents see everything, and the prefix never sees the latents. The
prefix is modulated with a fixed timestep, so it is step-independent: it is computed once,
segment by segment, and every denoising step runs only the latent tokens against the
cached prefix K/V. ``tests/dit/test_prefix.py`` checks this equals the same rule written
as one masked attention over all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sakura.dit.attention import TXT, AttentionHook, KVSegment, Layout
from sakura.dit.model import MMDiT, TokenBatch
from sakura.dit.refcache import _Record, reference_tokens


class _Extra(AttentionHook):
    def __init__(self, mode: str, extra: dict[int, list[KVSegment]]):
        super().__init__(mode)
        self.extra = extra

    def extra_kv(self, block: int) -> list[KVSegment]:
        return list(self.extra.get(block, []))


def _angles(model: MMDiT, txt_n: int, img_pos, ref_pos):
    z = torch.zeros(0, 3)
    return {"txt": model.angles(model.text_positions(txt_n)),
            "img": model.angles(img_pos if img_pos is not None else z),
            "ref": model.angles(ref_pos if ref_pos is not None else z)}


@dataclass
class PrefixKV:
    """Per-block K/V of the whole prefix, as a list of role-tagged segments per block."""

    segments: dict[int, list[KVSegment]]

    @classmethod
    @torch.inference_mode()
    def extract(cls, model: MMDiT, txt: torch.Tensor,
                ref_images: torch.Tensor | None = None) -> PrefixKV:
        if model.cfg.attention_mode != "block_causal":
            raise ValueError("prefix caching needs a model with attention_mode='block_causal'")
        mode, b = model.cfg.attention_mode, txt.shape[0]
        empty = txt.new_zeros(b, 0, model.cfg.patch_dim)
        t0 = torch.zeros(b)
        # 1) the text segment, causal, alone
        seg = model.embed(TokenBatch(img=empty, img_pos=torch.zeros(0, 3), txt=txt, t=t0))
        rec = _Record(mode, 0, None)
        model.run_blocks(seg, _angles(model, txt.shape[1], None, None), rec,
                         Layout(txt=txt.shape[1], img=0))
        segments = {blk: [KVSegment(TXT, rec.k[blk], rec.v[blk])] for blk in rec.k}
        # 2) each reference, seeing the text and the references before it
        for i, img in enumerate(ref_images if ref_images is not None else []):
            toks, pos, sizes = reference_tokens(model, img[None])
            pos[:, 0] = float(i + 1)
            batch = TokenBatch(img=empty, img_pos=torch.zeros(0, 3), txt=txt, t=t0,
                               ref=toks.expand(b, -1, -1), ref_pos=pos, text_tokens=False)
            seg = model.embed(batch)
            known = {blk: list(v) for blk, v in segments.items()}
            rec = _Record(mode, 0, None, extra=known)
            # The computed reference is segment "ref:i": give the layout i empty refs first.
            layout = Layout(txt=0, img=0, ref=sizes[0], ref_sizes=(0,) * i + sizes)
            model.run_blocks(seg, _angles(model, 0, None, pos), rec, layout)
            for blk in rec.k:
                segments[blk].append(KVSegment(f"ref:{i}", rec.k[blk], rec.v[blk]))
        return cls(segments)


@torch.inference_mode()
def latent_velocity(model: MMDiT, prefix: PrefixKV, x: torch.Tensor, pos: torch.Tensor,
                    t: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """One denoising step of the latents against the cached prefix."""
    batch = TokenBatch(img=x, img_pos=pos, txt=txt, t=t, text_tokens=False)
    return model(batch, _Extra(model.cfg.attention_mode, prefix.segments))
