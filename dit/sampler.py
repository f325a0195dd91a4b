"""Rectified-flow sampling: the timestep schedule, Euler steps and full generation.

Convention: ``x_t = (1 - t) x_0 + t e`` with ``t`` from 1 (noise) to 0 (image); the model
predicts the velocity ``v = e - x_0``; an Euler step is ``x_{t'} = x_t + (t' - t) v``.
"""

from __future__ import annotations

import torch
from sakura.dit.model import MMDiT, TokenBatch, grid_positions, patchify, unpatchify


def schedule(steps: int, shift: float = 1.0) -> torch.Tensor:
    """``steps + 1`` timesteps from 1 to 0 (time-shifted as in SD3/Flux when shift != 1)."""
    t = torch.linspace(1.0, 0.0, steps + 1)
    return shift * t / (1 + (shift - 1) * t)


def noise_like(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(int(seed)))


def cfg_velocity(model: MMDiT, batch: TokenBatch, txt_uncond: torch.Tensor | None,
                 guidance: float, hook=None) -> torch.Tensor:
    """Velocity with classifier-free guidance (one batched call for cond + uncond)."""
    if txt_uncond is None or guidance == 1.0:
        return model(batch, hook)
    b = batch.img.shape[0]
    both = TokenBatch(
        img=torch.cat([batch.img, batch.img]), img_pos=batch.img_pos,
        txt=torch.cat([batch.txt, txt_uncond.expand_as(batch.txt)]),
        t=torch.cat([batch.t, batch.t]),
        ref=None if batch.ref is None else torch.cat([batch.ref, batch.ref]),
        ref_pos=batch.ref_pos,
    )
    v = model(both, hook)
    cond, uncond = v[:b], v[b:]
    return uncond + guidance * (cond - uncond)


@torch.inference_mode()
def generate(model: MMDiT, txt: torch.Tensor, txt_uncond: torch.Tensor | None, size: int,
             seed: int, steps: int = 20, guidance: float = 3.0,
             ref_images: torch.Tensor | None = None) -> torch.Tensor:
    """Full generation: ``txt [B, T, 384]`` -> images ``[B, 3, size, size]`` in [-1, 1]."""
    cfg = model.cfg
    b = txt.shape[0]
    grid = size // cfg.patch_size
    pos = grid_positions(grid, cfg.pos_span)
    x = noise_like((b, grid * grid, cfg.patch_dim), seed)
    ref = ref_pos = None
    if ref_images is not None:
        ref = patchify(ref_images, cfg.patch_size)
        ref_pos = grid_positions(ref_images.shape[-1] // cfg.patch_size, cfg.pos_span, 1.0)
    ts = schedule(steps)
    for i in range(steps):
        t = ts[i].expand(b)
        batch = TokenBatch(img=x, img_pos=pos, txt=txt, t=t, ref=ref, ref_pos=ref_pos)
        v = cfg_velocity(model, batch, txt_uncond, guidance)
        x = x + (ts[i + 1] - ts[i]) * v
    return unpatchify(x, cfg.patch_size, cfg.in_channels, size).clamp(-1, 1)
