"""The models' axial RoPE, described as data for the low-rank codecs.

RoPE is a property of the model, so the description is built here, in ``dit``; the codec
(``sakura.codec.lowrank``) receives the resulting dict as its ``rope`` option, checks it
(``check_rope``) and never imports the model side (see tests/test_layering.py).
"""

from __future__ import annotations

from typing import Any

import torch


def rope_option(positions: Any, axes: Any, theta: float, heads: int) -> dict[str, Any]:
    """The ``rope`` option of the low-rank codecs for a model with Flux-style axial RoPE.

    ``positions [N, len(axes)]`` are the positions of the cached tokens (in cache order),
    ``axes`` the rotary dims per position axis (summing to the head dim), ``theta`` the base.
    Channel pairs ``(2j, 2j + 1)`` of each head rotate by ``pos[axis] * theta ** (-2i / dim)``.
    The codec validates the dict when it is constructed with it (``LowRankOptions.validate``).
    """
    pos = torch.as_tensor(positions, dtype=torch.float64)
    return {"heads": int(heads), "axes": [int(a) for a in axes], "theta": float(theta),
            "positions": [[float(v) for v in row] for row in pos.tolist()]}
