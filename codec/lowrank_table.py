"""Which configurations a SAKURA shard offers: the candidate staircases of the rank ladder,
the streams they are prefixes of (the main one in rate-distortion order, fixed-precision
ones for the ablation tables), the configurations the pack's table keeps (the Pareto front
thinned to 15% byte steps, the uniform prefixes, with ``keep="all"`` every uniform one),
and what the embedded layout costs against the free layout of format 1 (``bytes_vs_pareto``).
"""

from __future__ import annotations

import functools

from sakura.codec.embedded import StreamHeader, rd_path, uniform_path, unit_levels
from sakura.codec.lowrank_geometry import ShardGeometry

THIN = 1.15  # configs on the Pareto front are kept at least 15% apart in bytes


@functools.lru_cache(maxsize=16)
def staircases(ladder: tuple[int, ...], level_max: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every staircase (r0 >= r1 >= ..., zeros only after the first level) on the ladder
    within the per-level caps; the same for every shard of a geometry, so built once (tens
    of thousands with the unit ladder). Callers must not modify the list."""
    out: list[tuple[int, ...]] = []
    levels = len(level_max)

    def rec(prefix: tuple[int, ...], lv: int) -> None:
        if lv == levels:
            out.append(prefix)
            return
        bound = prefix[-1] if prefix else level_max[0]
        opts = [r for r in ladder if r <= min(bound, level_max[lv])]
        if lv > 0:
            opts = [0] + opts
        for r in opts:
            if lv > 0 and prefix[-1] == 0 and r > 0:
                continue
            rec(prefix + (r,), lv + 1)

    rec((), 0)
    return out


def streams_of(g: ShardGeometry, cands: list[tuple[int, ...]], errs: list[float],
               data_sizes: list[int], *, mixed: bool, keep_all: bool,
               uniform_bits: tuple[int, ...]
               ) -> tuple[list[list[tuple[int, ...]]], list[tuple[int, int, bool]]]:
    """The shard's streams: the main one in rate-distortion order, fixed-precision ones
    for the ablation tables (``keep_all``: ``keep="all"``, or not ``mixed``); each
    configuration is a prefix of one stream (FORMAT.md).
    Returns the streams and the offers (stream, prefix units, uniform config)."""
    streams: list[list[tuple[int, ...]]] = []
    offers: list[tuple[int, int, bool]] = []
    if mixed:
        streams.append(rd_path(cands, errs, data_sizes, g.ladder))
        offers += [(0, k + 1, False) for k in range(len(streams[0]))]
    if keep_all or not mixed:
        for b in uniform_bits:
            if b not in g.bits:
                continue
            top = g.bits.index(b)
            path = uniform_path(g.ladder, top, g.levels, g.level_max[top])
            if path:
                streams.append(path)
                offers += [(len(streams) - 1, k + 1, True) for k in range(len(path))
                           if (k + 1) % (top + 1) == 0 and path[k][0] in g.reference]
    return streams, offers


def choose(streams: list[list[tuple[int, ...]]], offers: list[tuple[int, int, bool]],
           err_of: dict[tuple[int, ...], float], size_of: dict[tuple[int, ...], int],
           heads: list[int], reference: set[int], *, mixed: bool, keep_all: bool,
           bits: tuple[int, ...], uniform_bits: tuple[int, ...]) -> list[tuple[int, int]]:
    """The configurations of the table, as (stream, prefix units): the thinned Pareto
    front of the offered prefixes, the main stream's uniform prefixes at the reference
    ranks, and with ``keep_all`` (``keep="all"``) every uniform stream's configuration."""
    def key(o: tuple[int, int, bool]) -> tuple[int, float]:
        ranks = streams[o[0]][o[1] - 1]
        return heads[o[0]] + size_of[ranks], err_of[ranks]

    pool = [o for o in offers if not o[2]] if mixed else offers
    front, best = [], float("inf")
    for o in sorted(pool, key=key):
        if key(o)[1] < best - 1e-15:
            front.append(o)
            best = key(o)[1]
    keep, last = [], 0.0
    for j, o in enumerate(front):
        if j in (0, len(front) - 1) or key(o)[0] >= last * THIN:
            keep.append(o)
            last = key(o)[0]
    # the uniform prefixes of the main stream too (few): what a fixed-bitwidth policy
    # can choose from when no ablation streams are stored
    for o in pool:
        ranks = streams[o[0]][o[1] - 1]
        nz = [r for r in ranks if r]
        if (len(set(nz)) == 1 and nz[0] in reference
                and bits[len(nz) - 1] in uniform_bits):
            keep.append(o)
    if keep_all:
        keep += [o for o in offers if o[2]]
    out, seen = [], set()
    for o in keep:  # one configuration per ranks (the main stream's when it has them)
        ranks = streams[o[0]][o[1] - 1]
        if ranks not in seen:
            seen.add(ranks)
            out.append((o[0], o[1]))
    return out


def prefix_cost(g: ShardGeometry, streams: list[list[tuple[int, ...]]],
                cands: list[tuple[int, ...]], errs: list[float], data_sizes: list[int],
                ) -> list[float | None]:
    """For every configuration the free (multi-range) layout of format 1 would publish
    (the thinned Pareto front over every staircase of its ladder), the bytes the first
    stream's shortest prefix needs to reach its weighted error, over that
    configuration's bytes (``None`` when no prefix reaches it). ``sakura bench codec``
    reports these as ``layout``."""
    if not streams:
        return []
    path = streams[0]
    v1_header = 18 + 5 * g.levels  # the format-1 shard header
    head = StreamHeader(g.levels, g.matrices, g.tokens, g.channels, g.group, g.level_bits,
                        g.ladder, unit_levels(path)).size
    err_of = dict(zip(cands, errs))
    size_of = dict(zip(cands, data_sizes))
    prefix = [(head + size_of[s], err_of[s]) for s in path]
    sizes = [v1_header + s for s in data_sizes]
    ref = set(g.reference) | {0}
    order = sorted((i for i, cf in enumerate(cands) if ref.issuperset(cf)),
                   key=lambda i: (sizes[i], errs[i]))
    front, best = [], float("inf")
    for i in order:
        if errs[i] < best - 1e-15:
            front.append(i)
            best = errs[i]
    out: list[float | None] = []
    last = 0.0
    for j, i in enumerate(front):
        if not (j in (0, len(front) - 1) or sizes[i] >= last * THIN):
            continue
        last = sizes[i]
        reach = [b for b, e in prefix if e <= errs[i] * (1 + 1e-9) + 1e-15]
        out.append(round(min(reach) / sizes[i], 5) if reach else None)
    return out
