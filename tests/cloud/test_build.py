"""`sakura build`: template run -> packs for every codec -> atomic publish; skip unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cloud.build import BuildConfig, build
from cloud.errors import PublishError
from codec.pack import Manifest
from dit.model import MMDiT, MMDiTConfig
from dit.templates import DEFAULT_CATALOG, decode_assets
from dit.weights import save_model


@pytest.fixture(scope="module")
def small_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    torch.manual_seed(0)
    model = MMDiT(MMDiTConfig(hidden_size=48, num_heads=3, double_blocks=1, single_blocks=2,
                              mlp_ratio=2.0, rope_axes=(4, 6, 6)))
    weights = root / "w.safetensors"
    save_model(model, weights)
    cat = json.loads(DEFAULT_CATALOG.read_text())
    entry = dict(cat["templates"]["edit-car-top"], steps=2)
    for key in ("image", "mask"):
        shutil.copy(DEFAULT_CATALOG.parent / entry[key], root / entry[key])
    (root / "catalog.json").write_text(json.dumps({"version": 1, "templates": {"car": entry}}))
    return root, weights


def test_build_publishes_every_codec_and_skips_unchanged(small_setup):
    root, weights = small_setup
    out = root / "out"
    cfg = BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(out),
                      codecs=("fp16", "sakura"), weights=str(weights), resolution=32)
    report = build(cfg, log=lambda *_: None)
    assert report.built == ["car-32"]
    catalog = json.loads((out / "catalog.json").read_text())
    entry = catalog["templates"]["car-32"]
    assert set(entry["codecs"]) == {"fp16", "sakura"}
    m = Manifest.load(out / entry["codecs"]["fp16"]["manifest"])
    assert m.geometry["steps"] == 2 and m.geometry["blocks"] == 3
    assert m.fp16_bytes == entry["fp16_bytes"]
    image, mask = decode_assets(entry)
    assert image.shape == (3, 32, 32) and mask.shape == (32, 32) and mask.any()
    # unchanged -> skipped, nothing rewritten
    before = (out / "catalog.json").read_bytes()
    assert build(cfg, log=lambda *_: None).skipped == ["car-32"]
    assert (out / "catalog.json").read_bytes() == before


def test_failed_build_leaves_catalog_unchanged(small_setup):
    root, weights = small_setup
    out = root / "out2"
    ok = BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(out), codecs=("fp16",),
                     weights=str(weights), resolution=32)
    build(ok, log=lambda *_: None)
    before = {p: p.read_bytes() for p in Path(out).rglob("*.json")}
    bad = BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(out),
                      codecs=("fp16", "no-such-codec"), weights=str(weights), resolution=32,
                      force=True)
    with pytest.raises(Exception) as info:
        build(bad, log=lambda *_: None)
    assert "no-such-codec" in str(info.value)
    after = {p: p.read_bytes() for p in Path(out).rglob("*.json")}
    assert {p: after[p] for p in before} == before


def test_unknown_template_is_a_clear_error(small_setup):
    root, weights = small_setup
    with pytest.raises(PublishError, match="unknown template"):
        build(BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(root / "o3"),
                          templates=("nope",), weights=str(weights)), log=lambda *_: None)
