"""``sakura replay`` / ``sakura report``: config, resume, an end-to-end replay over real
HTTP with real traces, and the headline numbers from a hand-made results file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from sakura.edge.replay.config import ReplayConfigError, default_config, load_config
from sakura.edge.replay.headline import headline
from sakura.edge.replay.load_gate import RETAKES, wait_for_quiet
from sakura.edge.replay.report import write_report
from sakura.edge.replay.results import ResultsFile
from sakura.edge.replay.runner import _timed_run

from sakura.cli import main
from tests.edge.helpers import ONE_BLOCK_SHARDS, alive, children_of

# ---------------------------------------------------------------------------- config


def test_default_and_quick_config():
    cfg = default_config()
    assert set(cfg.workloads) == {"face-swap", "try-on", "instruction"}
    assert cfg.starts == 100 and cfg.regime == "matched" and cfg.regime_x == 10.0
    assert len(cfg.policies) == 8 and cfg.profile.local_s == 13.0
    assert cfg.rtt_ms == 30.0 and cfg.loss == 0.0 and cfg.deadlines == (2.0, 3.0, 4.0)
    assert cfg.rtt_scale == "matched" and load_config(rtt_scale="none").rtt_scale == "none"
    with pytest.raises(ReplayConfigError, match="rtt_scale"):
        load_config(rtt_scale="phone")
    q = load_config(quick=True)
    assert q.quick and len(q.networks) == 2
    assert all(len(ts) == 1 for ts in q.workloads.values())
    # at least 10 start points per cell on the 5G (headline) traces, 3 elsewhere
    assert q.starts_of("5g") == 10 and q.starts_of("mixed") == 3 and q.ablation.starts == 3
    assert load_config(quick=True, starts=12).starts_of("5g") == 12  # --starts wins
    assert load_config(starts=7).starts_of("mixed") == 7


def test_plan_has_start_points_per_network_and_sakura_operating_points():
    from sakura.edge.replay.plan import deadline_multiple, plan
    from sakura.traces import default_trace_dir

    if default_trace_dir() is None:
        pytest.skip("real traces not found")
    runs = plan(load_config(quick=True), str(default_trace_dir()))
    cells: dict = {}
    for r in runs:
        cells.setdefault((r.template, r.key.network, r.key.policy), set()).add(
            r.start.index)
    assert {len(v) for (t, n, p), v in cells.items() if n == "5g" and t == t.split("-32")[0]
            and not p.startswith("sakura-q")} == {10}
    assert {len(v) for (t, n, p), v in cells.items() if n == "mixed"} == {3}
    points = {r.key.policy for r in runs if deadline_multiple(r.key.policy) is not None}
    assert points == {"sakura-d2", "sakura-d4"}  # --quick: the first and last deadline
    assert all(r.key.network == "5g" and r.policy == "sakura" for r in runs
               if r.key.policy in points)
    # the ablations use the network's first start points (the same draws)
    q = {r.start for r in runs if r.key.policy == "sakura-q1"}
    main5 = [r.start for r in runs if r.key.policy == "sakura" and r.key.network == "5g"
             and r.template == "face-technologist"]
    assert {sp.index for sp in q} == {0, 1, 2} and q <= set(main5)


def test_the_breadth_replay_runs_every_network_at_equal_ablation_counts_and_reuses_quick():
    """breadth.yaml (issue 33 item 2): every network, >= 30 starts on 5g and wifi and >= 10
    elsewhere, fp16/local on the cellular 5g and mixed only, the q / fixed-config / fixed-bits ablations at the
    same count as sakura; and the runs of two-models.yaml --quick are a subset (same keys),
    so a breadth replay into that folder reuses them."""
    from sakura.edge.replay.config import CONFIG_DIR
    from sakura.edge.replay.plan import plan
    from sakura.traces import default_trace_dir

    if default_trace_dir() is None:
        pytest.skip("real traces not found")
    root = str(default_trace_dir())
    cfg = load_config(CONFIG_DIR / "breadth.yaml")
    runs = plan(cfg, root)
    cells: dict = {}
    for r in runs:
        cells.setdefault((r.template, r.key.network, r.key.policy), set()).add(r.start.index)
    nets = {n for (_, n, _) in cells}
    assert nets == {"5g", "wifi", "ucc5g", "lte", "mixed"} and cfg.models == ("sakura-flux2",)
    for (t, n, p), starts in cells.items():
        assert len(starts) >= (30 if n in ("5g", "wifi") else 10), (t, n, p)
        assert p not in ("fp16", "local") or n in ("5g", "mixed")
    ablation = ("svd", "sakura-q0.25", "sakura-q0.5", "sakura", "sakura-q1",
                "sakura-fixed-config", "sakura-fixed-bits")
    for t in cfg.templates:
        assert {len(cells[(t, "5g", p)]) for p in ablation} == {30}
    quick = {str(r.key) for r in plan(load_config(CONFIG_DIR / "two-models.yaml", quick=True),
                                      root) if not r.template.endswith("-32")}
    assert quick <= {str(r.key) for r in runs}


def test_config_file_overrides_and_merges(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("starts: 7\nnetworks: [lte]\nablation: {q: [1.0]}\nprofile: {local_s: 9}\n")
    cfg = load_config(p, regime="profile")
    assert cfg.starts == 7 and cfg.networks == ("lte",) and cfg.regime == "profile"
    assert cfg.ablation.q == (1.0,) and cfg.ablation.resolutions == (32,)  # merged
    assert cfg.profile.local_s == 9.0 and cfg.profile.masked_s == 2.3


def test_one_definition_per_setting():
    """The fields are the definition: default.yaml writes out the same defaults, every
    field has a description, and the README's settings table is the fields' table."""
    from sakura.edge.replay.config import DEFAULT_CONFIG, FILE_KEYS, ReplayConfig, settings_table

    shipped = default_config()
    assert shipped.model_dump(exclude={"source"}) == \
        ReplayConfig().model_dump(exclude={"source"})
    import yaml

    assert set(yaml.safe_load(DEFAULT_CONFIG.read_text())) == set(FILE_KEYS)
    for model in (ReplayConfig, type(shipped.ablation), type(shipped.profile)):
        assert all(f.description for f in model.model_fields.values()), model
    readme = (Path(__file__).parents[2] / "edge" / "replay" / "README.md").read_text()
    assert settings_table() in readme
    assert ReplayConfig.model_fields["trace_dir"].json_schema_extra == {"env": "SAKURA_TRACES"}
    from sakura.cloud.build import BuildConfig  # (the config module keeps the web stack off)

    assert shipped.blocks_per_shard == BuildConfig.blocks_per_shard  # the builder's default


def test_replace_validates_like_a_file():
    cfg = default_config()
    assert cfg.replace(networks=["lte"]).networks == ("lte",)
    with pytest.raises(ValueError):
        cfg.replace(starts="many")


@pytest.mark.parametrize("text, message", [
    ("startz: 3\n", "unknown key"),
    ("networks: [6g]\n", "unknown network '6g'"),
    ("policies: [sakura, magic]\n", "unknown policy 'magic'"),
    ("workloads: {dance: [face-cook]}\n", "unknown workload 'dance'"),
    ("starts: 0\n", "starts must be >= 1"),
    ("blocks_per_shard: 0\n", "blocks_per_shard must be >= 1, got 0"),
    ("starts: many\n", "starts must be a int"),
    ("regime: fast\n", "regime must be one of"),
    ("ablation: {q: [9]}\n", "ablation.q values must be in"),
    ("ablation: {colour: red}\n", "unknown key"),
    ("networks: {a: 1}\n", "networks must be a list"),
    ("- just\n- a list\n", "must be a mapping"),
    ("starts: [\n", "not valid YAML"),
    ("startup_fraction: 1.5\n", r"startup_fraction must be a number in \[0, 1\]"),
    ("startup_fraction: -0.1\n", r"startup_fraction must be a number in \[0, 1\]"),
    ("startup_fraction: .nan\n", r"startup_fraction must be a number in \[0, 1\]"),
    ("startup_fraction: lots\n", "startup_fraction must be a float"),
    ("starts: true\n", "starts must be a int, got True"),
    ("starts: 2.5\n", "starts must be an integer"),
    ("pin_cpus: 1\n", "pin_cpus must be true or false"),
    ("networks: [1]\n", "networks must be a list of str"),
    ("workloads: [a]\n", "workloads must map a workload to template ids"),
    ("ablation: {q: [x]}\n", "ablation.q must be a list of float"),
    ("ablation: 3\n", "ablation must be a mapping"),
    ("profile: {colour: red}\n", r"unknown key\(s\) profile.colour"),
    ("source: elsewhere\n", "unknown key"),
    ("network_starts: {mixed: x}\n", "network_starts.mixed must be a int"),
    ("policy_networks: {fp16: [5g, moon]}\n", "policy_networks.fp16 must name some of networks"),
    ("policy_networks: {fp16: []}\n", "policy_networks.fp16 must name some of networks"),
    ("policy_networks: {tea: [5g]}\n", "policy_networks: 'tea' is not in policies"),
    ("policy_networks: [fp16]\n", "policy_networks must map a policy to a list of netw"),
    ("max_load: -1\n", "max_load must be >= 0"),
])
def test_bad_configs_are_clear_errors(tmp_path, text, message):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ReplayConfigError, match=message) as exc:
        load_config(p)
    line = str(exc.value)
    assert "\n" not in line.strip() and str(p) in line  # one line naming the file


def test_startup_fraction_from_the_config_and_the_command_line(tmp_path, capsys):
    from sakura.edge.monitor import DEFAULT_STARTUP_FRACTION

    assert default_config().startup_fraction == DEFAULT_STARTUP_FRACTION
    p = tmp_path / "c.yaml"
    p.write_text("startup_fraction: 0.1\n")
    assert load_config(p).startup_fraction == 0.1
    assert load_config(p, startup_fraction=0.0).startup_fraction == 0.0
    # a bad value on the command line is a usage error (exit 2, one line, before any work)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(p), "--out", str(tmp_path / "o"), "--startup-fraction", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "startup_fraction must be a number" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_a_resume_with_another_startup_fraction_is_refused(tmp_path):
    from sakura.edge.replay.results import META_FILE
    from sakura.edge.replay.resume import check_meta

    out = tmp_path / "o"
    check_meta(out, load_config(), "sha")
    check_meta(out, load_config(), "sha")                   # same config: resumes
    default = default_config().startup_fraction
    with pytest.raises(ReplayConfigError, match=f"startup_fraction = {default}"):
        check_meta(out, load_config(startup_fraction=0.0), "sha")
    # results from before the allowance existed were made without one
    meta = json.loads((out / META_FILE).read_text())
    del meta["config"]["startup_fraction"]
    (out / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ReplayConfigError, match="startup_fraction = 0.0"):
        check_meta(out, load_config(), "sha")
    check_meta(out, load_config(startup_fraction=0.0), "sha")


def test_bad_config_on_the_command_line_is_one_error_line(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sakura: error: replay config") and "does not exist" in err
    p = tmp_path / "c.yaml"
    p.write_text("workloads: {face-swap: [no-such-template]}\nnetworks: [5g]\n")
    assert main(["replay", str(p), "--out", str(tmp_path / "o")]) == 1
    assert "unknown template 'no-such-template'" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nothing")]) == 1
    assert "not a replay results folder" in capsys.readouterr().err
    p.write_text(f"trace_dir: {tmp_path / 'no-traces'}\n")
    assert main(["replay", str(p), "--out", str(tmp_path / "o")]) == 1
    assert "trace_dir" in capsys.readouterr().err
    (tmp_path / "empty-traces").mkdir()
    p.write_text(f"trace_dir: {tmp_path / 'empty-traces'}\n")
    assert main(["replay", str(p), "--out", str(tmp_path / "o")]) == 1
    assert "trace set '5g' is empty" in capsys.readouterr().err


# ---------------------------------------------------------------------------- results


def test_results_file_is_append_only_and_survives_a_torn_write(tmp_path):
    rf = ResultsFile(tmp_path)
    rf.append({"kind": "run", "key": "a", "latency_s": 1.0})
    rf.append({"kind": "run", "key": "b", "latency_s": 2.0})
    with open(rf.path, "ab") as f:  # a writer killed half-way through a line
        f.write(b'{"kind": "run", "key": "c", "lat')
    assert rf.done() == {"a", "b"}
    rf.append({"kind": "run", "key": "d", "latency_s": 4.0})
    assert [r["key"] for r in rf.runs()] == ["a", "b", "d"]
    assert rf.path.read_bytes().count(b"\n") == 3


def test_a_run_taken_above_the_load_gate_is_retaken_and_its_retake_replaces_it(tmp_path):
    """Issue 33: every record carries its load average, and a record taken above max_load is
    taken again, at once (bounded) and on resume; the latest record of a key is the one
    read."""
    rf = ResultsFile(tmp_path)
    rf.append({"kind": "template", "key": "t", "load1": 3.0})  # setups are not retaken
    rf.append({"kind": "run", "key": "a", "latency_s": 9.0, "load1": 2.0})
    rf.append({"kind": "run", "key": "b", "latency_s": 2.0, "load1": 0.5})
    rf.append({"kind": "run", "key": "c", "latency_s": 3.0})  # from before load1 existed
    assert rf.done() == {"t", "a", "b", "c"}
    assert rf.done(max_load=1.5) == {"t", "b", "c"}
    rf.append({"kind": "run", "key": "a", "latency_s": 1.0, "load1": 0.9})
    assert rf.done(max_load=1.5) == {"t", "a", "b", "c"}
    assert [(r["key"], r["latency_s"]) for r in rf.runs()] == [("a", 1.0), ("b", 2.0),
                                                               ("c", 3.0)]

    # the gate waits for the load to fall, saying so once
    loads, slept, said = iter([3.0, 2.0, 1.4]), [], []
    assert wait_for_quiet(1.5, said.append, load=lambda: next(loads), sleep=slept.append,
                          poll_s=5.0) == 1.4
    assert slept == [5.0, 5.0] and len(said) == 2 and "waiting" in said[0]
    assert wait_for_quiet(0.0, said.append, load=lambda: 9.0) == 9.0  # 0: no gate

    # a run that ends above the gate is kept and taken again, at most RETAKES times
    def retake(ends: list[float], gate: float = 1.5) -> tuple[dict, list[float]]:
        it, rf2 = iter(ends), ResultsFile(tmp_path / str(len(ends)) / str(gate))
        rec = _timed_run(lambda *_: {"kind": "run", "key": "z", "load1": next(it)},
                         _Key("z"), None, None, None, "", gate, rf2, said.append,
                         load=lambda: 0.1)
        return rec, [r["load1"] for r in rf2.records()]

    assert retake([2.5, 0.4]) == ({"kind": "run", "key": "z", "load1": 0.4,
                                   "load1_before": 0.1}, [2.5])
    bounded = [2.5 + i for i in range(RETAKES + 1)]
    rec, kept = retake(bounded)
    assert rec["load1"] == bounded[-1] and kept == bounded[:-1]  # the caller appends the last
    assert retake([2.5], gate=0.0)[1] == []  # no gate: taken once


def test_the_load_gate_comes_from_the_config_else_the_environment(monkeypatch):
    from sakura.edge.replay.config import DEFAULT_MAX_LOAD, LOAD_ENV, ReplayConfig

    monkeypatch.delenv(LOAD_ENV, raising=False)
    assert ReplayConfig().load_gate == DEFAULT_MAX_LOAD == 1.5
    monkeypatch.setenv(LOAD_ENV, "0")  # what the test suite sets (tests/conftest.py)
    assert ReplayConfig().load_gate == 0.0
    assert ReplayConfig(max_load=2.5).load_gate == 2.5  # the config's own wins
    monkeypatch.setenv(LOAD_ENV, "busy")
    with pytest.raises(ReplayConfigError, match=f"\\${LOAD_ENV} must be a load average"):
        ReplayConfig().validate()


def test_a_resume_on_another_host_is_refused():
    """A resumed template's T is measured again; one that moved by more than HOST_TOLERANCE
    means another host (docs/replay-kernel's T = 0.288 s measured 0.480 s on a host without
    AVX-512): one error line within the load gate, a warning outside it (a loaded host's
    time says nothing about the host), nothing within the tolerance."""
    from sakura.edge.replay.template_setup import HOST_TOLERANCE, check_same_host

    said: list[str] = []
    stored = {"masked_exec_s": 0.288}
    for t in (0.288, 0.32, 0.288 * HOST_TOLERANCE * 0.99, 0.288 / HOST_TOLERANCE / 0.99):
        check_same_host("face", stored, t, True, said.append)
    assert said == []
    for t in (0.480, 0.2):
        with pytest.raises(ReplayConfigError, match="face: .*mix two hosts' timings.*--out"):
            check_same_host("face", stored, t, True, said.append)
    check_same_host("face", stored, 0.480, False, said.append)
    assert len(said) == 1 and said[0].startswith("warning: face:") and "1.67x" in said[0]
    check_same_host("face", {}, 0.480, True, said.append)  # nothing stored to compare with
    assert len(said) == 1


class _Key:
    def __init__(self, key: str) -> None:
        self.key = key


# ---------------------------------------------------------------------------- report


def _run(workload, tid, policy, lat, psnr, network="5g", variant="main", template=None,
         start=0, **extra):
    return {"kind": "run", "key": f"{tid}|{policy}|{network}|{lat}|{variant}|{start}",
            "mode": "matched",
            "template": template or tid, "base_template": tid, "workload": workload,
            "resolution": 64, "token_mask_ratio": 0.2, "network": network,
            "network_type": "5G" if network == "5g" else "LTE", "trace": "t.txt",
            "start_index": start, "start_s": 1.0, "policy": policy, "runtime_policy": policy,
            "variant": variant, "q": 0.5, "pack": policy, "factor": 0.1, "link": "paced",
            "rtt_ms": 30.0, "loss": 0.0, "deadline_s": None,
            "latency_s": lat, "bytes": 1_000_000, "stalls": 1, "stall_s": 0.1,
            "startup_s": 0.01, "exec_s": 0.5, "configs": [], "psnr_exact": psnr, **extra,
            "ssim_exact": 0.9, "psnr_full": 30.0, "ssim_full": 0.8,
            "timeline": {"columns": ["shard", "bytes", "recv_start", "recv_end", "recon_start",
                                     "recon_end", "exec_start", "exec_end", "stall_s"],
                         "rows": [[0, 10, 0.0, 0.1, 0.1, 0.11, 0.11, 0.2, 0.0]]}}


def _template(tid, workload, fp16, sakura):
    return {"kind": "template", "key": f"matched|{tid}|template", "mode": "matched",
            "template": tid, "base_template": tid, "workload": workload, "resolution": 64,
            "token_mask_ratio": 0.2, "masked_exec_s": 0.5, "local_s": 2.0, "fp16_bytes": fp16,
            "factor": 0.1, "scaled_median_mbps": 40.0,
            "storage_bytes": {"fp16": fp16, "sakura": sakura, "intq": fp16, "cachegen": fp16}}


@pytest.fixture
def handmade(tmp_path):
    """Two workloads on 5G with known numbers, plus runs that must not count."""
    rf = ResultsFile(tmp_path / "r")
    rf.append(_template("fa", "face-swap", 30_000_000, 10_000_000))
    rf.append(_template("tb", "try-on", 40_000_000, 10_000_000))
    lat = {"fa": {"sakura": [1, 2, 3, 4, 5], "cachegen": [2, 4, 6, 8, 10],
                  "intq": [1.5, 3, 4.5, 6, 7.5], "local": [10] * 5, "fp16": [50] * 5},
           "tb": {"sakura": [2] * 5, "cachegen": [3] * 5, "intq": [5] * 5, "local": [8] * 5,
                  "fp16": [40] * 5}}
    psnr = {"fa": {"sakura": 40.0, "cachegen": 38.0, "intq": 35.0, "local": 30.0, "fp16": "inf"},
            "tb": {"sakura": 30.0, "cachegen": 20.0, "intq": 31.0, "local": 25.0, "fp16": "inf"}}
    wl = {"fa": "face-swap", "tb": "try-on"}
    for tid, pols in lat.items():
        for p, values in pols.items():
            for v in values:
                rf.append(_run(wl[tid], tid, p, float(v), psnr[tid][p]))
    # not headline: another network, the q ablation, a second resolution
    rf.append(_run("face-swap", "fa", "sakura", 99.0, 1.0, network="lte"))
    rf.append(_run("face-swap", "fa", "sakura-q1", 99.0, 1.0, variant="q1"))
    rf.append(_run("face-swap", "fa", "sakura", 99.0, 1.0, template="fa-32"))
    (tmp_path / "r" / "replay.json").write_text(json.dumps(
        {"config": {"headline_networks": ["5g"], "regime_x": 10, "starts": 5}}))
    return tmp_path / "r"


def test_headline_numbers_from_a_handmade_results_file(handmade):
    rf = ResultsFile(handmade)
    h = headline(rf.runs(), rf.templates(), ["5g"])
    fa, tb = h["per_workload"]["face-swap"], h["per_workload"]["try-on"]
    # numpy linear percentiles: p90 of 1..5 = 4.6, of 2..10 = 9.2, of 1.5..7.5 = 6.9
    assert fa["p90_speedup_vs_cachegen"] == pytest.approx(2.0)
    assert fa["p90_speedup_vs_intq"] == pytest.approx(1.5)
    assert fa["p50_speedup_vs_local"] == pytest.approx(10 / 3)
    assert fa["storage_ratio_vs_fp16"] == pytest.approx(3.0)
    assert fa["psnr_gain_db_vs_intq"] == pytest.approx(5.0)
    assert tb["p90_speedup_vs_cachegen"] == pytest.approx(1.5)
    assert tb["psnr_gain_db_vs_intq"] == pytest.approx(-1.0)
    # median over the two workloads (= their mean)
    assert h["p90_speedup_vs_cachegen"] == pytest.approx(1.75)
    assert h["p90_speedup_vs_intq"] == pytest.approx(2.0)
    assert h["p50_speedup_vs_local"] == pytest.approx((10 / 3 + 4.0) / 2)
    assert h["storage_ratio_vs_fp16"] == pytest.approx(3.5)
    assert h["psnr_gain_db_vs_intq"] == pytest.approx(2.0)
    assert h["psnr_gain_db_vs_cachegen"] == pytest.approx(6.0)
    t = h["targets"]
    assert t["p90_speedup_vs_cachegen"]["pass"] is False
    assert all(t[k]["pass"] for k in t if "." not in k and k != "p90_speedup_vs_cachegen")
    assert h["conditions"]["rtt_ms"] == 30.0 and h["conditions"]["starts_per_cell"] == 1


def test_report_command_writes_report_figures_and_headline_json(handmade, tmp_path):
    assert main(["report", str(handmade), "--json", str(tmp_path / "h.json")]) == 0
    doc = json.loads((tmp_path / "h.json").read_text())
    for key in ("p90_speedup_vs_cachegen", "p90_speedup_vs_intq", "p50_speedup_vs_local",
                "storage_ratio_vs_fp16", "psnr_gain_db_vs_intq", "psnr_gain_db_vs_cachegen"):
        assert key in doc and key in doc["targets"]
    assert doc["storage_ratio_vs_fp16"] == pytest.approx(3.5) and doc["mode"] == "matched"
    md = (handmade / "report.md").read_text()
    assert "Why `p90_speedup_vs_cachegen` is missed" in md
    assert "timeline-p90_speedup_vs_cachegen-try-on.png" in md
    pngs = {p.name for p in (handmade / "figures").glob("*.png")}
    assert "matched-latency-face-swap-5g.png" in pngs and "matched-rate-quality.png" in pngs
    for name in pngs:
        assert f"figures/{name}" in md  # every figure is linked from the report
    assert "**Resolution**" in md and "**Importance exponent q**" in md
    assert doc["failed_runs"] == {"count": 0, "by_policy": {}, "runs": []}
    assert "No run failed." in md
    # the model the replay ran (the shipped weights: the meta names none), from its card
    (name, model), = doc["models"].items()
    assert name == "sakura-mmdit" and model["class"] == "sakura.dit.model.MMDiT"
    assert model["params"] > 0 and model["prompt_accuracy"] >= 3 * model["chance_level"]
    # the headline per network: a row for every family the replay names, replayed or not,
    # with the numbers of the JSON's `networks`, and the CDF panel figure
    assert "matched-latency-by-network.png" in pngs
    rows = {ln.split("|")[1].strip(): ln for ln in md.split("### Per network")[1]
            .split("###")[0].splitlines() if ln.startswith("| ") and "network" not in ln}
    assert set(rows) == set(doc["networks"]) == {"5g", "ucc5g", "lte", "wifi", "mixed"}
    for net, e in doc["networks"].items():
        if e["replayed"]:
            assert f"| {e['runs']} |" in rows[net]
            v = e["p90_speedup_vs_cachegen"]
            assert (f"{v:.2f}" if v is not None else "| –") in rows[net]
        else:
            assert "not replayed" in rows[net]


def test_a_failed_run_is_recorded_retried_and_named_by_the_report(handmade, tmp_path):
    """A run that failed leaves a failure record under a key of its own (a resume retries
    the run); the report names every run still failing and counts none of them, and a run
    taken since its failure is no longer named."""
    from sakura.edge.replay.results import RunKey, failure_record

    rf = ResultsFile(handmade)
    k1 = RunKey("matched", "fa", "5g", "t.txt", 1.0, 7, "fp16")
    k2 = RunKey("matched", "tb", "wifi", "w.txt", 2.0, 3, "sakura")
    rf.append(failure_record(k1, "gave up after 8 attempts", 0.8, 1.0))
    rf.append(failure_record(k2, "first error", 0.8, 2.0))
    rf.append(failure_record(k2, "origin unreachable", 0.9, 3.0))
    assert str(k1) not in rf.done() and str(k2) not in rf.done()  # retried on resume
    assert [(f["run_key"], f["error"]) for f in rf.failures()] == [
        (str(k1), "gave up after 8 attempts"), (str(k2), "origin unreachable")]
    before = len(rf.runs())
    assert main(["report", str(handmade), "--json", str(tmp_path / "h.json")]) == 0
    doc = json.loads((tmp_path / "h.json").read_text())
    assert doc["failed_runs"]["count"] == 2 and doc["failed_runs"]["by_policy"] == {
        "fp16": 1, "sakura": 1}
    md = (handmade / "report.md").read_text()
    assert "**2 run(s) failed**" in md and f"`{k2}`: origin unreachable" in md
    assert len(rf.runs()) == before  # a failure is not a run
    # the run taken again since: only the other one is still failing
    rf.append({**_run("face-swap", "fa", "fp16", 50.0, "inf"), "key": str(k1)})
    assert [f["run_key"] for f in rf.failures()] == [str(k2)]
    assert main(["report", str(handmade), "--json", str(tmp_path / "h.json")]) == 0
    assert json.loads((tmp_path / "h.json").read_text())["failed_runs"]["count"] == 1


def _iso_world(tmp_path, intq_psnr_b=20.0):
    """Workload fa: sakura (1..5 s, 36 dB) and its deadline points d2 (2..6 s, 38.5 dB),
    d3 (3..7 s, 40 dB) against cachegen (2..10 s, 38 dB) and intq (1.5..7.5 s, 35 dB);
    workload tb: no sakura point reaches intq's PSNR (``intq_psnr_b``) when it is high."""
    rf = ResultsFile(tmp_path / "iso")
    for tid, w in (("fa", "face-swap"), ("tb", "try-on")):
        t = _template(tid, w, 30_000_000, 10_000_000)
        t["allocation_quality"] = {"sakura": "psnr_profile", "cachegen": "psnr_profile"}
        rf.append(t)
    fa = {"sakura": ([1, 2, 3, 4, 5], 36.0), "sakura-d2": ([2, 3, 4, 5, 6], 38.5),
          "sakura-d3": ([3, 4, 5, 6, 7], 40.0), "cachegen": ([2, 4, 6, 8, 10], 38.0),
          "intq": ([1.5, 3, 4.5, 6, 7.5], 35.0), "local": ([10] * 5, 30.0),
          "fp16": ([50] * 5, "inf")}
    tb = {"sakura": ([1] * 5, 25.0), "sakura-d2": ([2] * 5, 26.0),
          "cachegen": ([3] * 5, 24.0), "intq": ([4] * 5, intq_psnr_b), "local": ([8] * 5, 25.0),
          "fp16": ([40] * 5, "inf")}
    for tid, w, pols in (("fa", "face-swap", fa), ("tb", "try-on", tb)):
        for p, (lats, psnr) in pols.items():
            for i, v in enumerate(lats):
                extra = {"deadline_s": 1.0} if p.startswith("sakura-d") else {}
                rf.append(_run(w, tid, p, float(v), psnr, start=i, **extra))
    (tmp_path / "iso" / "replay.json").write_text(json.dumps(
        {"config": {"headline_networks": ["5g"], "regime_x": 10, "starts": 5}}))
    return tmp_path / "iso"


def test_iso_quality_iso_latency_conditions_and_allocation_quality(tmp_path):
    rf = ResultsFile(_iso_world(tmp_path))
    h = headline(rf.runs(), rf.templates(), ["5g"])
    fa_q = h["iso_quality"]["per_workload"]["face-swap"]
    # cachegen (38 dB, p90 9.2 s): d2 is the fastest point with >= 38 dB (p90 5.6 s)
    assert fa_q["cachegen"]["point"] == "sakura-d2"
    assert fa_q["cachegen"]["ratio"] == pytest.approx(9.2 / 5.6)
    # intq (35 dB, p90 6.9 s): sakura itself qualifies (36 dB, p90 4.6 s)
    assert fa_q["intq"]["point"] == "sakura" and fa_q["intq"]["ratio"] == pytest.approx(1.5)
    fa_l = h["iso_latency"]["per_workload"]["face-swap"]
    # at cachegen's p90 (9.2 s) d3 (p90 6.6 s, 40 dB) is the best: +2 dB; at intq's 6.9 s too
    assert fa_l["cachegen"]["point"] == "sakura-d3"
    assert fa_l["cachegen"]["gain_db"] == pytest.approx(2.0)
    assert fa_l["intq"]["gain_db"] == pytest.approx(5.0)
    # try-on: every point beats intq's 20 dB; median over the two workloads
    assert h["iso_quality"]["latency_ratio_vs_intq_p90"] == pytest.approx((1.5 + 4.0) / 2)
    assert h["iso_quality"]["latency_ratio_vs_cachegen_p90"] == pytest.approx(
        (9.2 / 5.6 + 3.0) / 2)
    assert h["conditions"]["rtt_ms"] == 30.0 and h["conditions"]["starts_per_cell"] == 5
    assert h["allocation_quality"] == "psnr_profile"
    # the operating points are not systems of their own in the headline ratios
    assert "sakura-d2" not in h["per_workload"]["face-swap"]["n_per_policy"]
    lo, hi = fa_q["cachegen"]["ci95"]
    assert lo <= fa_q["cachegen"]["ratio"] <= hi

    # no sakura point reaches intq's PSNR on try-on: no ratio there, and the target is missed
    rf2 = ResultsFile(_iso_world(tmp_path / "b", intq_psnr_b=30.0))
    h2 = headline(rf2.runs(), rf2.templates(), ["5g"])
    tb_q = h2["iso_quality"]["per_workload"]["try-on"]["intq"]
    assert tb_q["ratio"] is None and tb_q["best_point"] == "sakura-d2"
    assert h2["iso_quality"]["workloads_without_a_point_vs_intq"] == ["try-on"]
    assert h2["targets"]["iso_quality.latency_ratio_vs_intq_p90"]["pass"] is False


def test_report_json_keys_and_the_iso_sentences_follow_the_data(tmp_path):
    d = _iso_world(tmp_path)
    assert main(["report", str(d), "--json", str(tmp_path / "h.json")]) == 0
    doc = json.loads((tmp_path / "h.json").read_text())
    assert doc["conditions"]["rtt_ms"] > 0 and doc["conditions"]["starts_per_cell"] == 5
    assert doc["iso_quality"]["latency_ratio_vs_cachegen_p90"] > 1
    assert doc["iso_quality"]["latency_ratio_vs_intq_p90"] > 1
    assert doc["iso_latency"]["psnr_gain_db_vs_cachegen"] > 0
    assert doc["allocation_quality"] == "psnr_profile"
    md = (d / "report.md").read_text()
    assert "sakura is faster at equal quality" in md
    assert "fp16 | 5 |" in md and "inf (identical)" in md  # identical images said as such
    assert "matched-latency-quality-face-swap.png" in md
    assert "traces scaled x0.1" in md
    # contradicting data: sakura's points now all slower than cachegen at equal quality
    from sakura.edge.replay.sections import _iso_text

    view = {"iso_quality": {"ratio": 0.8, "ci95": [0.7, 0.9], "baseline_psnr_db": 38.0,
                            "baseline_n": 5, "point": "sakura-d3", "point_psnr_db": 38.5,
                            "point_p90_s": 5.0, "point_n": 5, "baseline_p90_s": 4.0},
            "iso_latency": {"gain_db": -1.5, "baseline_p90_s": 4.0, "point": "sakura",
                            "point_p90_s": 3.0, "point_psnr_db": 36.5}}
    q, lat = _iso_text("cachegen", view)
    assert "slower at equal quality" in q and "faster" not in q
    assert "-1.50 dB" in lat and "(worse)" in lat


def test_report_reads_per_network_with_intervals_over_start_points(tmp_path):
    """``networks``: every family the replay names, replayed or not, the files each name
    holds, and for a replayed one its headline with a start-point bootstrap interval that
    holds the point value (starts drawn with replacement, policies kept paired)."""
    from sakura.edge.replay.by_network import REPORT_NETWORKS, by_network, start_point_ci

    root = tmp_path / "traces"
    for rel in ("lumos5g/5g/a_walking.txt", "lumos5g/4g/b.txt", "wifi/c_wifi.csv",
                "wifi/c_cellular.csv"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("1\n")
    rf = ResultsFile(_iso_world(tmp_path))
    nets = by_network(rf.runs(), rf.templates(), str(root))
    assert tuple(nets) == REPORT_NETWORKS == ("5g", "ucc5g", "lte", "wifi", "mixed")
    five = nets["5g"]
    assert five["replayed"] and five["starts_per_cell"] == 5
    assert five["files"]["count"] == 1 and "files" not in five["files"]  # no names copied
    h = headline(rf.runs(), rf.templates(), ["5g"])
    for key, (lo, hi) in five["ci95"].items():
        assert lo <= h[key] <= hi, key
        assert five[key] == h[key]
    assert set(five["ci95"]) == {"p90_speedup_vs_cachegen", "p90_speedup_vs_intq",
                                 "p50_speedup_vs_local"}
    # the Wi-Fi name holds the Wi-Fi file only, not the cellular one beside it
    assert not nets["wifi"]["replayed"] and nets["wifi"]["files"]["count"] == 1
    assert nets["wifi"]["files"]["patterns"] == ["wifi/*_wifi.csv"]
    assert nets["ucc5g"]["files"]["count"] is None  # no such traces here: said, not guessed
    assert nets["mixed"]["files"]["count"] == 2  # the 4G and 5G sets it alternates
    # one start point: no interval
    assert start_point_ci([r for r in rf.runs() if r.get("start_index") == 0]) == {}
    assert start_point_ci(rf.runs()) == start_point_ci(rf.runs())  # seeded


def test_why_sentences_follow_the_numbers_they_cite():
    from sakura.edge.replay.sections import _why

    def world(s_stall, s_exec, s_mb, s_lat, cg_stall=0.0):
        runs = []
        for i in range(5):
            runs.append(_run("face-swap", "fa", "sakura", s_lat + 0.1 * i, 30.0, start=i,
                             stalls=2 if s_stall else 0, stall_s=s_stall, exec_s=s_exec,
                             bytes=int(s_mb * 1e6)))
            runs.append(_run("face-swap", "fa", "cachegen", 1.0 + 0.1 * i, 31.0, start=i,
                             stalls=3 if cg_stall else 0, stall_s=cg_stall, exec_s=0.5,
                             bytes=2_000_000))
        return runs

    # slower, but with no stalls and fewer bytes: the text must not blame stalls or bytes
    text = _why("p90_speedup_vs_cachegen", "face-swap", world(0.0, 0.9, 1.0, 1.5), [])
    assert "sakura is slower at p90" in text and "execution took longer" in text
    assert "stalled longer" not in text and "more bytes" not in text
    # contradicting data: the same claim now rests on stalls
    text = _why("p90_speedup_vs_cachegen", "face-swap", world(0.6, 0.5, 1.0, 1.5), [])
    assert "stalled longer (0.60 vs 0.00 s" in text and "execution took longer" not in text
    # slower with nothing worse on mean: says so, with the numbers, and blames nothing
    text = _why("p90_speedup_vs_cachegen", "face-swap", world(0.0, 0.5, 1.0, 1.5), [])
    assert "none of its means is worse by more than 5%" in text
    assert "1.00 vs 2.00 MB" in text and "stalled longer" not in text
    # and when sakura is faster, it says so
    text = _why("p90_speedup_vs_cachegen", "face-swap", world(0.0, 0.5, 1.0, 0.8), [])
    assert "sakura is faster at p90" in text and "slower" not in text
    # faster where CacheGen stalls: smaller transfers are credited only when they are smaller
    text = _why("p90_speedup_vs_cachegen", "face-swap", world(0.0, 0.5, 1.0, 0.8, 0.4), [])
    assert "smaller transfers (1.00 vs 2.00 MB)" in text
    text = _why("p90_speedup_vs_cachegen", "face-swap", world(0.0, 0.5, 3.0, 0.8, 0.4), [])
    assert "smaller" not in text and "not the transfer size" in text
    # PSNR miss: who moved more bytes decides the sentence
    text = _why("psnr_gain_db_vs_cachegen", "face-swap", world(0.0, 0.5, 1.0, 0.8), [])
    assert "cachegen streamed more bytes" in text
    text = _why("psnr_gain_db_vs_cachegen", "face-swap", world(0.0, 0.5, 3.0, 0.8), [])
    assert "sakura moved as many bytes or more" in text


# ---------------------------------------------------------------------------- replay


def test_replay_end_to_end_over_real_http_and_resume(tiny_catalog, tmp_path):
    from sakura.edge.replay.runner import run_replay

    root, tid = tiny_catalog
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(
        f"workloads: {{face-swap: [{tid}]}}\nnetworks: [5g]\n"
        "policies: [local, fp16, sakura]\nstarts: 2\ndeadlines: [3.0]\n"
        "ablation: {q: [1.0], resolutions: [], resolution_templates: []}\n"
        f"weights: {root / 'model.safetensors'}\ncatalog: {root / 'catalog.json'}\n"
        f"packs_dir: {root / 'packs'}\n{ONE_BLOCK_SHARDS}")
    cfg = load_config(cfg_path)
    out = tmp_path / "out"
    logs: list[str] = []
    s = run_replay(cfg, out, log=logs.append, progress=False)
    # 2 starts x (3 policies + q = 1 + the deadline point)
    assert s == {"planned": 10, "skipped": 0, "ran": 10}
    fp16_manifest = root / "packs" / "main" / "templates" / tid / "fp16" / "manifest.json"
    assert json.loads(fp16_manifest.read_text())["geometry"]["blocks_per_shard"] == 1
    rf = ResultsFile(out)
    runs = rf.runs()
    assert {r["policy"] for r in runs} == {"local", "fp16", "sakura", "sakura-q1", "sakura-d3"}
    # every record states the link's round trip, loss and the CPUs; the link ran elsewhere
    assert {(r["rtt_ms"], r["loss"]) for r in runs} == {(30.0, 0.0)}
    assert all(r["link"] == "paced" and "cpus" in r for r in runs)
    point = next(r for r in runs if r["policy"] == "sakura-d3")
    t0 = next(iter(rf.templates().values()))
    # rtt_scale: matched: the link carries 30 ms x T / the phone's masked execution time
    from sakura.edge.replay.profile import DeviceProfile

    phone = DeviceProfile(**vars(cfg.profile)).masked_total_s(t0["token_mask_ratio"])
    assert all(r["link_rtt_ms"] == pytest.approx(30.0 * t0["masked_exec_s"] / phone)
               for r in runs) and t0["link_rtt_ms"] < 30.0
    assert {r["rtt_scale"] for r in runs} == {"matched"}
    assert point["deadline_s"] == pytest.approx(3.0 * t0["masked_exec_s"])
    assert point["runtime_policy"] == "sakura" and point["pack"] == "sakura"
    t = next(iter(rf.templates().values()))
    assert t["factor"] > 0 and t["masked_exec_s"] > 0 and t["storage_bytes"]["fp16"] > 0
    # regime: FP16 at the scaled pooled 5G median takes regime_x x T
    fp16_s = t["fp16_bytes"] * 8 / (t["scaled_median_mbps"] * 1e6)
    assert fp16_s == pytest.approx(10 * t["masked_exec_s"])
    by = {(r["policy"], r["start_index"]): r for r in runs}
    assert by[("fp16", 0)]["psnr_exact"] == "inf" and by[("fp16", 0)]["bytes"] == t["fp16_bytes"]
    assert by[("local", 0)]["psnr_full"] == "inf" and by[("local", 0)]["bytes"] == 0
    # streamed below fp16's bytes, or computed on the device: at 3 steps of 32 px the whole
    # edit can run locally before a loaded host's first byte (a clean-clone CI run saw
    # 0 bytes with every step local), or the stale plan may recompute step 0 and run the
    # others stale on its K/V (planned recompute); then the record says so
    s0 = by[("sakura", 0)]
    assert 0 <= s0["bytes"] < t["fp16_bytes"]
    assert s0["bytes"] > 0 or s0["local_fallbacks"] + s0["stale_steps"] == t["steps"], s0
    assert by[("sakura-q1", 1)]["q"] == 1.0 and by[("sakura", 1)]["q"] is None
    # the q = 1 pack is pinned at q = 1; main's chooses q per shard (a q<q> pack that chose
    # per shard made main's choices, shard for shard: the ablation measured nothing)
    def sakura_options(variant: str) -> dict:
        m = root / "packs" / variant / "templates" / tid / "sakura" / "manifest.json"
        return json.loads(m.read_text())["codec_options"]
    pinned, chosen = sakura_options("q1"), sakura_options("main")
    assert pinned["q"] == 1.0 and "q_candidates" not in pinned
    assert chosen.get("q_candidates"), chosen
    assert by[("sakura", 0)]["timeline"]["rows"]
    assert {r["trace"] for r in runs} <= {p.name for p in Path(
        __import__("sakura.traces", fromlist=["x"]).require_trace_dir()).glob("lumos5g/5g/*.txt")}
    # resume: nothing left to do; a lost last run is redone, nothing else
    assert run_replay(cfg, out, log=logs.append, progress=False)["ran"] == 0
    lines = rf.path.read_bytes().splitlines(keepends=True)
    rf.path.write_bytes(b"".join(lines[:-1]) + lines[-1][:20])  # killed mid-write
    again = run_replay(cfg, out, log=logs.append, progress=False)
    assert again == {"planned": 10, "skipped": 9, "ran": 1}
    assert len(rf.runs()) == 10
    report = write_report(out, json_path=out / "h.json")
    assert "the `sakura-q*` packs are pinned at their q" in report.read_text()
    assert json.loads((out / "h.json").read_text())["storage_ratio_vs_fp16"] > 1
    assert not math.isnan(json.loads((out / "h.json").read_text())["p50_speedup_vs_local"])


def test_profile_regime_simulates_time_and_measures_quality(tiny_catalog, tmp_path):
    from sakura.edge.replay.runner import run_replay

    root, tid = tiny_catalog
    cfg_path = tmp_path / "p.yaml"
    cfg_path.write_text(
        f"workloads: {{face-swap: [{tid}]}}\nnetworks: [5g]\nregime: profile\n"
        "policies: [local, fp16, sakura]\nstarts: 1\ndeadlines: [2.0]\n"
        "ablation: {q: [], resolutions: [], resolution_templates: []}\n"
        f"weights: {root / 'model.safetensors'}\ncatalog: {root / 'catalog.json'}\n"
        f"packs_dir: {root / 'packs'}\n{ONE_BLOCK_SHARDS}")
    out = tmp_path / "out"
    assert run_replay(load_config(cfg_path), out, log=lambda m: None, progress=False)["ran"] == 4
    rf = ResultsFile(out)
    t = next(iter(rf.templates().values()))
    assert t["mode"] == "profile" and t["factor"] == 1.0
    by = {r["policy"]: r for r in rf.runs()}
    assert by["local"]["latency_s"] == 13.0 and by["local"]["profile"]
    gib = 1.46 * (1 << 30)
    assert by["fp16"]["bytes"] == pytest.approx(gib, rel=1e-3)  # scaled to the phone's cache
    assert by["fp16"]["real_bytes"] == t["fp16_bytes"] and by["fp16"]["psnr_exact"] == "inf"
    # execution alone: the line through (10%, 2.3 s) and (100%, 13 s); transfers only add
    # (fp16 plans nothing stale; sakura's steps planned local take a local step each,
    # 13 s / steps, instead of their shards' share: tests/edge/test_profile_sim.py)
    masked = 2.3 + (13.0 - 2.3) * (t["token_mask_ratio"] - 0.10) / 0.90
    assert by["fp16"]["exec_s"] == pytest.approx(masked)
    assert by["fp16"]["planned_stale"] == by["fp16"]["planned_local"] == 0
    s = by["sakura"]
    assert s["latency_s"] >= s["exec_s"] and s["bytes"] < by["fp16"]["bytes"]
    if s["planned_local"] == 0:
        assert s["exec_s"] == pytest.approx(masked)
    assert s["configs"].count(None) == s["planned_stale"] + s["planned_local"]
    assert by["sakura"]["psnr_exact"] is not None and by["sakura"]["ssim_full"] is not None
    # the modelled link says so; the deadline point is given 2 x the modelled execution
    assert by["sakura"]["link"] == "modelled" and by["sakura"]["rtt_ms"] == pytest.approx(20.0)
    assert by["sakura-d2"]["deadline_s"] == pytest.approx(2 * masked)
    assert by["sakura-d2"]["latency_s"] >= masked
    assert "device profile" in json.dumps(
        __import__("sakura.edge.replay.report", fromlist=["x"]).headlines(
            rf.runs(), rf.templates(), {})["regime"])


def test_kernel_link_replay_or_clear_fallback(tiny_catalog, tmp_path):
    """``link: kernel``: the timed edits go through a tbf-shaped veth between two network
    namespaces (root); without kernel shaping the replay says why and uses the paced link."""
    from sakura.edge.replay.runner import run_replay
    from sakura.traces.netns import kernel_shaping_unavailable_reason

    root, tid = tiny_catalog
    cfg_path = tmp_path / "k.yaml"
    cfg_path.write_text(
        f"workloads: {{face-swap: [{tid}]}}\nnetworks: [5g]\nlink: kernel\n"
        "policies: [sakura, fp16]\nstarts: 1\ndeadlines: []\n"
        "ablation: {q: [], resolutions: [], resolution_templates: []}\n"
        f"weights: {root / 'model.safetensors'}\ncatalog: {root / 'catalog.json'}\n"
        f"packs_dir: {root / 'packs'}\n{ONE_BLOCK_SHARDS}")
    logs: list[str] = []
    out = tmp_path / "out"
    assert run_replay(load_config(cfg_path), out, log=logs.append, progress=False)["ran"] == 2
    runs = ResultsFile(out).runs()
    reason = kernel_shaping_unavailable_reason()
    if reason is None:
        assert {r["link"] for r in runs} == {"kernel"}
    else:
        assert {r["link"] for r in runs} == {"paced"}
        assert any("falling back to the paced link" in m for m in logs)
    fp16 = next(r for r in runs if r["policy"] == "fp16")
    assert fp16["psnr_exact"] == "inf" and fp16["bytes"] > 0
    # the kernel link carries the round trip too (its delay stage in front of tbf)
    assert {r["rtt_ms"] for r in runs} == {30.0}


@pytest.mark.slow
def test_parallel_pack_builds(tiny_catalog, tmp_path):
    """``build_workers: 2``: the main and q packs built in two processes (untimed)."""
    from sakura.edge.replay.packs import BuildJob, build_all

    root, tid = tiny_catalog
    jobs = [BuildJob(str(tmp_path / "main"), (tid,), str(root / "model.safetensors"),
                     str(root / "catalog.json"), codecs=("sakura", "fp16")),
            BuildJob(str(tmp_path / "q1"), (tid,), str(root / "model.safetensors"),
                     str(root / "catalog.json"), codecs=("sakura",), q=1.0)]
    build_all(jobs, workers=2, log=lambda m: None)
    for name, codecs in (("main", {"sakura", "fp16"}), ("q1", {"sakura"})):
        doc = json.loads((tmp_path / name / "catalog.json").read_text())
        assert set(doc["templates"][tid]["codecs"]) == codecs
    q1 = json.loads(next((tmp_path / "q1" / "templates" / tid / "sakura").glob(
        "*.manifest.json")).read_text())
    assert q1["codec_options"]["q"] == 1.0


def test_allocation_quality_of_a_manifest():
    from sakura.edge.replay.template_setup import allocation_quality_of

    def m(*psnrs):
        return {"shards": [{"configs": [{"quality": {"psnr_db": p, "kv_db": 20.0}}
                                        for p in psnrs]}]}

    assert allocation_quality_of(m(30.0, 40.0)) == "psnr_profile"
    assert allocation_quality_of(m(30.0, None)) == "kv_error"
    assert allocation_quality_of({"shards": []}) == "kv_error"


def test_report_models_say_when_the_weights_are_gone_or_changed(tmp_path):
    from sakura.edge.replay.report import replay_models

    gone = replay_models({"config": {"weights": str(tmp_path / "w.safetensors")},
                          "weights_sha256": "ab" * 32})
    assert gone == {"w": {"weights_file_sha256": "ab" * 32,
                          "source": f"model weights not found at {tmp_path / 'w.safetensors'}"}}
    changed = replay_models({"config": {}, "weights_sha256": "cd" * 32})
    (entry,) = changed.values()
    assert "prompt_accuracy" not in entry and "other weights" in entry["source"]


@pytest.mark.parametrize("extra, message", [
    ("models: [sakura-flux2]\nmodel: sakura-flux2\nruntime: python\n", "sets model instead"),
    ("models: [no-such-model]\n", "unknown model 'no-such-model'"),
    ("models: [sakura-flux2, sakura-flux2]\n", "lists a model twice"),
    ("models: [sakura-flux2]\nregime: profile\n", "matched regime only"),
])
def test_models_config_errors(tmp_path, extra, message):
    path = tmp_path / "c.yaml"
    path.write_text(extra)
    with pytest.raises(ReplayConfigError, match=message):
        load_config(path).validate()


def test_a_replay_stopped_by_sigterm_leaves_no_server_behind(tiny_catalog, tmp_path):
    """`kill` (or a supervisor's stop) of a running replay: one line, exit 143, and its
    `sakura serve` children and links are gone (they outlived it: SIGTERM ended Python
    without running its `with` blocks); what it finished stays for the resume."""
    import signal
    import subprocess
    import sys
    import time

    root, tid = tiny_catalog
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(
        f"workloads: {{face-swap: [{tid}]}}\nnetworks: [5g]\npolicies: [fp16, sakura]\n"
        "starts: 50\ndeadlines: []\nmax_load: 0\n"
        "ablation: {q: [], resolutions: [], resolution_templates: []}\n"
        f"weights: {root / 'model.safetensors'}\ncatalog: {root / 'catalog.json'}\n"
        f"packs_dir: {root / 'packs'}\n{ONE_BLOCK_SHARDS}")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "sakura.cli", "replay", str(cfg_path),
                             "--out", str(out), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    try:
        deadline = time.monotonic() + 300
        rf = ResultsFile(out)
        while not rf.runs() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)  # a run finished: its servers are up
        kids = children_of(proc.pid)
        assert rf.runs() and kids, "the replay did not reach its runs"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err.decode()[-2000:]
    assert err.decode().strip().splitlines()[-1] == "sakura: terminated"
    time.sleep(1.0)
    assert [k for k in kids if alive(k)] == []
    assert len(ResultsFile(out).runs()) >= 1  # kept for the resume


def test_a_fault_of_the_kernel_link_during_a_run_fails_that_run(tmp_path, monkeypatch):
    """A run during which the emulator faulted (here a `tc replace` that fails as the run's
    link restarts) measured the emulator: it raises LinkError naming the fault, chained to
    the run's own error when it had one, so the replay records a failure and a rerun
    retries it. Without a fault the run's own error passes through unchanged."""
    import subprocess

    import sakura.traces.netns as netns
    from sakura.edge.errors import EdgeError
    from sakura.edge.replay.links import Links
    from sakura.traces import Trace
    from sakura.traces.errors import LinkError

    reason = netns.kernel_shaping_unavailable_reason()
    if reason is not None:
        pytest.skip(f"kernel shaping: {reason}")
    real = netns.run_cmd
    failing = []

    def run_cmd(cmd, *args, **kwargs):
        if failing and "replace" in cmd:
            return subprocess.CompletedProcess(cmd, 2, "", "RTNETLINK answers: No buffer")
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(netns, "run_cmd", run_cmd)
    links = Links(default_config(), tmp_path, ["main"], lambda line: None)
    trace = Trace.constant(10e6, 5.0)
    with netns.KernelShapedLink(trace) as link:
        links.links["main"], links.urls["main"] = link, "http://unused"
        with links.watched("main"):
            links.shaped("main", trace, 0.0)  # healthy: nothing raised
        with pytest.raises(EdgeError, match="without progress") as own:
            with links.watched("main"):
                raise EdgeError("8 attempts and 33 s without progress")
        assert not isinstance(own.value, LinkError)
        failing.append(True)
        with pytest.raises(LinkError, match="the emulated link failed during this run: tc "
                                            "replace failed: RTNETLINK answers: No buffer"):
            with links.watched("main"):
                links.shaped("main", trace, 0.0)
        with pytest.raises(LinkError, match="tc replace failed") as chained:
            with links.watched("main"):
                links.shaped("main", trace, 0.0)
                raise EdgeError("8 attempts and 33 s without progress")
        assert isinstance(chained.value.__cause__, EdgeError)
        assert link.faults == 2


def test_the_q_table_dates_its_records(tmp_path):
    """The q ablation's wording and labels follow the records' times: `sakura-q*` records
    from before the packs were pinned are called out (they measured the default codec), and
    the default `sakura`, recorded as q = 0.5 while its packs chose q per shard, is labelled
    per shard from the per-shard builds on."""
    from sakura.edge.replay.sections import Q_PER_SHARD_SINCE, Q_PINNED_SINCE, _ablations

    def table(q_time, default_time):
        runs = [_run("face-swap", "fa", "sakura-q1", 1.0, 40.0, variant="q1", q=1.0,
                     time=q_time),
                _run("face-swap", "fa", "sakura", 1.0, 40.0, time=default_time)]
        return "\n".join(_ablations("matched", runs, runs[1:], tmp_path, "figures"))

    new = table(Q_PINNED_SINCE + 1, Q_PER_SHARD_SINCE + 1)
    assert "pinned at their q" in new and "predate" not in new
    assert "| per shard | sakura |" in new and "| 1 | sakura-q1 |" in new
    old = table(Q_PINNED_SINCE - 1, Q_PER_SHARD_SINCE - 1)
    assert "predate pinned packs" in old and "pinned at their q" not in old
    assert "| 0.5 | sakura |" in old
