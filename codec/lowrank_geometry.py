"""The shard geometry of the SAKURA low-rank codec: the rank ladders (the coding units'
segment boundaries, the format-1 configuration ladder) and the sizes derived for one shard
(levels, per-level bits, components stored per level, bytes of one component at a level).
"""

from __future__ import annotations

from dataclasses import dataclass

from sakura.codec.quant import ProgressiveQuantizer, SegmentPlan, packed_row_bytes

BASE_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Configuration ladder of pack format 1 and of the uniform (ablation) configurations; the
reference front ``bytes_vs_pareto`` is measured against."""
UNIT_LADDER = (*range(1, 11), 12, 14, 16, 18, 20, 22, 24, 28, 32, 36, 40, 44, 48, 56, 64, 72,
               80, 88, 96, 112, 128, 144, 160, 176, 192, 224, 256, 288, 320, 352, 384, 448, 512)
"""Segment boundaries of the embedded streams' coding units (steps of at most 1/8 above
rank 16). Measured on the catalog's caches (face-technologist, 2 blocks per shard): the
format-1 ladder as units needs a median 1.026x the bytes of the free layout's Pareto
configurations (mean 1.045x), this one 1.011x (mean 1.011x); encoding takes about 1.3x."""


@dataclass(frozen=True)
class ShardGeometry:
    """Derived sizes for one shard geometry."""

    matrices: int
    tokens: int
    channels: int
    group: int
    bits: tuple[int, ...]
    ladder: tuple[int, ...]  # segment boundaries of the coding units
    level_max: tuple[int, ...]  # mean rank stored per level
    reference: tuple[int, ...] = ()  # the configuration ladder of format 1 (uniform configs)

    @property
    def levels(self) -> int:
        return len(self.bits)

    @property
    def level_bits(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip((0,) + self.bits[:-1], self.bits))

    @property
    def plan(self) -> SegmentPlan:
        return SegmentPlan(parts=(self.tokens, self.channels), group=self.group)

    def quantizer(self) -> ProgressiveQuantizer:
        return ProgressiveQuantizer(self.plan, self.level_bits)

    def chunk_bytes(self, level: int) -> int:
        """Bytes of one component at ``level``: level 0 adds the matrix index and steps."""
        codes = packed_row_bytes(self.tokens + self.channels, self.level_bits[level])
        return codes + (1 + 2 * self.plan.groups if level == 0 else 0)
