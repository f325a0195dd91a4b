"""Trace model: exact integrals with looping and outages, transforms, statistics, sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sakura.traces import Trace, TraceError

from sakura.errors import SakuraError

MB = 1e6


@pytest.fixture()
def steps() -> Trace:
    # 0-1 s: 8 Mbit/s, 1-2 s: outage, 2-4 s: 16 Mbit/s (non-uniform slices).
    return Trace.from_edges([0, 1, 2, 4], [8 * MB, 0, 16 * MB], name="steps")


def test_construction_and_views(steps: Trace) -> None:
    assert steps.duration_s == 4.0
    assert len(steps) == 3
    assert steps.interval_s is None
    assert Trace.from_rates([1, 2, 3], 0.5).interval_s == 0.5
    np.testing.assert_array_equal(steps.edges_s, [0, 1, 2, 4])
    assert steps.total_bits == 8 * MB + 32 * MB
    assert steps.mean_bps == pytest.approx(10 * MB)
    with pytest.raises(ValueError):
        steps.rates_bps[0] = 1.0  # immutable arrays
    with pytest.raises(AttributeError):
        steps.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "times, rates, duration",
    [([], [], 1.0), ([0, 1], [1.0], 2.0), ([0.5], [1.0], 2.0), ([0, 2, 1], [1, 1, 1], 3.0),
     ([0], [-1.0], 1.0), ([0], [math.nan], 1.0), ([0, 1], [1.0, 1.0], 1.0)],
)  # fmt: skip
def test_invalid_traces_raise_sakura_error(times, rates, duration) -> None:
    with pytest.raises(TraceError):
        Trace(np.array(times, float), np.array(rates, float), duration)
    assert issubclass(TraceError, SakuraError)


def test_rate_at_and_looping(steps: Trace) -> None:
    assert steps.rate_at(0.5) == 8 * MB
    assert steps.rate_at(1.0) == 0.0
    assert steps.rate_at(3.99) == 16 * MB
    assert steps.rate_at(4.5) == 8 * MB  # loops
    assert steps.rate_at(9.5) == 0.0  # 9.5 mod 4 = 1.5
    np.testing.assert_array_equal(steps.rate_at(np.array([0.0, 1.5, 2.5])), [8 * MB, 0, 16 * MB])


def test_bytes_between_is_exact_with_loops(steps: Trace) -> None:
    assert steps.bytes_between(0, 1) == pytest.approx(1e6)
    assert steps.bytes_between(1, 2) == 0.0  # outage
    assert steps.bytes_between(0.5, 2.5) == pytest.approx(0.5e6 + 1e6)
    # Two whole loops plus 0.5 s.
    assert steps.bytes_between(0, 8.5) == pytest.approx(2 * 5e6 + 0.5e6)
    assert steps.bytes_between(3.0, 5.0) == pytest.approx(2e6 + 1e6)
    with pytest.raises(TraceError):
        steps.bytes_between(2, 1)


def test_time_to_deliver_skips_outages_and_loops(steps: Trace) -> None:
    assert steps.time_to_deliver(0, 1.3) == 1.3
    assert steps.time_to_deliver(0.5e6, 0) == pytest.approx(0.5)
    # Starting in the outage: waits until 2 s, then 16 Mbit/s.
    assert steps.time_to_deliver(2e6, 1.2) == pytest.approx(3.0)
    # 1 MB at 0.5 s: 0.5 MB by 1 s, outage, remaining 0.5 MB at 2 MB/s -> 2.25 s.
    assert steps.time_to_deliver(1e6, 0.5) == pytest.approx(2.25)
    # One full loop (5 MB) from 0 ends when the last non-zero slice of the loop ends.
    assert steps.time_to_deliver(5e6, 0) == pytest.approx(4.0)
    assert steps.time_to_deliver(6e6, 0) == pytest.approx(5.0)
    assert steps.transfer_time(2e6, 1.2) == pytest.approx(1.8)
    for t0 in (0.0, 0.7, 1.5, 3.3, 10.1):
        for n in (1.0, 1e5, 3e6, 2.2e7):
            t1 = steps.time_to_deliver(n, t0)
            assert steps.bytes_between(t0, t1) == pytest.approx(n, rel=1e-9)


def test_all_zero_trace_raises_instead_of_hanging() -> None:
    dead = Trace.from_rates([0.0, 0.0], 1.0, name="dead")
    assert dead.bytes_between(0, 10) == 0.0
    assert dead.time_to_deliver(0, 3.0) == 3.0
    with pytest.raises(TraceError, match="zero capacity"):
        dead.time_to_deliver(1, 0.0)


def test_slice_wraps_and_preserves_integral(steps: Trace) -> None:
    piece = steps.slice(3.0, 3.0)  # 3-4 (16), 0-1 (8), 1-2 (0) of the next loop
    assert piece.duration_s == 3.0
    np.testing.assert_allclose(piece.edges_s, [0, 1, 2, 3])
    np.testing.assert_allclose(piece.rates_bps, [16 * MB, 8 * MB, 0])
    assert piece.bytes_between(0, 3) == pytest.approx(steps.bytes_between(3, 6))
    tail = steps.slice(1.5)
    assert tail.duration_s == 2.5
    assert tail.bytes_between(0, 2.5) == pytest.approx(4e6)
    assert steps.looped() is steps  # queries loop anyway
    long = steps.looped(10.0)
    assert long.duration_s == 10.0
    assert long.bytes_between(0, 10) == pytest.approx(steps.bytes_between(0, 10))
    with pytest.raises(TraceError):
        steps.slice(0.0, 0.0)


def test_scale_concat_select_resample(steps: Trace) -> None:
    half = steps.scaled(0.5)
    assert half.bytes_between(0, 4) == pytest.approx(2.5e6)
    assert half.rate_at(1.5) == 0.0
    with pytest.raises(TraceError):
        steps.scaled(-1)
    lte = Trace.from_rates([10 * MB] * 3, 1.0, name="lte").with_labels("LTE")
    nr = Trace.from_rates([100 * MB] * 2, 1.0, name="nr").with_labels("5G")
    mixed = Trace.concatenate([lte, nr, lte])
    assert mixed.duration_s == 8.0
    assert mixed.label_at(3.5) == "5G" and mixed.label_at(6.0) == "LTE"
    assert mixed.bytes_between(0, 8) == pytest.approx((60 + 200) * MB / 8)
    assert lte.concat(nr).duration_s == 5.0
    only5g = mixed.select("5G")
    assert only5g.duration_s == 2.0 and set(only5g.labels) == {"5G"}
    with pytest.raises(TraceError):
        mixed.select("WiFi")
    coarse = Trace.from_rates([1, 3, 5, 7, 9], 0.2).resampled(0.5)
    np.testing.assert_allclose(coarse.edges_s, [0, 0.5, 1.0])
    np.testing.assert_allclose(coarse.rates_bps, [(0.2 + 0.6 + 0.5) / 0.5, (0.5 + 1.4 + 1.8) / 0.5])


def test_stats_values() -> None:
    tr = Trace.from_rates(np.array([0, 10, 20, 30, 40, 0, 60, 70, 80, 90]) * MB, 1.0)
    st = tr.stats()
    assert st["mean_mbps"] == pytest.approx(40.0)
    assert st["median_mbps"] == pytest.approx(35.0)
    assert st["p10_mbps"] == pytest.approx(0.0)
    assert st["p90_mbps"] == pytest.approx(81.0)
    assert st["outage_fraction"] == pytest.approx(0.2)
    assert st["duration_s"] == 10.0
    # Sub-second slices are judged over 1-s windows.
    fine = Trace.from_rates([0, 20 * MB] * 5 + [0] * 10, 0.1)
    st = fine.stats()
    assert st["median_mbps"] == pytest.approx(5.0)
    assert st["outage_fraction"] == pytest.approx(0.5)


def test_sample_starts_reproducible_and_in_range(steps: Trace) -> None:
    long = Trace.from_rates(np.full(300, 5 * MB), 1.0)
    a = long.sample_starts(100, seed=7, span_s=20)
    b = long.sample_starts(100, seed=7, span_s=20)
    c = long.sample_starts(100, seed=8, span_s=20)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.shape == (100,) and a.min() >= 0 and a.max() <= 280
    np.testing.assert_array_equal(a, np.round(a, 3))
    # Span longer than the trace: uniform over the whole trace (the run will loop).
    s = steps.sample_starts(50, seed=1, span_s=100)
    assert s.min() >= 0 and s.max() < steps.duration_s
    assert steps.sample_starts(0).size == 0
