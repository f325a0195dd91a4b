"""int8 XNNPACK shard graphs (issue 31, item 6): PT2E quantization with ExecuTorch's
``XNNPACKQuantizer``, then the same XNNPACK lowering as the fp32 graphs.

Scheme: **dynamic** activations, **per-channel symmetric int8 weights**, on the Linear
layers only (``get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)``;
XNNPACK's dynamic config annotates ``linear`` and nothing else). Why dynamic rather than
static: a shard runs at every step of the schedule, and the DiT's activations change scale
with the timestep's modulation (shift/scale/gate), so one static activation range per Linear
calibrated on a few prompts either clips late steps or wastes resolution on early ones;
dynamic quantization takes each call's own per-row range, and XNNPACK runs it as its
QD8-F32-QC8W GEMM. Attention (the softmax over the streamed fp32 cache), the norms, RoPE
and the modulation arithmetic stay fp32, unannotated. Calibration passes are still run
(:func:`lower_int8` takes the profiling prompts' shard inputs, as
``edge.backends.qnn_quantized`` gathers them) so a static config drops in unchanged; with
the dynamic config the observers record nothing that the program keeps.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from sakura.edge import PRECISIONS
from sakura.edge.backends.executorch_backend import to_xnnpack


def check_precision(value: Any) -> str:
    """``value`` if it is a known precision, else one clear ``ValueError`` line."""
    if value not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return str(value)


def quantize_int8(module: torch.nn.Module, example: tuple[torch.Tensor, ...],
                  dynamic_shapes: Any = None,
                  calibration: Iterable[tuple[torch.Tensor, ...]] = ()) -> Any:
    """The PT2E-quantized (int8 dynamic, per-channel weights) ``ExportedProgram`` of
    ``module``, ready for :func:`executorch.exir.to_edge_transform_and_lower`."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (  # lazy: executorch
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import (  # lazy: torchao
        convert_pt2e,
        prepare_pt2e,
    )

    quantizer = XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        graph = torch.export.export(module, example, dynamic_shapes=dynamic_shapes,
                                    strict=False).module()
        prepared = prepare_pt2e(graph, quantizer)  # type: ignore[arg-type]
        prepared(*example)
        for inputs in calibration:
            prepared(*inputs)
        converted = convert_pt2e(prepared)
        if dynamic_shapes is not None:  # the converted graph takes flat positional args
            dynamic_shapes = _flat_shapes(module, dynamic_shapes, len(example))
        return torch.export.export(converted, example, dynamic_shapes=dynamic_shapes,
                                   strict=False)


def _flat_shapes(module: torch.nn.Module, dynamic_shapes: Any, n: int) -> tuple:
    """``dynamic_shapes`` of ``module.forward`` (a dict by name, or a tuple whose last entry
    holds the ``*args`` entries) as one entry per flat positional input."""
    params = list(inspect.signature(module.forward).parameters.values())
    named = [p for p in params if p.kind != inspect.Parameter.VAR_POSITIONAL]
    if isinstance(dynamic_shapes, dict):
        flat = [dynamic_shapes.get(p.name) for p in named]
        rest = dynamic_shapes.get(next((p.name for p in params
                                        if p.kind == inspect.Parameter.VAR_POSITIONAL), ""))
    else:
        flat, rest = list(dynamic_shapes[:len(named)]), dynamic_shapes[len(named):]
        rest = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
    flat += list(rest or ())
    return tuple(flat + [None] * (n - len(flat)))


def lower_int8(module: torch.nn.Module, example: tuple[torch.Tensor, ...],
               dynamic_shapes: Any = None,
               calibration: Iterable[tuple[torch.Tensor, ...]] = ()) -> bytes:
    """The XNNPACK-lowered int8 ``.pte`` bytes of ``module`` (see the module docstring)."""
    exported = quantize_int8(module, example, dynamic_shapes, calibration)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        lowered = to_xnnpack(exported)
        return lowered.to_executorch().buffer


def export_int8(module: torch.nn.Module, example: tuple[torch.Tensor, ...], path: Path,
                dynamic_shapes: Any = None,
                calibration: Iterable[tuple[torch.Tensor, ...]] = ()) -> int:
    """Write the int8 ``.pte`` of ``module`` to ``path``; returns its size in bytes."""
    pte = lower_int8(module, example, dynamic_shapes, calibration)
    Path(path).write_bytes(pte)
    return len(pte)
