"""The phone profile's simulated pipeline (edge/replay/profile.py) plans stale shards and
local steps by the receive stage's own rule (edge/stale_plan.py): scripted tables and
constant-rate links, no network."""

from __future__ import annotations

import pytest
from sakura.edge.allocator import ConfigOption, ShardOptions
from sakura.edge.replay.profile import DeviceProfile, simulate
from sakura.traces import Trace

# (bytes, output PSNR): the two smallest are below the stale plan's 50 dB
LADDER = [(1_000, 30.0), (4_000, 40.0), (20_000, 52.0), (80_000, 60.0)]
STEPS, PER_STEP = 4, 2
BLOCKS = [(s, [2 * b, 2 * b + 1]) for s in range(STEPS) for b in range(PER_STEP)]
PROFILE = DeviceProfile("test", local_s=8.0, masked_s=1.0, masked_ratio=0.1, fp16_gib=1.0)
EXEC = [0.25] * len(BLOCKS)


def tables(n: int = len(BLOCKS)) -> list[ShardOptions]:
    return [ShardOptions(j, [ConfigOption(id=i, nbytes=b, params={"i": i}, psnr_db=q,
                                          weighted_err=1 / (i + 1))
                             for i, (b, q) in enumerate(LADDER)]) for j in range(n)]


def run(policy: str, rate_bps: float, **kw):
    trace = Trace.constant(rate_bps, 1000.0)
    return simulate(policy, tables(), EXEC, trace, 0.0, rate_bps, PROFILE, 1.0,
                    shard_blocks=BLOCKS, **kw)


def test_a_fast_link_fetches_every_shard():
    sim = run("sakura", 1e9)
    assert sim.unfetched == [None] * len(BLOCKS) and None not in sim.configs
    assert sim.exec_s == pytest.approx(sum(EXEC))


def test_a_starved_link_plans_the_first_step_local_and_runs_the_rest_stale():
    """Nothing worth its bytes arrives: step 0 has no K/V to run stale on, so it is planned
    local (one local step, local_s / steps); its recomputed K/V serve the next three steps
    (the age cap), nothing is fetched and nothing waits on the link."""
    sim = run("sakura", 2e3)
    assert sim.unfetched == ["local", "local"] + ["stale"] * 6
    assert sim.planned_local == 2 and sim.planned_stale == 6
    assert sim.bytes == 0 and sim.configs == [None] * len(BLOCKS) and sim.stalls == 0
    assert sim.latency_s == pytest.approx(PROFILE.local_s / STEPS + sum(EXEC[2:]))
    # the age cap: a fifth step is too old for step 0's K/V, and no transfer has measured
    # the link since step 0 went local, so it is not planned local either: it is fetched
    more = [(s, [2 * b, 2 * b + 1]) for s in range(5) for b in range(PER_STEP)]
    sim5 = simulate("sakura", tables(10), [0.25] * 10, Trace.constant(2e3, 1e3),
                    0.0, 2e3, PROFILE, 1.0, shard_blocks=more)
    assert sim5.unfetched[:8] == sim.unfetched and sim5.unfetched[8] is None
    assert sim5.configs[8] == 0 and sim5.bytes > 0


def test_without_a_recompute_step_or_a_stale_planning_policy_the_shards_are_fetched():
    no_recompute = run("sakura", 2e3, recompute=False)
    assert no_recompute.unfetched[:2] == [None, None]  # step 0 fetched at its choice
    assert no_recompute.unfetched[2:] == ["stale"] * 6
    baseline = run("cachegen", 2e3)  # CacheGen keeps its published streaming
    assert baseline.unfetched == [None] * len(BLOCKS) and baseline.bytes > 0
    assert run("sakura", 2e3, stale_max_age=0).planned_stale == 0
    off = simulate("sakura", tables(), EXEC, Trace.constant(2e3, 1e3), 0.0, 2e3, PROFILE, 1.0)
    assert off.unfetched == [None] * len(BLOCKS)  # no layout given: the plan is off
