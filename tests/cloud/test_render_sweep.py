"""The ``load_sweep`` bench key (``cloud.render_sweep``): its pooled figures and bootstrap on
hand-made replays, and one tiny seeded sweep through a real engine."""

from __future__ import annotations

import pytest
from sakura.cloud.render_sweep import SeedPair, bootstrap_ci95, figures, load_sweep
from sakura.cloud.render_trace import percentile
from sakura.dit.regional_bench import psnr_from_mse
from sakura.dit.weights import save_model

from tests.cloud.test_render import CFG, SIZE, STEPS, _model


def _pair(full_rps: float, reg_rps: float, full_lat: list[float], reg_lat: list[float],
          se: float, count: int = 100) -> SeedPair:
    return SeedPair(full_rps, reg_rps, full_lat, reg_lat, se, count, [0.6] * len(reg_lat))


def test_figures_pool_the_seeds():
    a = _pair(1.0, 2.0, [1.0, 2.0, 3.0], [0.5, 1.0, 1.5], se=0.01)
    b = _pair(2.0, 2.0, [4.0, 5.0, 6.0], [2.0, 2.5, 3.0], se=0.03)
    f = figures([a, b])
    # mean throughputs 1.5 (full) and 2.0 (regional)
    assert f["throughput_ratio_vs_full"] == pytest.approx(2.0 / 1.5)
    assert f["p90_latency_ratio_vs_full"] == pytest.approx(
        percentile([0.5, 1.0, 1.5, 2.0, 2.5, 3.0], 90) / percentile([1, 2, 3, 4, 5, 6], 90))
    # pooled squared error over the pooled count, not a mean of per-seed PSNRs
    assert f["served_psnr_db_vs_full"] == pytest.approx(psnr_from_mse(0.04 / 200))


def test_bootstrap_over_identical_seeds_has_no_width_and_brackets_the_estimate():
    same = [_pair(1.0, 1.6, [1.0, 2.0], [0.8, 1.2], se=0.02)] * 3
    ci = bootstrap_ci95(same, resamples=50)
    point = figures(same)
    for k, (lo, hi) in ci.items():
        assert lo == pytest.approx(point[k]) and hi == pytest.approx(point[k])
    mixed = [_pair(1.0, r, [1.0, 2.0], [0.8, 1.2], se=0.02) for r in (1.2, 1.6, 2.4)]
    lo, hi = bootstrap_ci95(mixed, resamples=400)["throughput_ratio_vs_full"]
    assert 1.2 <= lo < figures(mixed)["throughput_ratio_vs_full"] < hi <= 2.4


def test_a_tiny_sweep_through_a_real_engine(tmp_path, text_encoder):
    weights = tmp_path / "tiny.safetensors"
    save_model(_model(), weights)
    out = load_sweep(str(weights), text_encoder, ["a red circle", "a blue square"], CFG,
                     workers=1, requests=3, seeds=2, steps=STEPS, size=SIZE,
                     loads=(0.5, 2.0))
    assert [e["load"] for e in out] == [0.5, 2.0]
    for e in out:
        assert (e["requests"], e["seeds"]) == (3, 2)
        for k in ("throughput_ratio_vs_full", "p90_latency_ratio_vs_full",
                  "served_psnr_db_vs_full"):
            lo, hi = e["ci95"][k]
            assert lo <= hi
        assert e["throughput_ratio_vs_full"] > 0 and e["p90_latency_ratio_vs_full"] > 0
        assert 0.0 < e["compute_fraction"] <= 1.0
    # the offered rate scales with the load, from one measured service time
    assert out[1]["arrival_rate_rps"] == pytest.approx(4 * out[0]["arrival_rate_rps"])
