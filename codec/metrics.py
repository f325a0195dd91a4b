"""Quality measures shared by codecs, profiling and the bench.

``weighted_err`` is the importance-weighted relative reconstruction error of a shard:
the mean over its matrices of ``sum_i p_i ||x_i - xhat_i||^2 / sum_i p_i ||x_i||^2`` where
``p`` is the block's importance normalised to mean 1 and clamped below at ``floor``
(cached tokens that masked queries never look at still count a little).
"""

from __future__ import annotations

import math

import torch

DEFAULT_FLOOR = 1e-3


def normalized_importance(importance: torch.Tensor, floor: float = DEFAULT_FLOOR) -> torch.Tensor:
    """Importance scaled to mean 1, clamped below at ``floor``; uniform if all zero."""
    imp = importance.double().clamp_min(0)
    mean = imp.mean()
    if not torch.isfinite(mean) or mean <= 0:
        return torch.ones_like(imp)
    return (imp / mean).clamp_min(floor)


def weighted_rel_error(
    originals: list[torch.Tensor],
    decoded: list[torch.Tensor],
    importance: list[torch.Tensor],
    floor: float = DEFAULT_FLOOR,
) -> float:
    """Mean over matrices of the importance-weighted relative squared error."""
    errs = []
    for x, y, imp in zip(originals, decoded, importance, strict=True):
        p = normalized_importance(imp, floor)
        x64 = x.double()
        num = (p[:, None] * (x64 - y.double()) ** 2).sum()
        den = (p[:, None] * x64**2).sum()
        errs.append(float(num / den) if den > 0 else float(num > 0))
    return sum(errs) / max(len(errs), 1)


def err_to_db(err: float) -> float:
    """A relative squared error as a PSNR-like figure: ``-10 log10(err)`` (capped at 200)."""
    if err <= 0:
        return 200.0
    return min(200.0, -10.0 * math.log10(err))


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> float:
    """PSNR in dB of two images/tensors with values in ``[0, data_range]``."""
    mse = float(((a.double() - b.double()) ** 2).mean())
    if mse <= 0:
        return 200.0
    return min(200.0, 10.0 * math.log10(data_range**2 / mse))
