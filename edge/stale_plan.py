"""The stale plan: a shard not worth its smallest configuration's bytes is not fetched.

When the allocator's choice for a shard is its policy's smallest configuration (the link
gives that shard almost nothing), the receive stage does not request it if the shard's block
group will hold K/V at most ``stale_max_age`` steps old when it runs: the last earlier shard
of the same blocks that is fetched (not itself planned stale). At execution the group runs on
the K/V it last ran on (``dit.stale.StaleReuse``: received, or recomputed by a local step),
as a stale step does, with no wait; if those turn out older than ``stale_max_age`` (their
shard's step was computed locally with every token), the step is late and the local fallback
computes it (``edge.local_fallback``).

Why the smallest configuration: measured on the tail bench's three templates
(``scripts/stale_vs_smallest.py``, ``docs/bench/stale-vs-smallest.json``), one shard run on
the previous step's exact K/V beat the same shard at the pack's smallest configuration in 114
of 114 shards (68-76 dB mean against 44-48), and three steps stale beat three steps at the
smallest configuration by 12-27 dB. The tail bench's worst sakura edits were runs of
smallest configurations on a slow link (e.g. 29.5 dB where the same start with nothing
received, every step recomputed or stale, gave 39.4: ``docs/bench/tail.json``, 2026-12-06).
Larger configurations are fetched: the plan's per-shard PSNR model has no term for an age,
so the rule stays where the measurement is unambiguous.

SAKURA's policies plan stale (``Policy.plans_stale``); the baselines keep their published
streaming, and ``sakura-fixed-config`` keeps its configuration. ``EditOptions.stale_plan``
turns it off. The native receive stage (``StreamFeed::issue``, ``native/src/sakura/edit.cpp``)
applies the same rule through :func:`stale_source`'s twin, ``stale_source`` there.
"""

from __future__ import annotations

from collections.abc import Sequence


def stale_source(shard_blocks: Sequence[tuple[int, Sequence[int]]],
                 planned: Sequence[bool], shard: int, max_age: int) -> int | None:
    """The step whose K/V shard ``shard`` would run on if it were not fetched: that of the
    last earlier shard of the same blocks not planned stale (``planned[i]``), when at most
    ``max_age`` steps before ``shard``'s; else None (no such shard, too old, or
    ``max_age`` <= 0)."""
    if max_age <= 0:
        return None
    step, blocks = shard_blocks[shard][0], list(shard_blocks[shard][1])
    for i in range(shard - 1, -1, -1):
        s, b = shard_blocks[i]
        if step - s > max_age:
            return None
        if list(b) == blocks and not planned[i]:
            return s
    return None
