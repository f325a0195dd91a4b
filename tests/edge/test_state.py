"""The rate memory (edge/state.py): decay, per-origin keys, persistence, and the constants
checked against the Lumos5G traces they were measured on."""

from __future__ import annotations

import math

import pytest
from sakura.edge.state import (
    FLOOR,
    HALF_LIFE_S,
    RateMemory,
    decayed,
    origin_of,
    trace_memory_stats,
)


def test_decay_starts_at_the_estimate_and_levels_at_the_floor():
    assert decayed(10e6, 0.0) == pytest.approx(10e6)
    assert decayed(10e6, HALF_LIFE_S) == pytest.approx(10e6 * FLOOR ** 0.5)
    assert decayed(10e6, 1e9) == pytest.approx(10e6 * FLOOR)
    ages = [0, 1, 5, 30, 120, 600]
    values = [decayed(1.0, a) for a in ages]
    assert values == sorted(values, reverse=True) and values[-1] >= FLOOR
    assert decayed(1.0, -1.0) == pytest.approx(FLOOR)  # a clock set back: counts as old


def test_memory_is_per_origin_and_survives_json():
    now = [1000.0]
    mem = RateMemory(clock=lambda: now[0])
    assert mem.prior_bps("http://a:1/x") is None
    mem.remember("http://A:1/catalog.json", 8e6, 0.03)
    assert origin_of("http://A:1/catalog.json") == "http://a:1"
    assert mem.prior_bps("http://a:1/packs/t.pack") == pytest.approx(8e6)
    assert mem.prior_bps("http://a:2") is None
    now[0] += 60
    assert mem.prior_bps("http://a:1") == pytest.approx(decayed(8e6, 60))
    mem.remember("http://a:1", None, 0.02)        # a latency only (a 304): rate kept
    assert mem.latency_s("http://a:1") == 0.02
    assert mem.prior_bps("http://a:1") == pytest.approx(decayed(8e6, 60))
    mem.remember("http://a:1", -5.0)               # nothing learnt
    again = RateMemory.from_json(mem.to_json(), clock=lambda: now[0])
    assert again.to_json() == mem.to_json()
    broken = RateMemory.from_json({"http://a:1": {"rate_bps": "x"}, "b": {"at": 1},
                                   "c": {"rate_bps": math.inf, "at": 0}})
    assert broken.entries == {}
    assert RateMemory.from_json("garbage").entries == {}


def test_the_constants_follow_the_traces_they_were_measured_on():
    """The 25th percentile of rate(t + age) / rate(t) over the Lumos5G 5G traces, and the
    rule's value at the same ages (edge/state.py): within 0.1 (in ratio) at every age, so a
    remembered rate is a prior the link beats about 3 times in 4."""
    from sakura.traces.catalog import default_trace_dir, load_set

    if default_trace_dir() is None:
        pytest.skip("the shared traces are not beside the repository")
    rates = [t.resampled(1.0).rates_bps for t in load_set("5g")]
    ages = [5.0, 10.0, 30.0, 60.0, 300.0]
    q25 = trace_memory_stats(rates, 1.0, ages, 0.25)
    for age in ages:
        assert abs(q25[age] - decayed(1.0, age)) <= 0.1, (age, q25[age], decayed(1.0, age))
