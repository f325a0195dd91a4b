"""Execution backends of the edge runtime: torch, ExecuTorch (XNNPACK), QNN HTP.

A backend runs *shard graphs* (``edge.backends.shard``): the blocks of one shard of the
pack as a pure function of tensors, with the streamed cache as inputs.
:class:`~edge.backends.executor.ShardExecutor` runs a whole masked edit on one backend.
Backends are created by name from a small registry (as LMCache v1 creates its storage
back-ends by name); modules are imported only when their backend is asked for, so the
runtime works without executorch / onnxruntime-qnn installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from sakura.edge.backends.errors import BackendError, BackendUnavailable, GeometryMismatch

if TYPE_CHECKING:
    from sakura.edge.backends.base import BackendConfig, ExecutionBackend

_LAZY = {"BackendConfig", "ExecutionBackend"}  # torch-backed: loaded on first use, so that
# importing a light submodule (errors, cli) does not import torch (`sakura --help`)


def __getattr__(name: str):
    if name in _LAZY:
        from sakura.edge.backends import base  # lazy: torch

        return getattr(base, name)
    raise AttributeError(f"module 'sakura.edge.backends' has no attribute {name!r}")

# name -> "module:class"
REGISTRY: dict[str, str] = {
    "torch": "sakura.edge.backends.torch_backend:TorchBackend",
    "executorch": "sakura.edge.backends.executorch_backend:ExecuTorchBackend",
    "qnn": "sakura.edge.backends.qnn_backend:QnnBackend",
}
BACKENDS = tuple(REGISTRY)


def backend_class(name: str) -> type[ExecutionBackend]:
    try:
        target = REGISTRY[name]
    except KeyError:
        raise BackendError(f"unknown backend {name!r} (known: {', '.join(REGISTRY)})") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, config: BackendConfig | None = None) -> ExecutionBackend:
    """A backend instance by name; raises :class:`BackendUnavailable` when it cannot run."""
    backend = backend_class(name)(config)
    backend.check_available()
    return backend


__all__ = ["BACKENDS", "REGISTRY", "BackendConfig", "BackendError", "BackendUnavailable",
           "ExecutionBackend", "GeometryMismatch", "backend_class", "create_backend"]
