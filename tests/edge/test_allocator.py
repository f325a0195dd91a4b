"""Allocator and monitor: pure functions driven by scripted arrivals (no network, no model).

The monitor, execution-progress and adaptive-allocator tests run twice (fixture ``impl``):
against ``sakura.edge`` (the Python runtime) and against their C++ twins in
``sakura_native`` (the native runtime), which must behave the same."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
from sakura.edge.allocator import (
    POLICIES,
    AdaptiveAllocator,
    ConfigOption,
    PolicyContext,
    ShardOptions,
    budget_bytes,
    fixed_config,
    floored,
    get_policy,
    local_share_floor_db,
    options_from_manifest,
    to_native,
)
from sakura.edge.errors import EdgeError
from sakura.edge.monitor import (
    BandwidthMonitor,
    ExecutionProgress,
    check_startup_fraction,
    startup_allowance_s,
)


@pytest.fixture(params=["python", "native"])
def impl(request):
    """The Python classes or their ``sakura_native`` twins, with one constructor API."""
    if request.param == "python":
        return SimpleNamespace(BandwidthMonitor=BandwidthMonitor,
                               ExecutionProgress=ExecutionProgress,
                               adaptive=AdaptiveAllocator, budget_bytes=budget_bytes)
    import sakura_native as native

    def adaptive(tables, latency_s=0.0, safety=0.8):
        return to_native(AdaptiveAllocator(tables, latency_s, safety), native)

    return SimpleNamespace(BandwidthMonitor=native.BandwidthMonitor,
                           ExecutionProgress=native.ExecutionProgress, adaptive=adaptive,
                           budget_bytes=native.budget_bytes)


# A shard offers (rank, bits) configurations; quality = psnr_db grows with bytes.
LADDER = [(1, 2, 1_000, 20.0), (4, 2, 3_000, 25.0), (4, 4, 5_000, 29.0),
          (8, 4, 10_000, 33.0), (16, 4, 20_000, 37.0), (16, 8, 40_000, 45.0)]


def table(shard: int, scale: float = 1.0, psnr: bool = True) -> ShardOptions:
    opts = [ConfigOption(id=i, nbytes=int(n * scale), params={"rank": r, "bits": b},
                         psnr_db=q if psnr else None, weighted_err=1.0 / (i + 1))
            for i, (r, b, n, q) in enumerate(LADDER)]
    return ShardOptions(shard, opts)


def manifest(shards: int = 3) -> dict:
    return {"shards": [
        {"index": s, "step": s, "blocks": [0, 1], "compute_cost": 1.0,
         "configs": [{"id": i, "params": {"rank": r, "bits": b}, "bytes": n,
                      "quality": {"psnr_db": q, "weighted_err": 1 / (i + 1)},
                      "pareto": i != 2}
                     for i, (r, b, n, q) in enumerate(LADDER)]}
        for s in range(shards)]}


def test_budget_uses_rate_window_latency_and_safety(impl):
    assert impl.budget_bytes(1.0, 8e6) == pytest.approx(1e6)
    assert impl.budget_bytes(1.0, 8e6, latency_s=0.25, safety=0.5) == pytest.approx(375_000)
    assert impl.budget_bytes(0.1, 8e6, latency_s=0.2) == 0.0
    assert impl.budget_bytes(1.0, 0.0) == 0.0
    assert impl.budget_bytes(1.0, math.inf) == 0.0


def test_options_from_manifest_keeps_pareto_and_orders_by_quality():
    tables = options_from_manifest(manifest())
    assert len(tables) == 3
    ids = [o.id for o in tables[0].options]
    assert ids == [5, 4, 3, 1, 0]  # best first; config 2 is not on the Pareto front
    assert tables[0].best.id == 5 and tables[0].smallest.id == 0
    everything = options_from_manifest(manifest(), pareto_only=False)
    assert len(everything[0].options) == 6


def test_options_from_manifest_rejects_gaps():
    m = manifest(3)
    m["shards"].pop(1)
    with pytest.raises(EdgeError, match="numbered"):
        options_from_manifest(m)


def test_quality_falls_back_to_weighted_error_then_bytes():
    t = table(0, psnr=False)
    assert [o.id for o in t.options] == [5, 4, 3, 2, 1, 0]  # lower weighted_err first
    bare = ShardOptions(0, [ConfigOption(i, n, {}) for i, n in enumerate([5, 50, 20])])
    assert [o.id for o in bare.options] == [1, 2, 0]


def test_adaptive_picks_highest_quality_that_fits_else_smallest(impl):
    alloc = impl.adaptive([table(0)], latency_s=0.0, safety=1.0)
    # 8 Mbit/s = 1 MB/s: a 12 ms window holds 12 kB -> rank 8, 4 bits (10 kB)
    assert alloc.choose(0, 0.012, 8e6) == 3
    assert alloc.choose(0, 0.041, 8e6) == 5
    assert alloc.choose(0, 0.0005, 8e6) == 0   # nothing fits: the smallest
    assert alloc.choose(0, 1.0, 0.0) == 0      # no rate estimate: the smallest


def test_adaptive_prefers_quality_over_bytes_when_not_monotone(impl):
    opts = [ConfigOption(0, 1000, {}, psnr_db=30.0), ConfigOption(1, 2000, {}, psnr_db=28.0),
            ConfigOption(2, 3000, {}, psnr_db=35.0)]
    alloc = impl.adaptive([ShardOptions(0, opts)], safety=1.0)
    assert alloc.choose(0, 2.5e-3, 8e6) == 0  # 2500 B: config 1 fits but is worse than 0


def test_fixed_config_one_parameter_set_from_the_median_budget():
    tables = [table(0), table(1, scale=1.2), table(2, scale=0.8)]
    exec_s = [0.01, 0.01, 0.01]
    # median 8 Mbit/s over 10 ms = 10 kB per shard (safety 1): (8, 4) has mean 10 kB
    alloc = fixed_config(tables, exec_s, 8e6, safety=1.0)
    assert alloc.configs == [3, 3, 3]
    assert {alloc.choose(s, w, r) for s in range(3) for w in (0, 10) for r in (1, 1e9)} == {3}
    # a tiny budget: the smallest common one
    assert fixed_config(tables, exec_s, 1e3, safety=1.0).configs == [0, 0, 0]


def test_fixed_config_needs_common_parameters():
    a = ShardOptions(0, [ConfigOption(0, 10, {"rank": 1, "bits": 2})])
    b = ShardOptions(1, [ConfigOption(0, 10, {"rank": 2, "bits": 2})])
    with pytest.raises(EdgeError, match="every shard"):
        fixed_config([a, b], [0.1, 0.1], 1e6)


def test_fixed_bits_policy_only_uses_that_bitwidth():
    ctx = PolicyContext(tables=[table(0)], exec_s=[0.01], safety=1.0, options={"bits": 4})
    alloc = get_policy("sakura-fixed-bits").build(ctx)
    assert alloc.choose(0, 1.0, 8e9) == 4      # best 4-bit one, not the 8-bit config 5
    assert alloc.choose(0, 1e-6, 8e6) == 2     # smallest 4-bit one
    mixed = ShardOptions(0, [ConfigOption(0, 10, {"rank": 4, "bits": 4, "ranks": [4, 2, 0]}),
                             ConfigOption(1, 8, {"rank": 2, "bits": 4, "ranks": [2, 2, 0]})])
    alloc = get_policy("sakura-fixed-bits").build(PolicyContext([mixed], [0.01]))
    assert alloc.choose(0, 1.0, 8e9) == 1      # mixed precision is excluded


def test_fixed_bits_finds_its_configurations_off_the_pareto_front():
    """In the sakura-all pack the mixed front may hold no 4-bit configuration of a shard;
    the fixed-bits ablation still gets that shard's 4-bit ones (the adaptive policy still
    sees the front only)."""
    m = manifest(1)
    for c in m["shards"][0]["configs"]:
        c["pareto"] = c["params"]["bits"] != 4
    tables = options_from_manifest(m)
    assert {o.bits for o in tables[0].options} == {2, 8}
    alloc = get_policy("sakura-fixed-bits").build(PolicyContext(
        tables=tables, exec_s=[0.01], safety=1.0, options={"bits": 4}))
    assert alloc.choose(0, 1.0, 8e9) == 4 and alloc.choose(0, 1e-6, 8e6) == 2
    assert tables[0].by_id(4).nbytes == 20_000  # the byte size of a choice off the front


def test_the_quality_floor_is_a_local_edits_error_shared_over_the_shards(impl):
    """``sakura-floor``: no configuration whose output error exceeds its shard's share of a
    local edit's (``local_psnr_db`` + 10 log10 shards, the lookahead's additive model). With
    nothing above the floor that fits, the choice is the floor's smallest (it waits, and a
    late step is computed locally), never a configuration below it; without the pack's
    ``local_psnr_db`` the policy is sakura's. The native allocator gets the same tables."""
    assert local_share_floor_db(30.0, 10) == pytest.approx(40.0)
    assert local_share_floor_db(30.0, 0) == 30.0
    tables = [table(0), table(1)]  # floor for local 25.9 dB over 2 shards: 28.9 dB
    kept = floored(tables, local_share_floor_db(25.9, 2))
    assert [o.id for o in kept[0].options] == [5, 4, 3, 2]
    assert [o.id for o in floored(tables, 99.0)[0].options] == [5]  # none: the best
    ctx = PolicyContext(tables=tables, exec_s=[0.01, 0.01], safety=1.0,
                        options={"local_psnr_db": 25.9, "lookahead": False})
    alloc = get_policy("sakura-floor").build(ctx)
    if impl.adaptive is not AdaptiveAllocator:  # the native twin, on the same tables
        import sakura_native as native

        alloc = to_native(alloc, native)
    assert alloc.choose(0, 1e-6, 8e6) == 2      # the smallest at or above 28.9 dB
    assert alloc.choose(0, 1.0, 8e9) == 5
    plain = get_policy("sakura-floor").build(PolicyContext(
        tables=tables, exec_s=[0.01, 0.01], safety=1.0, options={"lookahead": False}))
    assert plain.choose(0, 1e-6, 8e6) == 0      # no local_psnr_db: no floor


def test_a_policy_says_when_its_pack_lacks_what_it_plans_with():
    """A pack built before ``local_psnr_db`` existed plans ``sakura-floor`` as sakura, and
    the edit's warning line says so (instead of a floor that silently is not there)."""
    old_pack = {"codec": "sakura"}
    line = get_policy("sakura-floor").missing(old_pack)
    assert line is not None and "local_psnr_db" in line and "sakura build" in line
    assert get_policy("sakura-floor").missing({**old_pack, "local_psnr_db": 31.8}) is None
    assert all(p.missing(old_pack) is None for n, p in POLICIES.items() if n != "sakura-floor")


def test_policies_registry():
    assert get_policy("local").codec is None
    assert get_policy("sakura-fixed-config").codec == "sakura"
    with pytest.raises(EdgeError, match="unknown policy"):
        get_policy("nope")
    with pytest.raises(EdgeError, match="budget rate"):
        get_policy("sakura-fixed-config").build(PolicyContext([table(0)], [0.1]))


# ----------------------------------------------------------------------------- monitor


def test_rate_estimate_is_bytes_over_busy_time_of_recent_transfers(impl):
    mon = impl.BandwidthMonitor(k=3, min_body_s=0.0)
    assert mon.estimate_bps() is None
    # 1 MB bodies in 1, 2, 1 s after 50 ms to the first byte: 3 MB over 4 s busy (for equal
    # sizes, the harmonic mean of the body rates 8, 4, 8 Mbit/s)
    for i, body_s in enumerate([1.0, 2.0, 1.0]):
        mon.record(i, 1_000_000, 10.0 * i, 10.0 * i + 0.05, 10.0 * i + 0.05 + body_s)
    assert mon.estimate_bps() == pytest.approx(3 / (1 / 8e6 + 1 / 4e6 + 1 / 8e6))
    assert mon.latency_s() == pytest.approx(0.05)
    mon.record(3, 1_000_000, 40.0, 40.05, 40.55)  # 16 Mbit/s; the oldest drops out
    assert mon.estimate_bps() == pytest.approx(8 * 3_000_000 / 3.5)
    assert mon.bytes_total() == 4_000_000
    # two transfers sharing the link (parallel requests): 2 MB in the same second is 16
    # Mbit/s, not two bodies of 8 Mbit/s each
    mon.record(4, 1_000_000, 50.0, 50.05, 51.05)
    mon.record(5, 1_000_000, 50.0, 50.05, 51.05)
    assert mon.estimate_bps() == pytest.approx(8 * 3_000_000 / 1.5)


def test_small_bodies_do_not_drive_the_estimate(impl):
    mon = impl.BandwidthMonitor(k=4, min_body_s=0.002)
    mon.record(None, 100_000, 0.0, 0.01, 0.11)       # manifest: 8 Mbit/s
    mon.record(0, 500, 1.0, 1.01, 1.0101)            # one read: adds its bytes, no time
    assert mon.estimate_bps() == pytest.approx(8 * 100_500 / 0.1001)
    only_small = impl.BandwidthMonitor(min_body_s=0.002, initial_bps=1e6)
    only_small.record(0, 500, 0.0, 0.0, 0.001)
    assert only_small.estimate_bps() == pytest.approx(2e6)  # 500 B in < 2 ms: at least


def test_the_prior_stands_for_the_samples_missing_from_the_window(impl):
    """Two bodies from a saved-up burst at an edit's start do not replace a sound prior:
    until k transfers are in, the prior counts for the missing ones."""
    mon = impl.BandwidthMonitor(k=5, min_body_s=0.002, initial_bps=20e6)
    mon.record(0, 100_000, 0.0, 0.01, 0.018)          # 100 Mbit/s (a burst)
    mon.record(1, 100_000, 0.02, 0.03, 0.038)
    assert mon.estimate_bps() == pytest.approx(5 / (2 / 100e6 + 3 / 20e6))  # 26 Mbit/s
    for j in range(2, 7):                              # a full window: measured only
        mon.record(j, 100_000, j * 0.1, j * 0.1 + 0.01, j * 0.1 + 0.05)
    assert mon.estimate_bps() == pytest.approx(20e6)


def test_app_limited_windows_only_raise_the_estimate(impl):
    """Small bodies behind request latencies of 8-20 ms (the smallest configurations on a
    fast link, or loopback) measure the requests, not the link: a window carrying bytes less
    than APP_LIMITED_SHARE of its busy time keeps the estimate held before it (before this
    rule, a first edit on a 40 Mbit/s link fell from 10 to 0.2 Mbit/s this way); a window
    that keeps the link busy is measured, lower or not."""
    from sakura.edge.monitor import APP_LIMITED_SHARE

    assert APP_LIMITED_SHARE == 0.5
    mon = impl.BandwidthMonitor(k=3, min_body_s=0.002)
    mon.record(None, 100_000, 0.0, 0.01, 0.11)       # manifest: 100 ms of body, 8 Mbit/s
    manifest = 8 * 100_000 / 0.11
    assert mon.estimate_bps() == pytest.approx(manifest)
    t = 1.0
    for j in range(6):
        latency = 0.008 if j % 2 else 0.020
        mon.record(j, 170, t, t + latency, t + latency + 0.0001)
        t += 0.03
        assert mon.estimate_bps() >= 0.95 * manifest  # 170 B per ~12 ms: held
    mon.record(9, 200_000, t, t + 0.008, t + 0.408)  # 400 ms of body: 4 Mbit/s, measured
    assert mon.estimate_bps() < 0.6 * manifest
    # alone and app-limited, with nothing held: what it measured
    first = impl.BandwidthMonitor(k=3, min_body_s=0.002)
    first.record(None, 10_000, 0.0, 0.05, 0.06)
    assert first.estimate_bps() == pytest.approx(8 * 10_000 / 0.06)
    # with a prior, an app-limited first window never lowers it
    prior = impl.BandwidthMonitor(k=3, min_body_s=0.002, initial_bps=20e6)
    prior.record(0, 10_000, 0.0, 0.05, 0.06)
    assert prior.estimate_bps() == pytest.approx(20e6)


def test_fast_small_bodies_lift_a_stale_low_estimate(impl):
    """After a slow spell only the smallest configurations fit; when the link recovers
    their quick arrivals raise the estimate, which lets larger ones through."""
    mon = impl.BandwidthMonitor(k=3, min_body_s=0.002)
    mon.record(0, 20_000, 0.0, 0.01, 0.41)           # slow: 0.39 Mbit/s from the request
    assert mon.estimate_bps() == pytest.approx(8 * 20_000 / 0.41)
    t = 1.0
    sizes = []
    size = 500
    for j in range(1, 6):                            # the link is fast again
        mon.record(j, size, t, t + 0.001, t + 0.0012)
        sizes.append(size)
        t += 0.01
        budget = mon.estimate_bps() / 8 * 0.01       # what a 10 ms window would allow
        size = max(size, int(min(budget, 200_000)))
    assert mon.estimate_bps() > 10e6
    assert sizes == sorted(sizes) and sizes[-1] > 20 * sizes[0]
    mon.record(9, 50_000, t, t + 0.001, t + 0.101)    # a transfer that can be timed again
    assert mon.estimate_bps() == pytest.approx(8 * (sizes[-2] + sizes[-1] + 50_000) / 0.1004)


def test_a_body_read_at_once_proves_only_its_request_time(impl):
    """A 21.8 KB shard whose body sat in the socket buffer arrives in one read: the link
    carried it between the request (12 ms earlier) and the end, not in the 0.5 ms of the
    read (87 Mbit/s); with a prior, it is one of the k samples."""
    mon = impl.BandwidthMonitor(k=3, min_body_s=0.002, initial_bps=1e6)
    mon.record(0, 21_800, 0.0, 0.0115, 0.0120)
    measured = 8 * 21_800 / 0.012                                  # 14.5 Mbit/s
    assert mon.estimate_bps() == pytest.approx(3 / (1 / measured + 2 / 1e6))


def test_fast_bodies_on_a_long_round_trip_prove_their_bytes_less_the_round_trip(impl):
    """On a 30 ms link, 1 KB bodies that arrive in one read count from their request plus
    the round trip (the others' smallest time to first byte): not 8 n / 31 ms (0.26
    Mbit/s), which kept choosing 1 KB configurations on a 20 Mbit/s link."""
    mon = impl.BandwidthMonitor(k=3, min_body_s=0.002)
    mon.record(0, 1000, 0.0, 0.0300, 0.0304)
    # alone, its own first byte may have waited behind a burst: its whole request time
    assert mon.estimate_bps() == pytest.approx(8 * 1000 / 0.0304)
    mon.record(1, 1000, 0.01, 0.0405, 0.0410)
    # 0.4 ms and 1 ms past the round trip: too quick to time, at least 2 KB in 2 ms
    assert mon.estimate_bps() == pytest.approx(8 * 2000 / 0.002)
    mon.record(2, 30_000, 0.02, 0.0600, 0.0610)       # 29 KB more came 11 ms after 30 ms
    assert mon.estimate_bps() == pytest.approx(8 * 32_000 / (0.0004 + 0.001 + 0.011))


def test_deadlines_follow_execution_progress(impl):
    prog = impl.ExecutionProgress([0.1, 0.2, 0.1, 0.1], origin=0.0, startup_s=0.05)
    w0 = prog.window(0, now=0.01)
    assert w0.deadline == pytest.approx(0.05) and w0.window_s == pytest.approx(0.04)
    prog.received(0, 0.04)
    prog.reconstructed(0, 0.04, 0.05)         # reconstruction estimate 10 ms
    # shard 1 before execution started: ready_0 (0.05) + exec_0 (0.1)
    w1 = prog.window(1, now=0.05)
    assert w1.deadline == pytest.approx(0.15)
    assert w1.window_s == pytest.approx(0.15 - 0.05 - 0.01)
    assert w1.slot_s == pytest.approx(0.1)
    assert w1.carry_s == pytest.approx(w1.window_s - 0.1)
    prog.exec_started(0, 0.05)
    prog.received(1, 0.08)
    # shard 2: shard 0 ends at 0.15, shard 1 (ready ~0.09) runs 0.2 -> 0.35
    w2 = prog.window(2, now=0.08)
    assert w2.deadline == pytest.approx(0.35)
    assert w2.carry_s == pytest.approx(0.35 - 0.08 - 0.01 - 0.2)


def deadlines(prog, now):
    return [prog.deadline(j, now) for j in range(prog.num_shards)]


def test_startup_allowance_zero_is_the_default_prediction(impl):
    exec_s = [0.1, 0.2, 0.1, 0.1]
    # the manifest took 0.3 s: the default start (origin + exec_s[0] = 0.1) is long past
    plain = impl.ExecutionProgress(exec_s, origin=0.0)
    zero = impl.ExecutionProgress.with_allowance(exec_s, origin=0.0, allowance_s=0.0, now=0.3)
    assert zero.startup_s == pytest.approx(0.3)
    for now in (0.3, 0.35, 0.5):
        assert deadlines(zero, now) == pytest.approx(deadlines(plain, now))
    # manifest faster than exec_s[0]: the default start stands
    assert impl.ExecutionProgress.with_allowance(exec_s, 0.0, 0.0, now=0.02).startup_s == 0.1


def test_startup_allowance_moves_shard_0_and_the_shards_before_execution_starts(impl):
    exec_s = [0.1, 0.2, 0.1, 0.1]
    plain = impl.ExecutionProgress(exec_s, origin=0.0)
    allow = impl.ExecutionProgress.with_allowance(exec_s, origin=0.0, allowance_s=0.05, now=0.3)
    assert allow.startup_s == pytest.approx(0.35)
    assert deadlines(plain, 0.3) == pytest.approx([0.3, 0.4, 0.6, 0.7])
    assert deadlines(allow, 0.3) == pytest.approx([0.35, 0.45, 0.65, 0.75])
    w = [allow.window(j, 0.3) for j in range(4)]
    w_plain = [plain.window(j, 0.3) for j in range(4)]
    assert w_plain[0].window_s == pytest.approx(0.0)
    assert w[0].window_s == pytest.approx(0.05)
    for a, b in zip(w, w_plain):                   # every window grows by the allowance
        assert a.window_s - b.window_s == pytest.approx(0.05)
    # the nominal slot is unchanged; the allowance left over is carried
    assert w[0].slot_s == pytest.approx(0.35) and w[0].carry_s == pytest.approx(-0.3)
    assert w[1].slot_s == pytest.approx(0.1) and w[1].carry_s == pytest.approx(0.05)
    assert w[2].slot_s == pytest.approx(0.2) and w[2].carry_s == pytest.approx(0.15)
    # shard 0 arrives at 0.32 and is reconstructed by 0.33 (estimate 10 ms): execution is
    # still predicted at 0.35, the end of the allowance
    for prog in (plain, allow):
        prog.received(0, 0.32)
        prog.reconstructed(0, 0.32, 0.33)
    assert allow.window(1, 0.33).deadline == pytest.approx(0.45)
    assert allow.window(1, 0.33).window_s == pytest.approx(0.45 - 0.33 - 0.01)
    assert plain.window(1, 0.33).deadline == pytest.approx(0.43)
    # a shard 0 late past the allowance moves every prediction (nothing waits for it)
    late = impl.ExecutionProgress.with_allowance(exec_s, origin=0.0, allowance_s=0.05, now=0.3)
    late.received(0, 0.5)
    assert deadlines(late, 0.5) == pytest.approx([0.5, 0.6, 0.8, 0.9])


def test_after_execution_starts_the_allowance_has_no_effect(impl):
    exec_s = [0.1, 0.2, 0.1, 0.1]
    plain = impl.ExecutionProgress(exec_s, origin=0.0)
    allow = impl.ExecutionProgress.with_allowance(exec_s, origin=0.0, allowance_s=0.05, now=0.3)
    for prog in (plain, allow):
        prog.received(0, 0.32)
        prog.reconstructed(0, 0.32, 0.33)
        prog.exec_started(0, 0.33)               # before the allowance is used up
    for now in (0.33, 0.4):
        assert deadlines(allow, now)[1:] == pytest.approx(deadlines(plain, now)[1:])
    assert allow.window(1, 0.33).deadline == pytest.approx(0.43)
    for prog in (plain, allow):
        prog.exec_ended(0, 0.43)
        prog.received(1, 0.4)
        prog.reconstructed(1, 0.4, 0.41)
        prog.exec_started(1, 0.43)
    assert deadlines(allow, 0.45)[2:] == pytest.approx(deadlines(plain, 0.45)[2:])
    assert deadlines(allow, 0.45)[2:] == pytest.approx([0.63, 0.73])


def test_startup_allowance_values():
    assert startup_allowance_s([0.1, 0.2, 0.1], 0.5) == pytest.approx(0.2)
    assert startup_allowance_s([0.1, 0.2, 0.1], 0) == 0.0
    assert check_startup_fraction(1) == 1.0
    for bad in (-0.01, 1.5, math.nan, math.inf, "much", None, True):
        with pytest.raises(ValueError, match="startup_fraction must be a number in"):
            check_startup_fraction(bad)
    with pytest.raises(ValueError, match="allowance"):
        ExecutionProgress.with_allowance([0.1], 0.0, -0.1, now=0.0)
    with pytest.raises(ValueError, match="startup_s"):
        ExecutionProgress([0.1], 0.0, startup_s=math.nan)


def test_measured_execution_corrects_later_predictions(impl):
    prog = impl.ExecutionProgress([0.1] * 4, origin=0.0, alpha=1.0)
    prog.exec_started(0, 0.0)
    prog.exec_ended(0, 0.2)                     # twice as slow as calibrated
    assert prog.predicted_exec_s(2) == pytest.approx(0.2)
    prog.exec_started(1, 0.2)
    assert prog.deadline(3, now=0.25) == pytest.approx(0.2 + 0.2 + 0.2)


def test_late_arrival_shifts_deadlines_and_leaves_no_negative_carry(impl):
    prog = impl.ExecutionProgress([0.1] * 3, origin=0.0)
    prog.exec_started(0, 0.0)
    prog.exec_ended(0, 0.1)
    # shard 1 arrives late at 0.3 (execution stalled 0.2 s): it cannot start before that
    prog.received(1, 0.3)
    prog.reconstructed(1, 0.3, 0.3)
    w = prog.window(2, now=0.3)
    assert w.deadline == pytest.approx(0.4)
    assert w.carry_s == pytest.approx(0.0, abs=1e-9)


def test_scripted_arrivals_drive_the_allocator(impl):
    """Simulate a link shard by shard: early arrivals raise the next window (carry-over),
    a rate drop lowers the choice, and the choice never exceeds what fits."""
    n = 8
    exec_s = [0.02] * n
    tables = [table(s) for s in range(n)]
    alloc = impl.adaptive(tables, latency_s=0.0, safety=1.0)
    rates = [8e6] * 4 + [2e6] * 4            # the link slows down half way
    prog = impl.ExecutionProgress(exec_s, origin=0.0)
    mon = impl.BandwidthMonitor(k=1, min_body_s=0.0)
    mon.record(None, 10_000, 0.0, 0.0, 0.01)  # a manifest sample: 8 Mbit/s
    now = 0.0
    exec_free = 0.0
    chosen, windows = [], []
    for j in range(n):
        w = prog.window(j, now)
        rate = mon.estimate_bps()
        cfg = alloc.choose(j, w.window_s, rate)
        nbytes = tables[j].by_id(cfg).nbytes
        assert nbytes <= max(impl.budget_bytes(w.window_s, rate), tables[j].smallest.nbytes)
        start, end = now, now + nbytes * 8 / rates[j]
        mon.record(j, nbytes, start, start, end)
        prog.received(j, end)
        prog.reconstructed(j, end, end)
        begin = max(end, exec_free)
        prog.exec_started(j, begin)
        exec_free = begin + exec_s[j]
        prog.exec_ended(j, exec_free)
        chosen.append(cfg)
        windows.append(w)
        now = end
    fast = [tables[0].by_id(c).nbytes for c in chosen[1:4]]
    slow = [tables[0].by_id(c).nbytes for c in chosen[5:]]
    assert min(fast) > max(slow)             # adapts down after the rate drop
    assert chosen[0] == 4                    # 20 ms startup window at 8 Mbit/s -> 20 kB


def test_native_and_python_choose_identically_given_identical_rate_samples():
    """The same scripted transfers fed to both runtimes' monitor, progress and allocator
    give the same windows, rate estimates and configuration choices, shard by shard."""
    import sakura_native as native

    rng = random.Random(7)
    n = 40
    exec_s = [rng.uniform(0.01, 0.03) for _ in range(n)]
    tables = [table(s, scale=rng.uniform(0.5, 2.0)) for s in range(n)]
    py = (BandwidthMonitor(k=5, initial_bps=4e6), ExecutionProgress.with_allowance(
        exec_s, 0.0, 0.05, now=0.02), AdaptiveAllocator(tables, 0.0, 0.8))
    cc = (native.BandwidthMonitor(k=5, initial_bps=4e6), native.ExecutionProgress.with_allowance(
        exec_s, 0.0, 0.05, now=0.02), to_native(AdaptiveAllocator(tables, 0.0, 0.8), native))
    now, exec_free = 0.02, 0.0
    choices = {id(py): [], id(cc): []}
    for j in range(n):
        rate_true = rng.choice([0.5e6, 2e6, 8e6, 30e6])
        picked = []
        for mon, prog, alloc in (py, cc):
            w = prog.window(j, now)
            rate = mon.estimate_bps() or 0.0
            picked.append((alloc.choose(j, w.window_s - mon.latency_s(), rate),
                           w.window_s, w.deadline, rate))
        (c_py, w_py, d_py, r_py), (c_cc, w_cc, d_cc, r_cc) = picked
        assert c_py == c_cc, f"shard {j}"
        assert w_cc == pytest.approx(w_py, abs=1e-12) and d_cc == pytest.approx(d_py, abs=1e-12)
        assert r_cc == pytest.approx(r_py, rel=1e-12)
        nbytes = tables[j].by_id(c_py).nbytes
        first = now + rng.uniform(0.001, 0.02)
        end = first + nbytes * 8 / rate_true * rng.choice([0.0, 1.0])  # some read at once
        begin = max(end, exec_free)
        exec_free = begin + exec_s[j] * rng.uniform(0.8, 1.5)
        for mon, prog, _ in (py, cc):
            mon.record(j, nbytes, now, first, end)
            prog.received(j, end)
            prog.reconstructed(j, end, end + 1e-3)
            prog.exec_started(j, begin)
            prog.exec_ended(j, exec_free)
        choices[id(py)].append(c_py)
        now = end
    assert len(set(choices[id(py)])) > 2  # the script exercised several choices


def test_a_local_step_ends_without_moving_the_execution_scale(impl):
    p = impl.ExecutionProgress([0.01, 0.01, 0.01], 0.0)
    p.exec_started(0, 0.0)
    p.exec_ended_local(0, 0.5)  # 50x its prediction: a full step, not a cached one
    assert p.scale == pytest.approx(1.0)
    assert p.deadline(1, 0.5) == pytest.approx(0.5)  # and execution is where it ended


def test_the_stale_plan_may_skip_the_smallest_and_configurations_below_its_threshold(impl):
    """The stale plan (edge/stale_plan.py) may leave a shard unfetched only where the
    allocator's choice is the policy's smallest configuration or one profiled below
    STALE_PLAN_DB; a fixed configuration never (it keeps its configuration). Both runtimes'
    allocators, and the C++ twin of the rule."""
    import sakura_native as native
    from sakura.edge.allocator import FixedAllocator
    from sakura.edge.stale_plan import STALE_PLAN_DB, skippable

    assert STALE_PLAN_DB == native.STALE_PLAN_DB == 50.0
    psnrs = [62.0, 55.0, 50.0, 49.9, 44.0, 58.0]  # ids 0..5, bytes growing with the id
    opts = [ConfigOption(id=i, nbytes=1000 * (i + 1), params={}, psnr_db=q)
            for i, q in enumerate(psnrs)]
    unknown = [ConfigOption(id=i, nbytes=1000 * (i + 1), params={}, weighted_err=1.0 / (i + 1))
               for i in range(3)]
    a = impl.adaptive([ShardOptions(0, opts), ShardOptions(1, unknown)])
    assert [c for c in range(6) if a.skippable(0, c)] == [0, 3, 4]  # smallest; < 50 dB
    assert [c for c in range(3) if a.skippable(1, c)] == [0]  # no PSNR: the smallest only
    assert a.skippable(0, a.choose(0, 0.01, 1e3))  # nothing fits: the smallest
    for q in (None, float("nan"), 10.0, 49.99, 50.0, 80.0):
        for small in (False, True):
            assert skippable(q, small) == native.stale_skippable(q, small), (q, small)
    fixed = FixedAllocator([0, 0])
    assert not fixed.skippable(0, 0)
    assert not to_native(fixed, native).skippable(0, 0)


def test_the_baselines_do_not_plan_stale_and_sakuras_policies_do():
    assert {n for n, p in POLICIES.items() if p.plans_stale} == {
        "sakura", "svd", "sakura-fixed-bits", "sakura-greedy", "sakura-optimistic",
        "sakura-floor"}
