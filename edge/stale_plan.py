"""The stale plan: a shard not worth its smallest configuration's bytes is not fetched.

When the allocator's choice for a shard is its policy's smallest configuration, or one whose
profiled output PSNR is below :data:`STALE_PLAN_DB` (the link gives that shard little), the
receive stage does not request it if the shard's block group will hold K/V at most
``stale_max_age`` steps old when it runs: the last earlier shard
of the same blocks that is fetched (not itself planned stale). At execution the group runs on
the K/V it last ran on (``dit.stale.StaleReuse``: received, or recomputed by a local step),
as a stale step does, with no wait; if those turn out older than ``stale_max_age`` (their
shard's step was computed locally with every token), the step is late and the local fallback
computes it (``edge.local_fallback``).

Why these configurations: measured on the tail bench's three templates
(``scripts/stale_vs_smallest.py``, ``docs/bench/stale-vs-smallest.json``), one shard run on
the previous step's exact K/V beat the same shard at the pack's smallest configuration in 114
of 114 shards (68-76 dB mean against 44-48), and three steps stale beat three steps at the
smallest configuration by 12-27 dB. The tail bench's worst sakura edits were runs of
smallest configurations on a slow link (e.g. 29.5 dB where the same start with nothing
received, every step recomputed or stale, gave 39.4: ``docs/bench/tail.json``, 2026-12-06).
The first version skipped the smallest configuration only; on the tail bench the worst
sakura edit then fetched configurations 1-3 (39-44 dB) through a rate dip and reached
28.8 dB where ``sakura-fixed-bits``, whose smallest 4-bit configuration is larger and so
skipped more often, reached 39.4. Better configurations are fetched: the plan's per-shard
PSNR model has no term for an age, so the threshold stays below the worst measured stale
run.

**Planned recompute.** A shard whose choice is skippable but whose group holds no K/V recent
enough (the edit's first step, or a group at its age cap) used to be fetched at that
choice, and its K/V then served the group's next stale steps: the low configuration's error
counted up to four times. On the tail bench (2026-12-06, after the lookahead learned of
stale shards) the sakura edits in the worst tenth had 1-7 fetched shards below 50 dB, the
median edit none; 95 of those 145 shards had no stale source. Where the local step is a
recompute step (exact K/V: ``dit.editing.RecomputedKV``, about a full step's cost), the
receive stage plans that step local instead (:func:`plan_unfetched`): the shard and its
step's later shards are never requested, execution reaches the step with no wait and
computes it on the device, and its exact K/V are the next steps' stale source. The record
says ``planned_local``. It trades one recompute step's time for the quality of a step and
of the stale steps after it; where the device would compute every token instead (no
template prompt embeddings) the shard is fetched as before. A step is planned local only on
a rate estimate (none: the smallest choice says nothing about the link) that a transfer has
refreshed since the last step planned local: a plan that went local on a stale estimate
would otherwise never measure the link again (its groups would be recomputed every
``stale_max_age + 1`` steps however fast the link became).

**Cut prefixes.** The same rule holds at a shard's deadline: a prefix cut there whose
configuration is skippable is not used; the shard runs stale, or its step is recomputed
(``Pipeline._unfetched_at_deadline``, the native ``StreamFeed::complete``). The worst tail
edits had run such prefixes (a 32 dB prefix of step 2 reused by three stale steps); with it,
sakura's tail p10 rose from 33.2 / 30.3 / 33.7 to 37.3 / 37.4 / 37.0 dB at loss 0 / 1 / 3%
(``docs/bench/tail.json``, 2026-12-06 afternoon; the two changes above alone moved nothing
beyond run-to-run noise, ``docs/RESULTS.md``).

SAKURA's policies plan stale (``Policy.plans_stale``); the baselines keep their published
streaming, and ``sakura-fixed-config`` keeps its configuration. ``EditOptions.stale_plan``
turns it off. The native receive stage (``StreamFeed::issue``, ``native/src/sakura/edit.cpp``)
applies the same rule through :func:`stale_source`'s twin, ``stale_source`` there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

STALE_PLAN_DB = 50.0
"""A configuration whose profiled output PSNR (``quality.psnr_db``: the edit with only that
shard at it) is below this is not worth its bytes while stale K/V are at hand. From the same
measurement: three consecutive steps run stale (every group, ages 1-3 from the step before)
gave 42.8-59.9 dB on the three templates, the worst on steps 1-3 (42.8 / 43.9 / 52.8 dB);
over the six shards of such a run the plan's additive error model makes that a per-shard
42.8 + 10 log10(6) = 50.5 dB at the worst, so a configuration below 50 dB loses to running
stale even there. The smallest configuration is always below (44-48 dB mean measured)."""


def skippable(psnr_db: float | None, smallest: bool) -> bool:
    """The stale plan may leave a shard unfetched at this choice: its policy's smallest
    configuration, or one profiled below :data:`STALE_PLAN_DB` (a configuration with no
    output PSNR: the smallest only)."""
    return smallest or (psnr_db is not None and math.isfinite(psnr_db)
                        and psnr_db < STALE_PLAN_DB)


def plan_unfetched(source: int | None, recompute: bool) -> str | None:
    """For a shard whose choice is :func:`skippable`: "stale" when its group holds K/V at
    most the cap old (``source``, :func:`stale_source`), else "local" where the local step is
    a recompute step (``recompute``: exact K/V, which then serve the next steps as a source;
    the caller also requires a rate estimate refreshed by a transfer since its last planned
    local step), else None (it is fetched at its choice). See "Planned recompute" in the
    module docstring."""
    if source is not None:
        return "stale"
    return "local" if recompute else None


def stale_source(shard_blocks: Sequence[tuple[int, Sequence[int]]],
                 planned: Sequence[bool], shard: int, max_age: int,
                 unfetched_from: int | None = None) -> int | None:
    """The step whose K/V shard ``shard`` would run on if it were not fetched: that of the
    last earlier shard of the same blocks not planned stale (``planned[i]``; with
    ``unfetched_from``, every shard from that one on counts as planned stale: the lookahead's
    view of shards not yet decided), when at most ``max_age`` steps before ``shard``'s; else
    None (no such shard, too old, or ``max_age`` <= 0)."""
    if max_age <= 0:
        return None
    step, blocks = shard_blocks[shard][0], list(shard_blocks[shard][1])
    for i in range(shard - 1, -1, -1):
        s, b = shard_blocks[i]
        if step - s > max_age:
            return None
        skipped = planned[i] or (unfetched_from is not None and i >= unfetched_from)
        if list(b) == blocks and not skipped:
            return s
    return None
