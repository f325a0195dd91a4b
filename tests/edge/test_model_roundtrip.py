"""`--model/--model-path`: a diffusers checkpoint folder through the whole product path.

`sakura build --model M --model-path DIR` -> `sakura serve` (a real HTTP server process) ->
`sakura edit --model M --model-path DIR`, on tiny seeded pipelines written with
`save_pretrained` (FLUX.2-klein with its Qwen3 text encoder, SD3.5 with two CLIP encoders),
loaded exactly as a real checkpoint would be.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from sakura.cloud.build import BuildConfig, build
from sakura.dit.adapters.engine import checkpoint_fingerprint, load_engine
from sakura.dit.adapters.tiny import save_tiny_pipeline
from sakura.edge.runtime import EdgeRuntime, run_edit
from sakura.edge.server_process import ServerProcess

from sakura.cli import main

TEMPLATE = "edit-apple-leaf"
RES = 128  # 8x VAE + 2x2 packing: an 8x8 token grid


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: save_tiny_pipeline(kind, root / kind) for kind in ("flux2", "sd3.5")}


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    """The shipped catalog's apple template with 4 steps and 2 profiling prompts (tiny models
    carry 512 text tokens per branch; the shipped 20 steps would only make the test slow),
    its 64 px image and mask enlarged to RES here (builds only resize down)."""
    from PIL import Image
    from sakura.dit.templates import DEFAULT_CATALOG

    doc = json.loads(DEFAULT_CATALOG.read_text())
    entry = dict(doc["templates"][TEMPLATE])
    folder = tmp_path_factory.mktemp("catalog")
    for key in ("image", "mask"):
        big = folder / f"{key}-{RES}.png"
        Image.open(DEFAULT_CATALOG.parent / entry[key]).resize((RES, RES), Image.NEAREST).save(big)
        entry[key] = str(big)
    entry.update(steps=4, profiling_prompts=entry["profiling_prompts"][:2])
    path = folder / "catalog.json"
    path.write_text(json.dumps({**doc, "templates": {TEMPLATE: entry}}))
    return str(path)


@pytest.mark.parametrize("kind,model", [("flux2", "flux2"), ("sd3.5", "sd3")])
def test_build_serve_edit_round_trip(tmp_path, checkpoints, catalog, kind, model, capsys):
    ck = checkpoints[kind]
    packs = tmp_path / "packs"
    assert main(["build", catalog, "--model", model, "--model-path", str(ck), "--templates", TEMPLATE,
                 "--codecs", "sakura,fp16", "--out", str(packs), "--resolution", str(RES),
                 "--blocks-per-shard", "2"]) == 0
    tid = f"{TEMPLATE}-{RES}"
    entry = json.loads((packs / "catalog.json").read_text())["templates"][tid]
    assert entry["template"]["resolution"] == RES
    assert entry["template"]["strength"] == 1.0  # adapters edit from pure noise (catalog: 0.7)
    manifest = json.loads((packs / "templates" / tid / "fp16" / "manifest.json").read_text())
    assert manifest["model"]["name"] == model
    assert manifest["model"]["weights_fingerprint"] == checkpoint_fingerprint(ck)
    # unchanged template, same checkpoint: skipped
    report = build(BuildConfig(catalog=catalog, out_dir=str(packs), templates=(TEMPLATE,),
                               resolution=RES,
                               codecs=("sakura", "fp16"), blocks_per_shard=2, model=model,
                               model_path=str(ck)))
    assert report.skipped == [tid]

    with ServerProcess(packs) as server:
        out = tmp_path / "edit.png"
        capsys.readouterr()
        for policy in ("fp16", "sakura", "local"):
            assert main(["edit", "--server", server.url, "--template", tid, "--prompt",
                         "a green leaf", "--seed", "5", "--policy", policy, "--model", model,
                         "--model-path", str(ck), "--no-state", "--out", str(out),
                         "--compare-exact"]) == 0
            doc = json.loads(out.with_name("edit.timeline.json").read_text())
            assert doc["policy"] == policy and not doc["warnings"]
            if policy == "fp16":  # the FP16 cache is `exact`
                assert doc["psnr_db"] == "inf"
            elif policy == "sakura":
                assert doc["bytes"] > 0 and doc["psnr_db"] > 25
            else:  # local recomputes the template: not exact, same image size
                assert doc["bytes"] == 0 and doc["psnr_db"] is not None

        # the same edit through the Python API equals the CLI's `exact` image bit for bit
        rt = EdgeRuntime(load_engine(model, ck))
        a = run_edit(server.url, tid, "a green leaf", "fp16", seed=5, runtime=rt)
        b = run_edit(server.url, tid, "a green leaf", "fp16", seed=5, runtime=rt)
        assert a.image.shape == (3, RES, RES) and torch.equal(a.image, b.image)


def test_other_checkpoint_warns_and_other_geometry_fails(tmp_path, checkpoints, catalog):
    ck = checkpoints["flux2"]
    packs = tmp_path / "packs"
    build(BuildConfig(catalog=catalog, out_dir=str(packs), templates=(TEMPLATE,), resolution=RES,
                      codecs=("fp16",), blocks_per_shard=2, model="flux2", model_path=str(ck)))
    tid = f"{TEMPLATE}-{RES}"
    other = save_tiny_pipeline("flux2", tmp_path / "other", seed=1)
    with ServerProcess(packs) as server:
        res = run_edit(server.url, tid, "a leaf", "fp16", model="flux2", model_path=other)
        assert res.warnings and "does not match the model" in res.warnings[0]
        # an SD3.5 device cannot use FLUX.2 packs: a clear error, nothing sent but ids
        with pytest.raises(Exception, match="does not fit this model and template"):
            run_edit(server.url, tid, "a leaf", "fp16", model="sd3",
                     model_path=checkpoints["sd3.5"])


def test_bad_model_arguments_are_clear_errors(tmp_path, checkpoints, capsys):
    packs = str(tmp_path / "packs")
    cases = [
        (["build", "--model", "flux2", "--model-path", str(tmp_path / "nowhere"), "--out", packs],
         "nowhere"),
        (["build", "--model", "flux2-klein-4b", "--model-path", str(checkpoints["flux2"]),
          "--out", packs, "--templates", TEMPLATE], "is not FLUX.2 [klein] 4B"),
        (["edit", "--server", "http://127.0.0.1:9", "--template", "x", "--prompt", "p",
          "--model", "sd3", "--model-path", str(checkpoints["flux2"]), "--out",
          str(tmp_path / "o.png"), "--no-state"], "sd3"),
    ]
    for argv, needle in cases:
        capsys.readouterr()
        assert main(argv) == 1, argv
        err = capsys.readouterr().err  # (notes may come first: "sakura: note: ...")
        errors = [line for line in err.splitlines() if line.startswith("sakura: error:")]
        assert len(errors) == 1 and needle in errors[0], (argv, err)
        assert "Traceback" not in err
    usage = [  # bad combinations and names are usage errors: exit 2, before anything loads
        (["build", "--model", "no-such-model", "--model-path", str(checkpoints["flux2"]),
          "--out", packs], "unknown model"),
        (["build", "--model-path", str(checkpoints["flux2"]), "--out", packs], "needs --model"),
        (["build", "--model", "flux2", "--out", packs], "needs --model-path"),
    ]
    for argv, needle in usage:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("usage: sakura build") and needle in err, (argv, err)
    assert not (tmp_path / "packs" / "catalog.json").exists()


def test_sakura_flux2_builds_serves_and_edits_on_both_runtimes(tmp_path, capsys, monkeypatch):
    """SAKURA's second model (``--model sakura-flux2``, dit/flux2_pixel.py), converted into
    the MMDiT's form (dit/flux2_native.py): build, serve, and edit on the native runtime's
    compiled shard graphs (the default) and on the Python one, the shipped 64 px catalog
    entry. Here with seeded random weights of a tiny config of the same class: one double-
    and one single-stream block instead of 2 and 6, which ``--model sakura-flux2`` accepts
    because its registry entry is patched to it (the shipped 8 blocks exported as one
    dynamic shard graph took 169 s of this test's 258 s, 2026-12-07; a block more of each
    kind adds no code path). The FP16 cache reproduces the exact edit on both runtimes
    and the two give the same image; sakura's compressed one is close to it. The build
    publishes no device bundle, so the native edit compiles its own graphs (the bundle's
    export is the shipped model's tests' business), and a second, warm native edit says
    nothing about it."""
    from dataclasses import replace

    from diffusers import Flux2Transformer2DModel
    from sakura.dit.adapters import registry
    from sakura.dit.flux2_pixel import PixelFlux2, save_flux2
    from sakura.dit.templates import DEFAULT_CATALOG

    tiny = {**registry.SAKURA_FLUX2, "num_layers": 1, "num_single_layers": 1}
    monkeypatch.setitem(registry.MODELS, "sakura-flux2",
                        replace(registry.MODELS["sakura-flux2"], config=tiny))
    torch.manual_seed(0)
    ck = tmp_path / "sakura-flux2"
    save_flux2(PixelFlux2(Flux2Transformer2DModel(**tiny)), ck, {"train_step": "0"})
    doc = json.loads(DEFAULT_CATALOG.read_text())
    entry = dict(doc["templates"][TEMPLATE])
    for key in ("image", "mask"):
        entry[key] = str(DEFAULT_CATALOG.parent / entry[key])
    entry.update(steps=4, profiling_prompts=entry["profiling_prompts"][:2])
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({**doc, "templates": {TEMPLATE: entry}}))
    packs = tmp_path / "packs"
    assert main(["build", str(catalog), "--model", "sakura-flux2", "--model-path", str(ck),
                 "--templates", TEMPLATE, "--codecs", "sakura,fp16", "--out", str(packs),
                 "--blocks-per-shard", "8", "--no-bundle"]) == 0
    manifest = json.loads((packs / "templates" / TEMPLATE / "fp16" / "manifest.json").read_text())
    assert manifest["model"]["name"] == "sakura-flux2"
    with ServerProcess(packs) as server:
        images = {}
        for i, (runtime, policy) in enumerate((("native", "fp16"), ("native", "fp16"),
                                               ("python", "fp16"), ("python", "sakura"))):
            out = tmp_path / f"edit-{runtime}-{policy}.png"
            capsys.readouterr()
            assert main(["edit", "--server", server.url, "--template", TEMPLATE,
                         "--prompt", "a green leaf", "--seed", "5", "--policy", policy,
                         "--model", "sakura-flux2", "--model-path", str(ck), "--no-state",
                         "--runtime", runtime, "--out", str(out), "--compare-exact"]) == 0
            if i == 1:  # warm: its graphs are in the cache, so no note about exporting them
                assert "no device bundle" not in capsys.readouterr().err
            doc = json.loads(out.with_name(out.stem + ".timeline.json").read_text())
            assert doc["policy"] == policy and not doc["warnings"], doc["warnings"]
            assert doc["runtime"] == runtime and doc["model"] == "sakura-flux2"
            if policy == "fp16":
                assert doc["psnr_db"] == "inf"
                images[runtime] = np.asarray(Image.open(out), dtype=np.float64)
            else:
                assert doc["bytes"] > 0 and doc["psnr_db"] > 25
        # the same edit on both runtimes: the compiled graphs' float path, at most 1 level
        assert np.abs(images["native"] - images["python"]).max() <= 1.0


def test_sakura_flux2_needs_no_model_path(monkeypatch, tmp_path):
    """``--model sakura-flux2`` alone uses the weights folder that ships with the project;
    a missing folder is one error naming the command that writes it; other models still
    need ``--model-path``."""
    from dataclasses import replace

    from sakura.dit.adapters import registry
    from sakura.dit.adapters.cli import check_model_options
    from sakura.dit.flux2_pixel import PixelFlux2, save_flux2

    from sakura.errors import SakuraError, UsageError

    spec = registry.MODELS["sakura-flux2"]
    assert spec.default_path == registry.SAKURA_FLUX2_DIR
    monkeypatch.setitem(registry.MODELS, "sakura-flux2",
                        replace(spec, default_path=tmp_path / "none"))
    with pytest.raises(SakuraError, match="sakura train --arch flux2"):
        check_model_options("sakura-flux2", None, None)
    save_flux2(PixelFlux2(), tmp_path / "w", {"train_step": "0"})
    monkeypatch.setitem(registry.MODELS, "sakura-flux2",
                        replace(spec, default_path=tmp_path / "w"))
    check_model_options("sakura-flux2", None, None)  # no error: its folder is there
    engine = load_engine("sakura-flux2")
    assert engine.name == "sakura-flux2" and engine.model.cfg.mlp_act == "swiglu"
    with pytest.raises(UsageError, match="needs --model-path"):
        check_model_options("flux2", None, None)
