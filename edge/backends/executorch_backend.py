"""The ExecuTorch backend: ``torch.export`` -> XNNPACK-lowered ``.pte`` -> ``executorch.runtime``.

Each shard graph is exported with static shapes (the ``delegable`` form of
``edge.backends.shard``: only operators XNNPACK lowers), lowered with
``to_edge_transform_and_lower(..., partitioner=[XnnpackPartitioner()])`` (fp32) and
serialized to ``shard.pte``. The compile writes ExecuTorch's delegation info next to it
(``delegation.json``, ``edge.backends.delegation``): every compute op of the shard is
inside one XNNPACK subgraph, which the tests and ``sakura bench backends`` check. The same file runs on
an Android phone with the ExecuTorch runtime and its XNNPACK delegate (arm64 CPU); for the
Hexagon NPU the same exported program is lowered with ExecuTorch's QNN partitioner instead
(needs the QAIRT SDK, not available here; see ``edge/backends/README.md``).

:func:`export_dynamic` exports a graph with dynamic sizes instead (a ``ShardModule(...,
dynamic=True)`` with ``ShardBounds.dynamic_shapes``, ``StepIn`` / ``StepOut`` with
``step_dynamic_shapes``): one ``.pte`` for every template geometry within the bounds.
ExecuTorch plans its memory for the upper bounds (``MethodMeta`` reports them as the
inputs' and outputs' sizes); a caller sets inputs of the actual sizes and reads the
outputs' actual sizes from the output tensors (``Method::set_input`` resizes the planned
input tensor, the XNNPACK delegate resizes its outputs).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from sakura.edge.backends.base import CompiledShard, ExecutionBackend
from sakura.edge.backends.delegation import XnnpackDelegation, xnnpack_delegation
from sakura.edge.backends.errors import BackendError, BackendUnavailable
from sakura.edge.backends.shard import ShardModule

from sakura.extras import install_hint

PTE_NAME = "shard.pte"


def to_xnnpack(exported: Any) -> Any:
    """``to_edge_transform_and_lower`` with the XNNPACK partitioner: the one lowering of
    every ``.pte`` we write (fp32 here, int8 in ``edge.backends.int8``).

    Without ExecuTorch's edge-IR validity check (``_check_ir_validity=False``): the check
    only verifies, it rewrites nothing, and it ran again after every pass. Measured
    2026-12-07 on one torch thread here, a tiny MMDiT's two-block shard: the same ``.pte``
    bytes (sha256 equal, static and dynamic forms), 39.6 -> 33.1 s for the dynamic graph
    and 21.7 -> 17.6 s for the static one. What the check would have caught, an operator
    outside the delegate, the delegation info catches (``edge.backends.delegation``: the
    tests and ``sakura bench backends`` assert every compute op is inside XNNPACK)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner,
    )
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    return to_edge_transform_and_lower(
        exported, partitioner=[XnnpackPartitioner()],
        compile_config=EdgeCompileConfig(_check_ir_validity=False))


def lower(module: torch.nn.Module, example: tuple[torch.Tensor, ...],
          dynamic_shapes: Any = None) -> tuple[bytes, XnnpackDelegation]:
    """``torch.export`` (static, or with ``dynamic_shapes``) -> XNNPACK-lowered program:
    the ``.pte`` bytes and ExecuTorch's delegation info of the lowered graph."""
    with torch.no_grad(), warnings.catch_warnings():
        # the exporter's own deprecation notices (pytree LeafSpec), not ours to act on
        warnings.simplefilter("ignore", FutureWarning)
        exported = torch.export.export(module, example, dynamic_shapes=dynamic_shapes,
                                       strict=False)
        lowered = to_xnnpack(exported)
        delegation = xnnpack_delegation(lowered.exported_program().graph_module)
        program = lowered.to_executorch()
    return program.buffer, delegation


def export_dynamic(module: torch.nn.Module, example: tuple[torch.Tensor, ...],
                   dynamic_shapes: Any, path: Path) -> XnnpackDelegation:
    """Write the XNNPACK-lowered ``.pte`` of ``module`` with dynamic sizes to ``path``.

    ``example`` is traced (its sizes must lie inside the bounds and not be 0 or 1);
    ``dynamic_shapes`` as ``torch.export`` takes it. Returns the delegation info (callers
    check that nothing is left outside the delegate).
    """
    pte, delegation = lower(module, example, dynamic_shapes)
    Path(path).write_bytes(pte)
    return delegation


class _PteShard(CompiledShard):
    def __init__(self, module: ShardModule, method) -> None:
        super().__init__(module.blocks, module.input_shapes)
        self._method = method

    def _run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._method.execute(inputs)
        if len(out) != 2:
            raise BackendError(f"executorch shard {self.blocks}: {len(out)} outputs, want 2")
        return out[0], out[1]


class ExecuTorchBackend(ExecutionBackend):
    """ExecuTorch with the XNNPACK delegate (fp32)."""

    name = "executorch"
    sigmoid_gelu = True
    delegable = True

    def check_available(self) -> None:
        try:
            import executorch.runtime  # noqa: F401
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import (  # noqa: F401
                XnnpackPartitioner,
            )
        except ImportError as exc:
            raise BackendUnavailable(
                f"--backend executorch needs the executorch package ({exc}); install it: "
                f"{install_hint('executorch')}") from exc

    def version(self) -> str:
        from importlib.metadata import version

        return (f"executorch-{version('executorch')}-xnnpack-fp32-sigmoid-gelu-delegable-"
                f"torch-{torch.__version__}")

    def _compile(self, module: ShardModule, example: tuple[torch.Tensor, ...],
                 folder: Path) -> None:
        pte, delegation = lower(module, example)
        delegation.write(folder)
        (folder / PTE_NAME).write_bytes(pte)

    def delegation(self, folder: Path) -> XnnpackDelegation:
        """The delegation info recorded when ``folder``'s shard was compiled."""
        return XnnpackDelegation.read(folder)

    def _load(self, folder: Path, module: ShardModule) -> CompiledShard:
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(str(folder / PTE_NAME))
        return _PteShard(module, program.load_method("forward"))
