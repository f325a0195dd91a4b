"""The torch backend: shard graphs run eagerly with the model's own weights (any host).

Nothing is compiled or cached. It is the reference the compiled backends are measured
against (and what ``--backend torch`` would give through shard graphs; the runtime's
default torch path runs ``dit.editing.cached_edit`` directly, which also handles
references and the text-KV approximation).
"""

from __future__ import annotations

from pathlib import Path

import torch
from sakura.edge.backends.base import CompiledShard, ExecutionBackend
from sakura.edge.backends.shard import ShardModule


class _EagerShard(CompiledShard):
    def __init__(self, module: ShardModule) -> None:
        super().__init__(module.blocks, module.input_shapes)
        self.module = module

    def _run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            return self.module(*inputs)


class TorchBackend(ExecutionBackend):
    """Eager PyTorch on the host CPU."""

    name = "torch"
    compiles = False

    def check_available(self) -> None:
        return None

    def version(self) -> str:
        return f"torch-{torch.__version__}"

    def _compile(self, module, example, folder: Path) -> None:  # pragma: no cover
        raise NotImplementedError

    def _load(self, folder: Path, module: ShardModule) -> CompiledShard:
        return _EagerShard(module)
