"""The replay of the second model (``model: sakura-flux2``) and of both models in one
config (``models: [sakura-flux2]``), with the report's ``models`` and ``per_model``.

These ride the paced link but assert no rate, stall or time (records, packs, the report's
keys), so they run in the suite's parallel part (tests/conftest.py); test_replay.py keeps
the replays whose assertions are about time.
"""

from __future__ import annotations

import json

import pytest
import torch
from sakura.edge.replay.config import ReplayConfigError, load_config
from sakura.edge.replay.results import ResultsFile


def test_replay_runs_the_second_model(tiny_catalog, tmp_path):
    """``model: sakura-flux2``: the replay builds, streams and edits with the FLUX.2 model
    (here seeded random weights of its config in a folder) in the MMDiT's form; the
    report's ``models`` names it by its card (its diffusers class). It may run on the native
    runtime (its compiled graphs: tests/edge/test_model_roundtrip.py; here the Python one,
    seconds instead of minutes of graph export); a config asking the native runtime for an
    adapter model without that form is one clear error."""
    from sakura.dit.flux2_pixel import PixelFlux2, save_flux2
    from sakura.edge.replay.report import headlines, load
    from sakura.edge.replay.runner import run_replay

    root, tid = tiny_catalog
    torch.manual_seed(0)
    ck = tmp_path / "sakura-flux2"
    save_flux2(PixelFlux2(), ck, {"train_step": "3"})
    text = (f"workloads: {{face-swap: [{tid}]}}\nnetworks: [5g]\n"
            "policies: [local, fp16, sakura, cachegen]\nstarts: 1\ndeadlines: []\n"
            "ablation: {q: [], resolutions: [], resolution_templates: []}\n"
            f"model: sakura-flux2\nmodel_path: {ck}\ncatalog: {root / 'catalog.json'}\n"
            f"packs_dir: {tmp_path / 'packs'}\n")
    bad = tmp_path / "native.yaml"
    bad.write_text(text.replace("model: sakura-flux2", "model: flux2"))
    with pytest.raises(ReplayConfigError, match="runs on the python runtime"):
        load_config(bad).validate()
    native = tmp_path / "flux2-native.yaml"
    native.write_text(text)
    assert load_config(native).validate().runtime == "native"
    cfg_path = tmp_path / "flux2.yaml"
    cfg_path.write_text(text + "runtime: python\n")
    out = tmp_path / "out"
    s = run_replay(load_config(cfg_path), out, log=lambda m: None, progress=False)
    assert s == {"planned": 4, "skipped": 0, "ran": 4}
    runs = ResultsFile(out).runs()
    by = {r["policy"]: r for r in runs}
    assert by["fp16"]["psnr_exact"] == "inf" and by["local"]["bytes"] == 0
    assert 0 <= by["sakura"]["bytes"] < by["fp16"]["bytes"]
    manifest = json.loads((tmp_path / "packs" / "main" / "templates" / tid / "fp16" /
                           "manifest.json").read_text())
    assert manifest["model"]["name"] == "sakura-flux2"
    runs_, tmpl, meta = load(out)
    models = headlines(runs_, tmpl, meta)["models"]
    assert list(models) == ["sakura-flux2"]
    card = models["sakura-flux2"]
    assert card["class"] == "diffusers.Flux2Transformer2DModel" and card["train_step"] == 3
    assert card["weights_fingerprint"] == meta["weights_sha256"]


def test_one_replay_of_two_models_and_its_report(tiny_catalog, tmp_path):
    """``models: [sakura-flux2]``: after the MMDiT, the same runs of the second model (its
    shipped weights) land in ``<out>/sakura-flux2``; the report's ``models`` names both
    classes and ``per_model`` holds each one's headline; a rerun resumes both."""
    from sakura.edge.replay.report import write_report
    from sakura.edge.replay.runner import run_replay

    root, tid = tiny_catalog
    cfg_path = tmp_path / "two.yaml"
    cfg_path.write_text(
        f"workloads: {{face-swap: [{tid}]}}\nnetworks: [5g]\npolicies: [local, fp16, sakura]\n"
        "starts: 1\ndeadlines: []\nablation: {q: [], resolutions: [], "
        "resolution_templates: []}\nmodels: [sakura-flux2]\nruntime: python\n"
        f"weights: {root / 'model.safetensors'}\ncatalog: {root / 'catalog.json'}\n"
        f"packs_dir: {tmp_path / 'packs'}\n")
    out = tmp_path / "out"
    cfg = load_config(cfg_path)
    assert run_replay(cfg, out, log=lambda m: None, progress=False) == {
        "planned": 6, "skipped": 0, "ran": 6}
    for folder in (out, out / "sakura-flux2"):
        assert {r["policy"] for r in ResultsFile(folder).runs()} == {"local", "fp16", "sakura"}
    assert (tmp_path / "packs" / "sakura-flux2" / "main" / "catalog.json").exists()
    assert run_replay(cfg, out, log=lambda m: None, progress=False) == {
        "planned": 6, "skipped": 6, "ran": 0}

    doc = tmp_path / "h.json"
    report = write_report(out, json_path=doc).read_text()
    head = json.loads(doc.read_text())
    assert list(head["models"]) == ["model", "sakura-flux2"]
    assert head["models"]["sakura-flux2"]["class"] == "diffusers.Flux2Transformer2DModel"
    assert head["models"]["sakura-flux2"]["prompt_accuracy"] > 0.5
    assert set(head["per_model"]) == {"model", "sakura-flux2"}
    for h in head["per_model"].values():
        assert h["runs"] == 3 and set(h["networks"]) >= {"5g"}
        assert "p50_speedup_vs_local" in h and "modes" not in h
    assert head["per_model"]["model"]["p50_speedup_vs_local"] == head["p50_speedup_vs_local"]
    assert "# Model sakura-flux2" in report and "Models: `model`" in report
    assert (out / "figures" / "sakura-flux2").is_dir()
