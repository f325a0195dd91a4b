"""``sakura bench tail``: its configurations and the aggregation of replay records (no
network: the kernel link and the edits run in the bench itself)."""

from __future__ import annotations

import pytest
from sakura.edge.replay.tail import EVENTS, LOSSES, loss_key, summarize, tail_configs, targets


def rec(policy, template, start, latency, psnr, stall=0.0, **kw):
    return {"policy": policy, "template": template, "network": "5g", "trace": "t",
            "start_s": float(start), "latency_s": latency, "psnr_exact": psnr,
            "stall_s": stall, **kw}


def test_every_loss_runs_the_kernel_link_and_local_only_at_zero():
    cfgs = tail_configs(quick=True)
    assert list(cfgs) == [loss_key(x) for x in LOSSES] == ["0", "0.01", "0.03"]
    for lk, cfg in cfgs.items():
        assert cfg.link == "kernel" and cfg.loss == float(lk)
        assert len(cfg.templates) >= 3 and not cfg.deadlines and not cfg.ablation.q
        for p in ("sakura", "sakura-fixed-config", "sakura-fixed-bits", "cachegen", "intq"):
            assert p in cfg.policies
        assert ("local" in cfg.policies) == (lk == "0")
    full = tail_configs()["0"]
    assert full.starts_of("5g") >= 12 and full.starts_of("mixed") == 2


def test_ratios_are_per_template_p90_then_the_median_over_templates():
    runs = []
    for t, k in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        for s in range(10):
            runs.append(rec("sakura", t, s, 1.0 * k, 30.0, truncations=1, hedges=2,
                            local_fallbacks=s % 2, refinements=3))
            runs.append(rec("cachegen", t, s, 2.0 * k * (1 + (t == "c")), 28.0))
            runs.append(rec("intq", t, s, 1.5 * k, 29.0))
            runs.append(rec("sakura-fixed-bits", t, s, 1.0 * k, 27.0 - (s == 0) * 10))
            runs.append(rec("local", t, s, 0.8 * k, 31.0))
    doc = summarize({"0": runs})
    assert doc["p90_ratio_vs_cachegen"]["0"] == pytest.approx(2.0)  # median of 2, 2, 4
    assert doc["p90_ratio_vs_intq"]["0"] == pytest.approx(1.5)
    assert doc["psnr_mean_db"]["sakura"]["0"] == pytest.approx(30.0)
    assert doc["psnr_p10_gain_db_vs_fixed_bits"]["0"] == pytest.approx(4.0)  # p10 26 dB
    assert doc["max_latency_over_local"]["0"] == pytest.approx(1.25)
    assert doc["events"]["0"]["truncations"] == 30 and doc["events"]["0"]["hedges"] == 60
    assert doc["events"]["0"]["local_fallbacks"] == 15
    assert set(doc["events"]["0"]) == set(EVENTS)
    assert doc["events"]["0"]["refinements"] == 90
    t = targets(doc)
    assert t["p90_ratio_vs_cachegen[0]"] is True and t["p90_ratio_vs_intq[0]"] is False
    assert t["max_latency_over_local[0]"] is False
    assert t["p90_ratio_vs_cachegen[0.01]"] is None  # not measured


def test_local_is_read_from_loss_zero_for_the_other_losses():
    zero = [rec("local", "a", 0, 1.0, 31.0), rec("sakura", "a", 0, 0.5, 30.0)]
    lossy = [rec("sakura", "a", 0, 1.2, 29.0, stall=0.3)]
    doc = summarize({"0": zero, "0.03": lossy})
    assert doc["max_latency_over_local"]["0.03"] == pytest.approx(1.2)
    assert doc["max_stall_s"]["sakura"]["0.03"] == pytest.approx(0.3)


def test_the_p90_bound_takes_local_at_outage_starts_and_the_floor_elsewhere():
    # 10 starts; at 2 of them CacheGen computed 16 of 20 steps locally (an outage start):
    # no policy can beat local (1.4 s) there, nor the masked execution (0.45 s) anywhere.
    runs = []
    for s in range(10):
        outage = s in (3, 7)
        runs.append(rec("cachegen", "a", s, 1.6 if outage else 0.9, 30.0,
                        local_fallbacks=16 if outage else 2))
        runs.append(rec("sakura", "a", s, 1.45 if outage else 0.5, 33.0))
        runs.append(rec("local", "a", s, 1.4, 40.0))
    doc = summarize({"0": runs}, {"a": {"steps": 20, "masked_exec_s": 0.45}})
    bound = doc["p90_bound_vs_cachegen"]["0"]
    assert bound["outage_start_share"] == pytest.approx(0.2)
    # p90 of CacheGen: 1.6 (two starts at 1.6); of the best case: 1.4 (two starts at local)
    assert bound["ratio"] == pytest.approx(1.6 / 1.4, rel=1e-3)
    assert doc["p90_ratio_vs_cachegen"]["0"] <= bound["ratio"]
    assert "p90_bound_vs_cachegen" not in summarize({"0": runs})  # no template records


def test_the_starved_estimate_runs_the_no_byte_schedule_where_neither_got_bytes():
    # 10 starts; at 3 of them neither system got 1% of the 1 MB FP16 cache (starved): there
    # the fastest edit computes 5 of 20 steps locally (1.2 s / 20 each) and runs 15 masked
    # (0.4 s / 20 each) = 0.6 s; elsewhere the masked execution, 0.4 s
    runs = []
    for s in range(10):
        starved = s in (2, 5, 8)
        runs.append(rec("cachegen", "a", s, 1.0 if starved else 0.7, 30.0,
                        bytes=5_000 if starved else 600_000))
        runs.append(rec("sakura", "a", s, 0.7 if starved else 0.45, 33.0,
                        bytes=0 if starved else 800_000))
    tpl = {"a": {"steps": 20, "masked_exec_s": 0.4, "local_s": 1.2, "fp16_bytes": 1_000_000}}
    est = summarize({"0": runs}, tpl)["p90_starved_estimate_vs_cachegen"]["0"]
    assert est["starved_start_share"] == pytest.approx(0.3)
    assert est["ratio"] == pytest.approx(1.0 / 0.6, rel=1e-3)  # both p90s at starved starts
    # one system with megabytes at a start: not starved there
    runs[4]["bytes"] = 900_000  # start 2's CacheGen record
    est = summarize({"0": runs}, tpl)["p90_starved_estimate_vs_cachegen"]["0"]
    assert est["starved_start_share"] == pytest.approx(0.2)


def test_the_cached_p10_gain_leaves_out_starts_with_local_steps():
    runs = []
    for s in range(10):
        outage = s < 3  # both policies computed steps locally: local's PSNR, 26.5 dB
        runs.append(rec("sakura", "a", s, 0.5, 26.5 if outage else 30.0 + s,
                        local_fallbacks=20 if outage else 0))
        runs.append(rec("sakura-fixed-bits", "a", s, 0.5, 26.5 if outage else 28.0,
                        local_fallbacks=20 if outage else 0))
    doc = summarize({"0": runs})
    assert doc["psnr_p10_gain_db_vs_fixed_bits"]["0"] == pytest.approx(0.0)
    # over starts 3-9: sakura 33-39 dB (p10 33.6), fixed-bits 28 dB
    assert doc["psnr_p10_gain_db_vs_fixed_bits_cached"]["0"] == pytest.approx(5.6)


def test_the_minimum_rto_is_scaled_with_the_round_trip_unless_kept_at_the_kernels():
    """Issue 28 item 8's comparison: ``rto_min: kernel`` leaves the routes at the kernel's
    200 ms while the round trip is scaled; the default scales both."""
    from pathlib import Path

    from sakura.edge.replay.links import Links
    from sakura.traces.namespaces import scaled_rto_min_ms

    class Recording:
        def __init__(self):
            self.rto = "unset"

        def set_impairment(self, imp):
            self.imp = imp

        def set_rto_min_ms(self, ms):
            self.rto = ms

    got = {}
    for mode in ("scaled", "kernel"):
        cfg = tail_configs(quick=True, rto_min=mode)["0"]
        assert cfg.rto_min == mode
        links = Links(cfg.replace(pin_cpus=False), Path("."), [], print)
        links.links["sakura"] = link = Recording()
        links.set_rtt(cfg.rtt_ms / 10)
        assert link.imp.rtt_ms == pytest.approx(cfg.rtt_ms / 10)
        got[mode] = link.rto
    assert got == {"scaled": pytest.approx(scaled_rto_min_ms(0.1)), "kernel": None}
    with pytest.raises(Exception, match="rto_min must be one of scaled, kernel"):
        tail_configs(rto_min="fast")
