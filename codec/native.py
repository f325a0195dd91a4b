"""The switch between the native (C++, ``sakura_native``) and the Python sakura decoder.

``available()`` says whether the native module imports and is enabled (``SAKURA_NATIVE=0``
in the environment forces Python); :func:`decode_lowrank` is what
:meth:`codec.lowrank.LowRankCodec.decode` calls once it has validated the bytes and the
parameters. Both decoders give bit-equal dequantized factors; the K/V tensors differ only
by float32 summation order in the low-rank product (see ``native/README.md``).
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from sakura.codec.errors import PackError

ENV = "SAKURA_NATIVE"


@dataclass(frozen=True)
class NativeStatus:
    """Whether the native decoder is used, and why not when it is not."""

    enabled: bool
    reason: str
    kernel: str | None = None


def module() -> ModuleType | None:
    """The ``sakura_native`` module, or None when it is not built (or disabled)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return _import()


@functools.cache
def _import() -> ModuleType | None:
    # memoised: a failed import searches sys.path again on every call (every shard)
    try:
        return importlib.import_module("sakura_native")
    except ImportError:
        return None


def available() -> bool:
    return module() is not None


def status() -> NativeStatus:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return NativeStatus(False, f"disabled by {ENV}=0")
    mod = module()
    if mod is None:
        return NativeStatus(False, "sakura_native is not built (pip install ./native)")
    return NativeStatus(True, "sakura_native imported", mod.product_kernel())


def decode_lowrank(
    data: bytes,
    ranks: list[int],
    rope_table: torch.Tensor | None,
    threads: int = 1,
    mod: ModuleType | None = None,
) -> list[torch.Tensor]:
    """Decode one validated sakura/svd configuration natively: ``M`` tensors ``[N, C]``.

    ``rope_table`` is ``[N, C/2, 2]`` float32 (cos, sin) for the keys, or None. Raises
    :class:`PackError` for bytes the native decoder rejects.
    """
    mod = mod or module()
    if mod is None:
        raise PackError(f"the native decoder is not available ({status().reason})")
    if not isinstance(threads, int) or threads < 1:
        raise PackError(f"threads must be a positive int, got {threads!r}")
    table = None
    if rope_table is not None:
        table = np.ascontiguousarray(rope_table.detach().cpu().numpy(), dtype=np.float32)
        if table.ndim != 3 or table.shape[2] != 2:
            raise PackError(f"rope table must be [N, C/2, 2], got {table.shape}")
    try:
        out = mod.decode(bytes(data), [int(r) for r in ranks], table, threads)
    except mod.FormatError as exc:
        raise PackError(f"native decode: {exc}") from None
    return list(torch.from_numpy(out).unbind(0))
