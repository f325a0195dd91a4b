"""The arithmetic pieces of a shard graph, each written the way a backend needs it.

The plain graph's RoPE with precomputed cos/sin, layer norm (at the model's eps:
``MMDiTConfig.layer_norm_eps``), tanh-GELU as ``x * sigmoid(2y)`` (XNNPACK's tanh is
approximate), SwiGLU (``MMDiTConfig.mlp_act="swiglu"``, the converted FLUX.2) and RMSNorm
written out (the QNN HTP's ``Pow``), and what the delegable and dynamic forms are built
from: :func:`free_shape` (a reshape XNNPACK lowers),
the mean XNNPACK takes, one linear per output block of a fused linear, and the exact RoPE
matrices. Why each form exists: ``edge/backends/shard.py``'s docstring and each function's
own (with the measurements that justify them). :class:`~edge.backends.shard.ShardModule`
uses them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``dit.model.apply_rope`` with precomputed cos/sin (same arithmetic)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


def _layer_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` without affine parameters (torch's eps 1e-5 by default, which is
    the shipped model's; ``MMDiTConfig.layer_norm_eps`` of a converted model)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def _swiglu(a: torch.Tensor, b: torch.Tensor, explicit: bool = False) -> torch.Tensor:
    """``dit.model.SwiGLU`` of the halves ``[a, b]``: ``silu(a) * b``, bit for bit;
    ``explicit``: ``a * sigmoid(a) * b`` (XNNPACK lowers ``sigmoid`` and ``mul``; the same
    function up to float32 rounding: measured 2.3e-7 relative at most, over 1e6 samples)."""
    if explicit:
        return a * torch.sigmoid(a) * b
    return F.silu(a) * b


def _sigmoid_gelu(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU as ``x * sigmoid(2y)`` (``0.5 (1 + tanh y) = sigmoid(2y)``).

    XNNPACK's tanh is approximate (measured: 4.7e-4 abs error on GELU outputs of ~12, which
    put ExecuTorch shard outputs 2.4e-3 off torch); its sigmoid is accurate (4.8e-7).
    """
    y = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return x * torch.sigmoid(2.0 * y)


def _explicit_rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``RMSNorm`` written as ``x * rsqrt(mean(x * x) + eps) * w``.

    The ONNX export of ``F.rms_norm`` squares with ``Pow``; on the QNN HTP (fp16, x86
    simulator, onnxruntime-qnn 2.7.0 / QAIRT 2.51) that graph returned zeros for half of
    the text-token rows of the shipped model (16 text tokens); ``x * x`` does not.
    """
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + norm.eps) * norm.weight


def free_shape(shape) -> list[int]:
    """``shape`` with its dynamic (symbolic, while exporting) size written as -1.

    XNNPACK lowers a reshape only when every size is a constant and at most one is
    inferred; outside an export every size is an int and this is ``list(shape)``.
    """
    out = [d if isinstance(d, int) else -1 for d in shape]
    if out.count(-1) > 1:
        raise ValueError(f"a reshape with more than one dynamic size: {tuple(shape)}")
    return out


def _mean_last(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(-1, keepdim=True)`` as XNNPACK's mean (4-D input, dims 2 and 3, keepdim)."""
    *lead, c = x.shape
    return x.reshape(1, -1, 1, c).mean((2, 3), keepdim=True).reshape(free_shape((*lead, 1)))


def _split_linear(lin: nn.Linear, sizes: list[int]) -> list[nn.Linear]:
    """One linear per output block of ``lin`` (rows of its weight): ``lin(x).split(sizes,
    -1)`` without slicing the ``[.., M, sum(sizes)]`` output."""
    out, start = [], 0
    for n in sizes:
        part = nn.Linear(lin.in_features, n, bias=lin.bias is not None,
                         device=lin.weight.device, dtype=lin.weight.dtype)
        with torch.no_grad():
            part.weight.copy_(lin.weight[start:start + n])
            if lin.bias is not None:
                part.bias.copy_(lin.bias[start:start + n])
        out.append(part.requires_grad_(False))
        start += n
    return out


def _rope_matrices(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``E [hd/2, hd]`` repeats each angle for its pair; ``R [hd, hd]`` maps a pair
    ``(x1, x2)`` to ``(-x2, x1)``. Both have one non-zero (+-1) per column: exact."""
    half = head_dim // 2
    e = torch.zeros(half, head_dim)
    r = torch.zeros(head_dim, head_dim)
    for i in range(half):
        e[i, 2 * i] = e[i, 2 * i + 1] = 1.0
        r[2 * i + 1, 2 * i] = -1.0
        r[2 * i, 2 * i + 1] = 1.0
    return e, r
