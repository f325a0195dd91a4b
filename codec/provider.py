"""KV providers backed by a pack: decoded shards served as ``get(step, block) -> (K, V)``.

:class:`PackProvider` decodes the chosen configuration of each shard on first use (reading
verified bytes from a :class:`~codec.pack.PackReader`, or from any ``fetch(shard,
config) -> bytes`` callable) and keeps the most recent shards; it records the decode time
of every shard. :class:`DecodedProvider` wraps shards decoded up front.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch
from sakura.codec.base import Codec
from sakura.codec.errors import PackError
from sakura.codec.pack import Manifest, PackReader, decode_config
from sakura.codec.shards import ShardLayout


class DecodedProvider:
    """A ``KVProvider`` over already decoded shards (list indexed by shard)."""

    def __init__(self, layout: ShardLayout, shards: list[list[torch.Tensor]]) -> None:
        if len(shards) != layout.num_shards:
            raise PackError(f"{len(shards)} decoded shards, layout has {layout.num_shards}")
        self.layout = layout
        self.shards = shards

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        mats = self.shards[self.layout.shard_of(step, block)]
        j = block % self.layout.blocks_per_shard
        return mats[2 * j], mats[2 * j + 1]


class PackProvider:
    """A ``KVProvider`` that decodes shards of a pack on demand.

    ``choice[i]`` is the configuration id used for shard ``i``; ``source`` is a
    :class:`PackReader` or a ``fetch(shard, config_id) -> bytes`` callable.
    """

    def __init__(
        self,
        manifest: Manifest,
        source: PackReader | Callable[[int, int], bytes],
        choice: list[int],
        keep: int = 2,
    ) -> None:
        if len(choice) != len(manifest.shards):
            raise PackError(f"choice has {len(choice)} entries, pack has {len(manifest.shards)}")
        for s, c in zip(manifest.shards, choice):
            s.config(c)  # raises for unknown ids
        self.manifest = manifest
        self.layout = manifest.layout()
        self.choice = list(choice)
        self.fetch = source.read_config if isinstance(source, PackReader) else source
        self.codec: Codec = manifest.make_codec()
        self.keep = max(1, keep)
        self._cache: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self.decode_seconds: dict[int, float] = {}

    def shard(self, index: int) -> list[torch.Tensor]:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        data = self.fetch(index, self.choice[index])
        t0 = time.perf_counter()
        mats = decode_config(self.manifest, index, self.choice[index], data, self.codec)
        self.decode_seconds[index] = time.perf_counter() - t0
        self._cache[index] = mats
        while len(self._cache) > self.keep:
            self._cache.popitem(last=False)
        return mats

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        mats = self.shard(self.layout.shard_of(step, block))
        j = block % self.layout.blocks_per_shard
        return mats[2 * j], mats[2 * j + 1]
