"""The ``slo`` bench key (``cloud.render_slo``) on a tiny seeded model: the classes it
assigns, the deadline rule, and that every share is a share of the requests it names."""

from __future__ import annotations

import math

from sakura.cloud.render_api import RenderRequest
from sakura.cloud.render_slo import DEADLINE_FACTOR, classed, slo_bench
from sakura.cloud.render_trace import bursty_arrivals
from sakura.dit.weights import save_model

from tests.cloud.test_render import CFG, SIZE, STEPS, _model


def test_every_third_arrival_in_time_order_is_high():
    trace = bursty_arrivals(10, 5.0, ["a", "b"], burst=3, seed=4)
    make = classed(RenderRequest(), trace, high_every=3)
    classes = [make(a).priority for a in sorted(trace, key=lambda a: a.t)]
    assert classes == ["high" if i % 3 == 0 else "low" for i in range(10)]


def test_slo_shares_count_the_requests_that_met_twice_their_unloaded_latency(
        tmp_path, text_encoder):
    weights = tmp_path / "tiny.safetensors"
    save_model(_model(), weights)
    out = slo_bench(str(weights), text_encoder, ["a red circle", "a blue square"], CFG,
                    workers=1, requests=5, steps=STEPS, size=SIZE, unloaded_runs=1,
                    capacity_rows=400)
    assert out["deadline_s"] == DEADLINE_FACTOR * out["unloaded_latency_s"]
    assert (out["high_count"], out["low_count"]) == (2, 3)
    for cls in ("high", "low"):
        lat = out[f"{cls}_latency_s"]
        assert len(lat) == out[f"{cls}_count"]
        assert math.isclose(out[cls], sum(x <= round(out["deadline_s"], 3) + 1e-3
                                          for x in lat) / len(lat), abs_tol=1 / len(lat))
    assert len(out["fifo_latency_s"]) == 5 and 0.0 <= out["fifo"] <= 1.0
    assert 0.0 <= out["fifo_same_requests"] <= 1.0
    assert out["high_minus_fifo"] == out["high"] - out["fifo"]
    assert out["engine"] == {"capacity_rows": 400}
