"""The shared side of the SAKURA attention processors (each model's own are in
``flux2.py``, ``sd3.py``, ``qwenimage.py``, ``qwenimage21.py``): what they see of a running
forward and how they call its hook.

The adapter makes a :class:`RunContext` (the forward's hook, the computed rows, pins,
hidden-state capture) visible through its :class:`Channel` for one forward; a
:class:`Branch` is one guidance branch's prompt state (K/V computed once, references
recomputed, the RoPE key shift); :class:`Pins` are the slow reference's pinned hidden states.
:func:`hook_attend` runs a hook on diffusers-layout tensors, in SAKURA's token order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from sakura.dit.adapters.inputs import Conditioning, LatentImage
from sakura.dit.attention import AttentionHook, KVSegment, Layout


@dataclass
class Branch:
    """Per-prompt state of one guidance branch during an edit.

    ``extra``: K/V computed once and appended at every step (reference images, or the
    block-causal prefix). ``refs``: reference tokens recomputed every step instead
    (``cache_refs=False``). ``key_shift`` maps template-cache keys into this branch's RoPE
    frame (QwenImage 2.1, whose image position depends on the prompt length).
    """

    cond: Conditioning
    extra: dict[int, list[KVSegment]] = field(default_factory=dict)
    refs: list[LatentImage] = field(default_factory=list)
    key_shift: Callable[[torch.Tensor], torch.Tensor] | None = None
    embedded_guidance: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Pins:
    """Slow reference: pin the image hidden states at ``rows`` to the template run's at the
    input of every block; ``cond`` is the template's prompt (SD3.5: the pinned tokens keep the
    template's pooled-text modulation, as their cached K/V do)."""

    hidden: dict[int, torch.Tensor]
    rows: torch.Tensor
    cond: Conditioning


@dataclass
class RunContext:
    """What the SAKURA processors need during one forward (set by the adapter)."""

    hook: AttentionHook
    rows: torch.Tensor                 # grid rows of the computed target image tokens
    txt: int = 0                       # text tokens computed in this call
    ref: int = 0                       # reference tokens computed in this call (inline)
    pins: Pins | None = None
    keep: dict[int, torch.Tensor] | None = None
    scratch: dict[Any, Any] = field(default_factory=dict)


class Channel:
    """The adapter-owned slot through which processors see the running forward (or None)."""

    def __init__(self) -> None:
        self.active: RunContext | None = None


def hook_attend(hook: AttentionHook, block: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, txt: int, ref: int = 0, img_first: bool = False) -> torch.Tensor:
    """Run ``hook.attend`` on diffusers-layout ``[B, L, H, D]`` tensors.

    The native token order is ``[text, reference, image]`` (FLUX.2, Qwen) or ``[image,
    text]`` (``img_first``, SD3); SAKURA's is ``[text, image, reference]``. Returns the output
    in the native order, ``[B, L, H, D]``.
    """
    n = q.shape[1]
    img = n - txt - ref

    def to_hook(x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        if img_first:
            return torch.cat([x[:, :, img:], x[:, :, :img]], dim=2) if txt else x
        if ref:
            return torch.cat([x[:, :, :txt], x[:, :, txt + ref:], x[:, :, txt:txt + ref]], dim=2)
        return x

    layout = Layout(txt=txt, img=img, ref=ref, ref_sizes=(ref,) if ref else ())
    out = hook.attend(block, to_hook(q), to_hook(k), to_hook(v), layout)
    if img_first and txt:
        out = torch.cat([out[:, :, txt:], out[:, :, :txt]], dim=2)
    elif ref:
        out = torch.cat([out[:, :, :txt], out[:, :, txt + img:], out[:, :, txt:txt + img]], dim=2)
    return out.transpose(1, 2)
