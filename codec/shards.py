"""Shard layout: how a template cache is cut into the units the allocator chooses between.

A shard is ``blocks_per_shard`` consecutive blocks of one denoising step, in execution
order (step 0 blocks 0..B-1, then step 1, ...). When ``blocks`` is not a multiple of
``blocks_per_shard`` the last shard of every step holds the remaining blocks. Shard ``i``
holds ``2 * len(blocks)`` matrices ``[N, C]``: block0 K, block0 V, block1 K, ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sakura.codec.errors import CodecError


@dataclass(frozen=True)
class ShardLayout:
    """Maps (step, block) to shard indices and back."""

    steps: int
    blocks: int
    blocks_per_shard: int

    def __post_init__(self) -> None:
        if self.steps < 1 or self.blocks < 1:
            raise CodecError(f"need at least one step and block, got {self.steps}x{self.blocks}")
        if not 1 <= self.blocks_per_shard <= self.blocks:
            raise CodecError(
                f"blocks_per_shard must be in 1..{self.blocks}, got {self.blocks_per_shard}"
            )

    @property
    def shards_per_step(self) -> int:
        return -(-self.blocks // self.blocks_per_shard)

    @property
    def num_shards(self) -> int:
        return self.steps * self.shards_per_step

    def shard_of(self, step: int, block: int) -> int:
        if not (0 <= step < self.steps and 0 <= block < self.blocks):
            raise CodecError(f"(step {step}, block {block}) outside {self.steps}x{self.blocks}")
        return step * self.shards_per_step + block // self.blocks_per_shard

    def blocks_of(self, shard: int) -> tuple[int, list[int]]:
        step, blocks = self.block_range(shard)
        return step, list(blocks)

    def block_range(self, shard: int) -> tuple[int, range]:
        """``(step, range of blocks)`` of ``shard`` (a range: a manifest's geometry can be
        checked against its shards without building a list of its size)."""
        if not 0 <= shard < self.num_shards:
            raise CodecError(f"shard {shard} outside 0..{self.num_shards - 1}")
        step, j = divmod(shard, self.shards_per_step)
        first = j * self.blocks_per_shard
        return step, range(first, min(first + self.blocks_per_shard, self.blocks))


@dataclass(frozen=True)
class ShardSpec:
    """What a decoder needs to know about a shard besides its bytes."""

    index: int
    step: int
    blocks: tuple[int, ...]
    tokens: int
    channels: int
    total_blocks: int
    total_steps: int

    @property
    def num_matrices(self) -> int:
        return 2 * len(self.blocks)


@dataclass(frozen=True)
class ShardData:
    """The tensors of one shard, as an encoder receives them."""

    spec: ShardSpec
    matrices: list[torch.Tensor]
    """``2 * len(blocks)`` float32 ``[N, C]`` tensors: block0 K, block0 V, block1 K, ..."""
    importance: list[torch.Tensor]
    """One non-negative ``[N]`` tensor per matrix (K and V of a block share the block's)."""


def shard_spec(layout: ShardLayout, shard: int, tokens: int, channels: int) -> ShardSpec:
    step, blocks = layout.blocks_of(shard)
    return ShardSpec(
        index=shard,
        step=step,
        blocks=tuple(blocks),
        tokens=tokens,
        channels=channels,
        total_blocks=layout.blocks,
        total_steps=layout.steps,
    )


def shard_data(cache, layout: ShardLayout, shard: int) -> ShardData:
    """Cut shard ``shard`` out of a :class:`dit.cache.TemplateCache`."""
    spec = shard_spec(layout, shard, cache.tokens, cache.channels)
    mats: list[torch.Tensor] = []
    imps: list[torch.Tensor] = []
    for b in spec.blocks:
        imp = cache.importance[spec.step, b].float()
        mats += [cache.keys[spec.step, b].float(), cache.values[spec.step, b].float()]
        imps += [imp, imp]
    return ShardData(spec=spec, matrices=mats, importance=imps)


def check_layout(cache, layout: ShardLayout) -> None:
    """Raise :class:`CodecError` when the cache does not match the layout."""
    if tuple(cache.keys.shape) != tuple(cache.values.shape):
        raise CodecError(f"keys {tuple(cache.keys.shape)} != values {tuple(cache.values.shape)}")
    if cache.keys.dim() != 4:
        raise CodecError(f"cache keys must be [S, B, N, C], got {tuple(cache.keys.shape)}")
    if (cache.steps, cache.blocks) != (layout.steps, layout.blocks):
        raise CodecError(
            f"cache has {cache.steps} steps x {cache.blocks} blocks, layout "
            f"{layout.steps} x {layout.blocks}"
        )
    if tuple(cache.importance.shape) != (cache.steps, cache.blocks, cache.tokens):
        raise CodecError(
            f"importance must be [S, B, N] = {(cache.steps, cache.blocks, cache.tokens)}, "
            f"got {tuple(cache.importance.shape)}"
        )
