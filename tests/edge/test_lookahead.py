"""Tail-aware allocation (edge/lookahead.py and its C++ twin): scripted links, no network.

A fluid link at a constant rate delivers the shards' bytes in request order; shard ``j``
executes at its deadline ``allowance + sum(slots before j)``. Greedy spends the startup
allowance on shard 0 and leaves the next shards one slot each; the plan spreads it, and the
summed output error over the edit is lower. Both runtimes choose the same configuration."""

from __future__ import annotations

import math
import random

import pytest
from sakura.edge.allocator import (
    AdaptiveAllocator,
    ConfigOption,
    ShardOptions,
    make_lookahead,
    to_native,
)
from sakura.edge.lookahead import Lookahead, config_cost

LADDER = [(1_000, 20.0), (3_000, 25.0), (5_000, 29.0), (10_000, 33.0), (20_000, 37.0),
          (40_000, 45.0)]


def tables(n: int, psnr_shift: list[float] | None = None) -> list[ShardOptions]:
    shift = psnr_shift or [0.0] * n
    return [ShardOptions(s, [ConfigOption(id=i, nbytes=b, params={"i": i},
                                          psnr_db=q + shift[s], weighted_err=1 / (i + 1))
                             for i, (b, q) in enumerate(LADDER)]) for s in range(n)]


def run_link(alloc, n: int, allowance_s: float, slot_s: float, rate_bps: float
             ) -> tuple[list[int], int]:
    """Choices on the fluid link, and how many shards arrived after their deadline."""
    free, late, chosen = 0.0, 0, []
    for j in range(n):
        deadline = allowance_s + j * slot_s
        config = alloc.choose(j, deadline - free, rate_bps)
        chosen.append(config)
        free += LADDER[config][0] * 8.0 / rate_bps
        late += free > deadline + 1e-12
    return chosen, late


def cost(ts: list[ShardOptions], configs: list[int]) -> float:
    return sum(config_cost(t.by_id(c).psnr_db, None) for t, c in zip(ts, configs))


@pytest.fixture(params=["python", "native"])
def build(request):
    def make(ts, slots, safety=1.0, lookahead=True):
        a = AdaptiveAllocator(ts, 0.0, safety,
                              lookahead=make_lookahead(ts, slots) if lookahead else None)
        if request.param == "python":
            return a
        import sakura_native as native

        out = to_native(a, native)
        assert out.has_lookahead == lookahead
        return out
    return make


def test_plan_spreads_the_startup_allowance_and_lowers_the_edit_error(build):
    n, slot, rate = 12, 0.005, 8e6  # 1 MB/s: 5000 bytes per slot, 40000 in the allowance
    ts = tables(n)
    greedy, g_late = run_link(build(ts, [slot] * n, lookahead=False), n, 0.040, slot, rate)
    plan, p_late = run_link(build(ts, [slot] * n), n, 0.040, slot, rate)
    assert greedy[0] == 5 and max(greedy[1:]) <= 2  # all to shard 0, then a slot each
    assert plan[0] < 5  # shard 0 leaves bytes for the next ones
    assert p_late == g_late == 0
    assert cost(ts, plan) < 0.7 * cost(ts, greedy)


def test_plan_favours_the_shards_the_edit_is_most_sensitive_to(build):
    # shard 1's configurations each cost 6 dB more output PSNR (4x the error) than the
    # others': the plan moves bytes to it from its neighbours
    n, slot, rate = 4, 0.005, 8e6
    flat, late = run_link(build(tables(n), [slot] * n), n, 0.010, slot, rate)
    assert late == 0
    ts = tables(n, psnr_shift=[0.0, -6.0, 0.0, 0.0])
    chosen, late = run_link(build(ts, [slot] * n), n, 0.010, slot, rate)
    assert late == 0
    assert LADDER[chosen[1]][0] > LADDER[flat[1]][0]
    assert LADDER[chosen[1]][0] == max(LADDER[c][0] for c in chosen)


def test_nothing_fits_gives_the_smallest_as_greedy_does(build):
    ts = tables(4)
    a = build(ts, [0.005] * 4)
    assert a.choose(0, 0.0, 8e6) == 0
    assert a.choose(1, 0.0005, 8e6) == 0  # 500 bytes: below the smallest
    assert a.choose(2, 1.0, 0.0) == 0  # no rate estimate


def test_shards_that_may_run_stale_leave_their_bytes_to_the_one_that_may_not(build):
    """Shard 0 must be fetched (its group's K/V are too old), shards 1-3 may run stale. The
    plan that knows it gives shard 0 the whole budget; the one that does not reserves bytes
    for shards the receive stage then leaves unfetched."""
    n, slot, rate = 4, 0.005, 8e6  # 5000 bytes per slot, 21000 in shard 0's window
    ts = tables(n)
    a = build(ts, [slot] * n)
    blind = a.choose(0, 0.021, rate)
    sees = a.choose(0, 0.021, rate, lambda m: m > 0)
    assert LADDER[blind][0] < 20000  # spread over the four
    assert LADDER[sees][0] == 20000
    # a shard that may run stale, with nothing better than 45 dB (below STALE_PLAN_DB) in
    # reach and a later shard that may not: it is planned stale (the smallest is answered)
    assert a.choose(0, 0.01, rate, lambda m: m == 0) == 0
    # stale is an option, not a rule: with bytes to spare a shard whose best is above
    # STALE_PLAN_DB (55 dB here) is fetched at it
    up = tables(n, psnr_shift=[10.0] * n)
    assert build(up, [slot] * n).choose(0, 10.0, rate, lambda m: True) == 5


def test_a_lookahead_needs_a_cost_for_every_configuration():
    ts = [ShardOptions(0, [ConfigOption(id=0, nbytes=10, params={})])]
    assert make_lookahead(ts, [0.01]) is None
    assert config_cost(None, None) is None
    assert config_cost(30.0, 0.5) == pytest.approx(1e-3)
    assert config_cost(None, 0.5) == 0.5


def test_native_and_python_plans_choose_the_same_on_random_tables():
    import sakura_native as native

    rng = random.Random(7)
    for case in range(200):
        n = rng.randint(1, 12)
        ts = []
        for s in range(n):
            k = rng.randint(1, 8)
            opts = [ConfigOption(id=i, nbytes=rng.randint(1, 50_000), params={"i": i},
                                 psnr_db=rng.uniform(15, 60)) for i in range(k)]
            ts.append(ShardOptions(s, opts))
        slots = [rng.uniform(0.0, 0.02) for _ in range(n)]
        la = make_lookahead(ts, slots)
        la = Lookahead(la.costs, la.slots_s, horizon=rng.randint(1, 10),
                       bins=rng.choice([1, 7, 64, 256]))
        py = AdaptiveAllocator(ts, rng.uniform(0, 0.01), rng.uniform(0.5, 1.5), lookahead=la)
        cc = to_native(py, native)
        for _ in range(5):
            j = rng.randrange(n)
            w, r = rng.uniform(-0.01, 0.1), rng.choice([0.0, rng.uniform(1e5, 1e8)])
            assert py.choose(j, w, r) == cc.choose(j, w, r), (case, j, w, r)
            mask = [rng.random() < 0.4 for _ in range(n)]
            assert py.choose(j, w, r, mask.__getitem__) == cc.choose(
                j, w, r, mask.__getitem__), (case, j, w, r, mask)


def test_native_refuses_a_lookahead_that_does_not_match_its_tables():
    import sakura_native as native

    a = native.AdaptiveAllocator([[(0, 10), (1, 5)]])
    with pytest.raises(ValueError, match="one lookahead cost per configuration"):
        a.set_lookahead([[1.0]], [0.01])
    with pytest.raises(ValueError, match="a slot per shard"):
        a.set_lookahead([[1.0, 2.0]], [])
    assert not math.isnan(a.choose(0, 1.0, 1e6))
