"""Image quality of an edit against a reference (``exact``): PSNR and SSIM.

Images are ``[3, H, W]`` tensors in [-1, 1] (the DiT's range); both metrics are computed
on [0, 1].
"""

from __future__ import annotations

import math

import torch


def _unit(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"expected an image [3, H, W], got {tuple(x.shape)}")
    return ((x.detach().float().cpu() + 1) / 2).clamp(0, 1)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB (inf for identical images)."""
    mse = float(((_unit(a) - _unit(b)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """SSIM (Gaussian window of 11 pixels, 7 for images smaller than 44 pixels)."""
    from pytorch_msssim import ssim as _ssim

    x, y = _unit(a)[None], _unit(b)[None]
    win = 11 if min(x.shape[-2:]) >= 44 else 7
    return float(_ssim(x, y, data_range=1.0, win_size=win, size_average=True))
