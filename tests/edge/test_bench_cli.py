"""``sakura bench edit`` (regime matching, keys) on the tiny world, and ``sakura edit``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.edge.bench import BenchSpec, bench_edit
from sakura.edge.errors import EdgeError
from sakura.edge.netem import trace_from_args

from sakura.cli import main
from tests.dit.common import text_width_model
from tests.edge.helpers import TEMPLATE_ID, Server


def lumos_trace(path: Path, rates_mbps: list[float]) -> Path:
    path.write_text("".join(f"{i}\t{r}\n" for i, r in enumerate(rates_mbps)))
    return path


def test_bench_edit_runs_every_policy_regime_matched(world, tmp_path):
    trace = lumos_trace(tmp_path / "t.txt", [100, 300, 200, 50, 200, 400, 200, 0, 200] * 8)
    rt = world.runtime()
    req = rt.request("bench prompt", 100)
    policies = ("local", "fp16", "intq", "cachegen", "svd", "sakura", "sakura-fixed-config",
                "sakura-fixed-bits")
    spec = BenchSpec(json_path=tmp_path / "b.json", quick=True, trace=str(trace), start_s=2.0,
                     policies=policies, plots=tmp_path / "plots", log=lambda m: None)
    with Server(create_app(LocalStorage(world.catalog_dir))) as server:
        doc = bench_edit(spec, rt, TEMPLATE_ID, world.template, req, "bench prompt",
                         server.url)
    for key in ("latency_s", "bytes", "psnr_db", "stalls", "ssim"):
        assert set(doc[key]) == set(policies), key
    regime = doc["regime"]
    assert regime["mode"] == "regime-matched" and doc["compute_bound_s"] > 0
    assert regime["raw_median_mbps"] == pytest.approx(200.0)
    # the FP16 cache at the scaled median takes regime_x times the masked execution time
    assert regime["fp16_at_median_s"] == pytest.approx(10 * doc["compute_bound_s"])
    assert regime["scaled_median_mbps"] == pytest.approx(200.0 * regime["factor"])
    assert regime["fp16_bytes"] == world.cache.fp16_bytes()
    assert doc["psnr_db"]["fp16"] == "inf"
    assert doc["bytes"]["fp16"] == world.cache.fp16_bytes()
    assert doc["bytes"]["local"] == 0
    assert doc["bytes"]["sakura"] < doc["bytes"]["fp16"]
    assert doc["latency_s"]["fp16"] > doc["compute_bound_s"]
    assert set(doc["device_state"]["manifest_bytes"]) == {"fp16", "intq", "cachegen", "svd",
                                                          "sakura"}
    assert len(list((tmp_path / "plots").glob("*.png"))) == len(policies) - 1
    assert doc["vs_full"]["psnr_db"]["local"] == "inf"
    assert doc["packs"]["sakura-fixed-bits"] in ("sakura", "sakura-all")
    json.dumps(doc)  # serialisable as is


def test_trace_arguments(tmp_path):
    assert trace_from_args(None, None) is None
    assert trace_from_args(None, 20.0, scale=0.5).rate_at(3.0) == pytest.approx(10e6)
    with pytest.raises(EdgeError, match="either --trace or --rate"):
        trace_from_args("x", 1.0)
    with pytest.raises(EdgeError, match="does not exist"):
        trace_from_args(str(tmp_path / "missing.txt"), None)
    t = trace_from_args(str(lumos_trace(tmp_path / "t.txt", [10, 20])), None, scale=2)
    assert t.rate_at(1.5) == pytest.approx(40e6)


@pytest.fixture(scope="module")
def text_world(tmp_path_factory, text_encoder):
    """A small model with the real text encoder's width, a 32-pixel catalog template built
    from a shipped one, and its packs: what `sakura edit` needs."""
    from sakura.cloud.build import BuildConfig, build
    from sakura.dit.templates import DEFAULT_CATALOG
    from sakura.dit.weights import save_model

    root = tmp_path_factory.mktemp("text-world")
    model = text_width_model()
    save_model(model, root / "model.safetensors")
    entries = json.loads(DEFAULT_CATALOG.read_text())["templates"]
    tid, entry = next(iter(entries.items()))
    entry = {**entry, "image": str(DEFAULT_CATALOG.parent / entry["image"]),
             "mask": str(DEFAULT_CATALOG.parent / entry["mask"]), "steps": 3,
             "resolution": 32}
    entry["profiling_prompts"] = entry["profiling_prompts"][:1]
    (root / "catalog.json").write_text(json.dumps({"version": 1, "templates": {tid: entry}}))
    build(BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(root / "packs"),
                      codecs=("sakura", "fp16"), weights=str(root / "model.safetensors")),
          log=lambda m: None)
    return root, tid


def test_sakura_edit_writes_image_timeline_and_plot(text_world, tmp_path, capsys):
    root, tid = text_world
    ref = tmp_path / "ref.png"
    from skimage.io import imsave

    imsave(ref, (torch.rand(20, 20, 3) * 255).byte().numpy(), check_contrast=False)
    out = tmp_path / "edit.png"
    with Server(create_app(LocalStorage(root / "packs"))) as server:
        code = main(["edit", "--server", server.url, "--template", tid, "--prompt",
                     "a tiny pirate hat", "--reference", str(ref), "--seed", "3",
                     "--rate", "20", "--out", str(out), "--weights",
                     str(root / "model.safetensors"), "--compare-exact",
                     "--state-dir", str(tmp_path / "state"),
                     "--json", str(tmp_path / "result.json")])
    assert code == 0
    printed = capsys.readouterr().out
    for word in ("latency", "bytes", "stalls", "configs", "PSNR", "SSIM"):
        assert word in printed
    from skimage.io import imread

    assert imread(out).shape == (32, 32, 3)
    doc = json.loads((tmp_path / "edit.timeline.json").read_text())
    assert json.loads((tmp_path / "result.json").read_text()) == doc  # --json PATH
    assert doc["policy"] == "sakura" and doc["link"]["mode"] == "paced"
    assert len(doc["timeline"]) == 3 * 1  # 3 steps x 1 shard
    # every shard fetched in its own request, but those the stale plan ran on their
    # group's last K/V (edge/stale_plan.py)
    assert doc["requests"] - 1 == 3 - doc["planned_stale"] - doc["planned_local"]
    assert doc["planned_stale"] == sum(r["planned_stale"] for r in doc["timeline"])
    assert doc["psnr_db"] is not None and doc["ssim"] is not None
    assert doc["prompt_tokens_kept"] == doc["prompt_tokens_total"] == 6  # CLS 4 words SEP
    assert (tmp_path / "edit.timeline.png").stat().st_size > 1000
    assert doc["warnings"] == []  # the packs were built with these very weights
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["rates"] and all(r["rate_bps"] > 0 for r in state["rates"].values())
    assert len(state["profiles"]) == 1
    assert sorted(state["manifests"]) == [f"{tid}.fp16.json", f"{tid}.sakura.json"]


def test_a_long_prompt_is_truncated_and_says_so(text_world, tmp_path, capsys):
    """The encoder keeps 16 tokens (CLS and SEP included): the result JSON and one warning
    line say how many were kept; the timeline JSON records the set-up phases (issue 29)."""
    root, tid = text_world
    out = tmp_path / "long.png"
    prompt = " ".join(["pirate"] * 30)  # 30 word tokens + CLS + SEP
    with Server(create_app(LocalStorage(root / "packs"))) as server:
        code = main(["edit", "--server", server.url, "--template", tid, "--prompt", prompt,
                     "--out", str(out), "--weights", str(root / "model.safetensors"),
                     "--no-state", "--runtime", "python"])
    assert code == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [ln for ln in err if ln.startswith("sakura: warning:")]
    assert warnings == ["sakura: warning: the prompt is 32 tokens; the text encoder's window "
                        "keeps the first 16 (with CLS and SEP) and drops the other 16"]
    doc = json.loads((tmp_path / "long.timeline.json").read_text())
    assert (doc["prompt_tokens_kept"], doc["prompt_tokens_total"],
            doc["prompt_tokens_window"]) == (16, 32, 16)
    assert [p["phase"] for p in doc["phases"]][:3] in (["open", "manifest", "plan"],
                                                       ["manifest", "plan",
                                                        "startup allowance"])
    assert (tmp_path / "long.timeline.png").stat().st_size > 1000


def test_sakura_edit_local_policy_with_a_local_catalog(text_world, tmp_path, capsys):
    root, tid = text_world
    out = tmp_path / "local.png"
    with Server(create_app(LocalStorage(root / "packs"))) as server:
        code = main(["edit", "--server", server.url, "--template", tid, "--prompt", "hat",
                     "--policy", "local", "--out", str(out), "--weights",
                     str(root / "model.safetensors"), "--catalog", str(root / "catalog.json"),
                     "--no-state"])
    assert code == 0
    doc = json.loads((tmp_path / "local.timeline.json").read_text())
    assert doc["policy"] == "local" and doc["bytes"] == 0 and doc["timeline"] == []
    assert not (tmp_path / "local.timeline.png").exists()


def test_sakura_edit_reports_an_unreachable_server(text_world, tmp_path, capsys):
    """Refused connections are retried, one line each, until --retry-window passes without
    progress (default 30 s, a `sakura serve` restart); then one error line."""
    from tests.edge.helpers import free_port

    root, tid = text_world
    t0 = time.monotonic()
    code = main(["edit", "--server", f"http://127.0.0.1:{free_port()}", "--template", tid,
                 "--prompt", "x", "--out", str(tmp_path / "x.png"), "--weights",
                 str(root / "model.safetensors"), "--no-state", "--retry-window", "1.5"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(
        "sakura: error: cannot reach the SAKURA server")
    assert "sakura: " in err.strip().splitlines()[0]  # the retries were said
    assert len(err.strip().splitlines()) >= 2
    assert time.monotonic() - t0 >= 1.5  # it waited the window, and no shorter
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("value", ["-0.5", "1.5", "nan"])
def test_sakura_edit_refuses_a_bad_startup_fraction(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as info:  # a usage error, before anything loads
        main(["edit", "--server", "http://127.0.0.1:9", "--template", "t", "--prompt",
              "x", "--out", str(tmp_path / "x.png"), "--no-state",
              "--startup-fraction", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("sakura edit: error: argument --startup-fraction: startup_fraction must be a "
            "number in [0, 1]") in err
    assert "Traceback" not in err


def test_run_edit_resolves_model_template_and_link(text_world):
    from sakura.edge.runtime import run_edit

    root, tid = text_world
    with Server(create_app(LocalStorage(root / "packs"))) as server:
        res = run_edit(server.url, tid, "a tiny pirate hat", "sakura", seed=3, rate_mbps=20,
                       weights=root / "model.safetensors", compare_exact=True)
    assert res.policy == "sakura" and len(res.timeline) == 3
    assert res.psnr_db is not None and res.ssim is not None and res.warnings == []
