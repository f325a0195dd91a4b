"""The codec interface and the codec registry.

A codec encodes one shard at a time (:class:`~codec.shards.ShardData`) into byte *units*
plus a list of *configurations*; each configuration names the units it needs (indices
into the shard's unit list, ascending, so that the bytes of a configuration are the
concatenation of its units in file order). ``decode(params, data, spec)`` turns those
bytes back into the shard's ``2 * blocks`` ``[N, C]`` float32 tensors.

Codecs register themselves in :data:`CODECS` (the only global state of the package) and
are built with :func:`get_codec`.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from sakura.codec.errors import CodecError
from sakura.codec.shards import ShardData, ShardSpec


@dataclass
class EncodedConfig:
    """One way to serve a shard: codec parameters and the units it needs."""

    params: dict[str, Any]
    units: list[int]
    """Indices into :attr:`EncodedShard.units`, ascending."""
    weighted_err: float | None = None
    """Filled by codecs that compute it cheaply at encode time; else profiling decodes."""


@dataclass
class EncodedShard:
    units: list[bytes]
    configs: list[EncodedConfig]
    meta: dict[str, Any] = field(default_factory=dict)

    def config_bytes(self, i: int) -> int:
        return sum(len(self.units[u]) for u in self.configs[i].units)

    def config_data(self, i: int) -> bytes:
        return b"".join(self.units[u] for u in self.configs[i].units)

    @property
    def stored_bytes(self) -> int:
        return sum(len(u) for u in self.units)


class Codec(ABC):
    """Base class of all codecs. Subclasses set ``name`` and implement encode/decode."""

    name: ClassVar[str]

    @property
    @abstractmethod
    def options(self) -> dict[str, Any]:
        """JSON-serialisable options; ``get_codec(name, **options)`` rebuilds the codec."""

    @abstractmethod
    def encode_shard(self, shard: ShardData) -> EncodedShard:
        """Encode one shard into units and configurations."""

    @abstractmethod
    def decode(self, params: dict[str, Any], data: bytes, spec: ShardSpec) -> list[torch.Tensor]:
        """Decode one configuration's bytes into ``spec.num_matrices`` ``[N, C]`` tensors."""

    def rank_key(self, params: dict[str, Any]) -> float:
        """Nominal quality order of a configuration (higher is better), used as a fallback."""
        return 0.0


CODECS: dict[str, Callable[..., Codec]] = {}


def register(name: str) -> Callable[[Callable[..., Codec]], Callable[..., Codec]]:
    """Class/factory decorator: ``@register("intq")``."""

    def deco(factory: Callable[..., Codec]) -> Callable[..., Codec]:
        CODECS[name] = factory
        return factory

    return deco


def get_codec(name: str, **options: Any) -> Codec:
    """Build a registered codec; unknown names/options raise :class:`CodecError`."""
    load_builtin()
    if name not in CODECS:
        raise CodecError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}")
    factory = CODECS[name]
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as exc:
        raise CodecError(f"bad options for codec {name!r}: {exc}") from None
    return factory(**options)


def load_builtin() -> None:
    """Import (and so register) the built-in codecs. Callers that time what follows call it
    first: the first import costs tens of milliseconds (58 ms in a fresh ``sakura edit``
    process on this machine, measured with cProfile)."""
    # lazy: cycle with the codec modules (each imports sakura.codec.base to register)
    from sakura.codec import cachegen, fp16, intq, lowrank  # noqa: F401
