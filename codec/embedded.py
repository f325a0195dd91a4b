"""The embedded progressive stream of a low-rank shard: its header, its coding units and
their rate-distortion order.

A coding unit is one rank segment at one precision level: the chunks of components
``[ladder[i-1] * M, ladder[i] * M)`` at level ``l`` (``M`` matrices, ``ladder`` the mean-rank
ladder). A unit of level ``l`` needs the same segment at level ``l - 1`` (it refines those
values) and the previous segment at level ``l`` (chunks of a level are in component
order), so the units received so far always form a *staircase* of per-level ranks
``r_0 >= r_1 >= ... >= r_{L-1}``. A stream is a header that lists its units' levels, then the
units in that order: every prefix that ends on a unit boundary is a valid configuration,
and a configuration is one byte range (header through its last unit).

:func:`rd_path` orders the units of the main stream greedily by rate-distortion slope, as
embedded image coders do: from the current staircase it jumps to the staircase that
dominates it with the steepest error decrease per byte (a lower convex hull step over every
staircase of the ladder), and walks there one unit at a time, each step again the best
slope among the units allowed. :func:`uniform_path` is the order of a fixed-precision
stream (every segment at all levels up to one precision), which the ablation packs add.
Layout: ``FORMAT.md``, section 3.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sakura.codec.errors import PackError
from sakura.codec.quant import SegmentPlan, packed_row_bytes

MAGIC = b"SKLR"
VERSION = 2
FIXED = struct.Struct("<4sBBHIIH")  # magic, version, levels, matrices, N, C, group

Staircase = tuple[int, ...]


@dataclass(frozen=True)
class StreamHeader:
    """Geometry, precision levels, rank ladder and unit order of one shard stream."""

    levels: int
    matrices: int
    tokens: int
    channels: int
    group: int
    level_bits: tuple[int, ...]
    ladder: tuple[int, ...]
    unit_levels: tuple[int, ...]

    @property
    def size(self) -> int:
        return (FIXED.size + self.levels + 2 + -(-self.ladder[-1] // 8) + 2
                + -(-len(self.unit_levels) // 2))

    def chunk_bytes(self, level: int) -> int:
        """Bytes of one component at ``level``: level 0 adds the matrix index and steps."""
        codes = packed_row_bytes(self.tokens + self.channels, self.level_bits[level])
        groups = SegmentPlan(parts=(self.tokens, self.channels), group=self.group).groups
        return codes + (1 + 2 * groups if level == 0 else 0)

    def pack(self) -> bytes:
        out = FIXED.pack(MAGIC, VERSION, self.levels, self.matrices, self.tokens, self.channels,
                         self.group)
        out += bytes(self.level_bits)
        top = self.ladder[-1]
        bitmap = bytearray(-(-top // 8))
        for r in self.ladder:
            bitmap[(r - 1) // 8] |= 1 << ((r - 1) % 8)
        out += struct.pack("<H", top) + bytes(bitmap)
        nibbles = bytearray(-(-len(self.unit_levels) // 2))
        for k, lv in enumerate(self.unit_levels):
            nibbles[k // 2] |= lv << (4 * (k % 2))
        out += struct.pack("<H", len(self.unit_levels)) + bytes(nibbles)
        return out

    @classmethod
    def parse(cls, data: bytes, where: str = "shard") -> StreamHeader:
        """Parse and check a stream header (raises :class:`PackError` with the reason)."""
        if len(data) < FIXED.size + 1:
            raise PackError(f"{where}: {len(data)} bytes is too short for a header")
        magic, version, levels, m_count, n, c, grp = FIXED.unpack_from(data, 0)
        if magic != MAGIC:
            raise PackError(f"{where}: not a low-rank shard stream (magic {magic!r})")
        if version != VERSION:
            raise PackError(f"{where}: low-rank stream version {version} is not supported "
                            f"(this reader supports version {VERSION}; rebuild the pack)")
        if not 1 <= levels <= 15 or not 1 <= m_count <= 255 or n < 1 or c < 1:
            raise PackError(f"{where}: header geometry ({levels} levels, {m_count} matrices, "
                            f"{n} x {c}) is out of range")
        if grp < 1 or grp & (grp - 1):
            raise PackError(f"{where}: group {grp} is not a power of two")
        pos = FIXED.size
        if len(data) < pos + levels + 1:
            raise PackError(f"{where}: {len(data)} bytes is too short for a {levels}-level header")
        level_bits = tuple(data[pos : pos + levels])
        if any(not 1 <= b <= 8 for b in level_bits):
            raise PackError(f"{where}: level bits {level_bits} (each must be 1..8)")
        pos += levels
        if len(data) < pos + 2:
            raise PackError(f"{where}: header truncated in its rank ladder")
        (top,) = struct.unpack_from("<H", data, pos)
        pos += 2
        nbitmap = -(-top // 8)
        if top < 1 or len(data) < pos + nbitmap + 2:
            raise PackError(f"{where}: header truncated in its rank ladder")
        ladder = tuple(r for r in range(1, top + 1)
                       if data[pos + (r - 1) // 8] >> ((r - 1) % 8) & 1)
        pos += nbitmap
        if not ladder or ladder[-1] != top:
            raise PackError(f"{where}: rank ladder bitmap does not end at its top rank {top}")
        (count,) = struct.unpack_from("<H", data, pos)
        pos += 2
        if len(data) < pos + -(-count // 2):
            raise PackError(f"{where}: header truncated in its unit list")
        unit_levels = tuple(data[pos + k // 2] >> (4 * (k % 2)) & 15 for k in range(count))
        head = cls(levels, m_count, n, c, grp, level_bits, ladder, unit_levels)
        head.walk()  # checks the unit order
        return head

    def walk(self) -> list[tuple[int, int, int]]:
        """``(level, first component, end component)`` of every unit, checking that each
        prefix is a staircase within the ladder (raises :class:`PackError`)."""
        counts = [0] * self.levels
        seen = [0] * self.levels
        out = []
        for k, lv in enumerate(self.unit_levels):
            if lv >= self.levels or seen[lv] >= len(self.ladder):
                raise PackError(f"unit {k} (level {lv}) is beyond the stream's levels or ladder")
            end = self.ladder[seen[lv]] * self.matrices
            if lv and end > counts[lv - 1]:
                raise PackError(f"unit {k} refines components level {lv - 1} does not hold yet")
            out.append((lv, counts[lv], end))
            counts[lv] = end
            seen[lv] += 1
        return out

    def prefix_units(self, ranks: Sequence[int]) -> int:
        """How many units the configuration ``ranks`` (mean ranks per level) is made of."""
        want = [int(r) * self.matrices for r in ranks]
        counts = [0] * self.levels
        for k, (lv, _first, end) in enumerate(self.walk()):
            counts[lv] = end
            if counts == want:
                return k + 1
        raise PackError(f"ranks {list(ranks)} are not a prefix of this shard's stream")

    def prefix_bytes(self, units: int) -> int:
        return self.size + sum((end - first) * self.chunk_bytes(lv)
                               for lv, first, end in self.walk()[:units])

    def split(self, data: bytes, ranks: Sequence[int]) -> list[bytes]:
        """The level streams of a configuration's bytes: for every level, the chunks of its
        components in component order (what the decoders consume)."""
        units = self.prefix_units(ranks)
        need = self.prefix_bytes(units)
        if len(data) != need:
            raise PackError(f"{len(data)} bytes, ranks {list(ranks)} need {need}")
        parts: list[list[bytes]] = [[] for _ in range(self.levels)]
        pos = self.size
        for lv, first, end in self.walk()[:units]:
            n = (end - first) * self.chunk_bytes(lv)
            parts[lv].append(data[pos : pos + n])
            pos += n
        return [b"".join(p) for p in parts]


def unit_levels(path: Sequence[Staircase]) -> tuple[int, ...]:
    """The level each step of a staircase path advances (one ladder point per step)."""
    out = []
    prev = (0,) * len(path[0]) if path else ()
    for state in path:
        changed = [lv for lv, (a, b) in enumerate(zip(prev, state)) if a != b]
        assert len(changed) == 1, (prev, state)
        out.append(changed[0])
        prev = state
    return tuple(out)


def rd_path(states: Sequence[Staircase], errs: Sequence[float], sizes: Sequence[int],
            ladder: Sequence[int]) -> list[Staircase]:
    """The main stream's staircases, one per unit, in greedy rate-distortion order.

    ``states`` are every staircase the stream may reach (each with its weighted error and
    data bytes); the path starts at the first segment of level 0 and stops when no
    remaining unit lowers the error.
    """
    arr = np.asarray(states, dtype=np.int64)
    err = np.asarray(errs, dtype=np.float64)
    size = np.asarray(sizes, dtype=np.float64)
    index = {tuple(int(v) for v in s): i for i, s in enumerate(states)}
    nxt = {0: ladder[0], **{a: b for a, b in zip(ladder, ladder[1:])}}
    levels = arr.shape[1]
    first = (ladder[0],) + (0,) * (levels - 1)
    cur = index[first]
    path = [first]

    def best(cands: np.ndarray) -> int:
        gain = (err[cur] - err[cands]) / (size[cands] - size[cur])
        order = np.lexsort((size[cands], -gain))  # steepest slope, then fewer bytes
        return int(cands[order[0]])

    while True:
        above = np.nonzero((arr >= arr[cur]).all(axis=1) & (size > size[cur]))[0]
        if len(above) == 0 or err[above].min() >= err[cur]:
            return path
        target = best(above)
        while cur != target:
            here = path[-1]
            steps = []
            for lv in range(levels):
                up = nxt.get(here[lv])
                if up is None or up > states[target][lv]:
                    continue
                cand = index.get(here[:lv] + (up,) + here[lv + 1 :])
                if cand is not None:
                    steps.append(cand)
            cur = best(np.asarray(steps))
            path.append(tuple(int(v) for v in states[cur]))


def uniform_path(ladder: Sequence[int], top: int, levels: int, cap: int) -> list[Staircase]:
    """A fixed-precision stream: segment by segment, every level ``0..top`` of each segment,
    ranks up to ``cap``. The states after each complete segment are the uniform configs."""
    path = []
    for r in ladder:
        if r > cap:
            break
        for lv in range(top + 1):
            prev = path[-1] if path else (0,) * levels
            path.append(prev[:lv] + (r,) + prev[lv + 1 :])
    return path

