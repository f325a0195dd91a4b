"""`sakura build`: template run -> packs for every codec -> atomic publish; skip unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from sakura.cloud.build import BuildConfig, build
from sakura.cloud.errors import PublishError
from sakura.codec.pack import Manifest
from sakura.dit.model import MMDiT, MMDiTConfig
from sakura.dit.templates import DEFAULT_CATALOG, decode_assets
from sakura.dit.weights import save_model


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
    # a build with the model chooses sakura's q per shard on the output front (issue 33):
    # recorded per shard, from q = 0 and the candidates, and named in the codec options
    sk = Manifest.load(out / entry["codecs"]["sakura"]["manifest"])
    assert sk.codec_options.get("q_front") == "output"
    assert {s.q for s in sk.shards} <= {0.0, *sk.codec_options["q_candidates"]}
    assert all(s.q is not None for s in sk.shards)
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


def test_profile_psnr_measures_each_configuration_against_exact(small_setup):
    """``--profile-psnr 1``: every configuration's ``psnr_db`` is the output PSNR of the
    profiling request with that one shard decoded (the resumed edit equals a whole edit),
    FP16 is exact (200 dB, the cap) and the Pareto front is taken on it."""
    from sakura.cloud.psnr_profile import OutputPSNR
    from sakura.codec.metrics import psnr
    from sakura.codec.pack import PackReader, decode_config
    from sakura.dit.adapters.engine import load_engine
    from sakura.dit.editing import cached_edit, full_edit
    from sakura.dit.templates import load_catalog, with_resolution

    root, weights = small_setup
    out = root / "psnr"
    cfg = BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(out),
                      codecs=("fp16", "sakura"), weights=str(weights), resolution=32,
                      profile_psnr=1)
    assert build(cfg, log=lambda *_: None).built == ["car-32"]
    def published(codec):
        folder = out / "templates" / "car-32" / codec
        manifest = Manifest.load(folder / "manifest.json")
        return manifest, PackReader(folder / manifest.pack_file)

    fp16, fp16_reader = published("fp16")
    fp16_reader.close()
    assert all(c.quality["psnr_db"] == 200.0 for s in fp16.shards for c in s.configs)
    manifest, reader = published("sakura")
    shard = manifest.shards[-1]
    values = [c.quality["psnr_db"] for c in shard.configs]
    assert all(v is not None and 0 < v <= 200 for v in values)
    assert any(c.pareto for c in shard.configs)

    # the same number, recomputed by hand with a whole (not resumed) edit
    engine = load_engine(None, weights=weights)
    spec = with_resolution(load_catalog(root / "catalog.json")["car"], 32)
    prep = engine.prepare(spec.load_image(), spec.load_mask(), spec.prompt, spec.seed,
                          spec.steps, spec.guidance)
    run = engine.template_run(prep)
    req = engine.request(spec.profiling_prompts[0], 600)
    layout = manifest.layout()
    fn = OutputPSNR(engine, prep, run, [req], layout)
    small = min(shard.configs, key=lambda c: c.bytes)
    with reader:
        decoded = decode_config(manifest, shard.index, small.id,
                                reader.read_config(shard.index, small.id), manifest.make_codec())
    got = fn(shard.index, small.params, decoded)
    step, blocks = layout.blocks_of(shard.index)
    exact_cache = run.cache.to_fp16_exact()

    class Changed:
        def get(self, s, b):
            if s == step and b in blocks:
                k = blocks.index(b)
                return decoded[2 * k].float(), decoded[2 * k + 1].float()
            return exact_cache.get(s, b)

    exact = cached_edit(engine.model, prep.template, prep.geometry, exact_cache, req)
    whole = cached_edit(engine.model, prep.template, prep.geometry, Changed(), req)
    assert got == pytest.approx(psnr((whole + 1) / 2, (exact + 1) / 2), abs=1e-6)
    assert got == pytest.approx(small.quality["psnr_db"], abs=1e-2)
    # the local edit's PSNR on the same request: in the profiler, and in every manifest
    # the build wrote (the device's quality floor)
    local = full_edit(engine.model, prep.template, req)
    assert fn.local_psnr_db == pytest.approx(psnr((local + 1) / 2, (exact + 1) / 2), abs=1e-6)
    assert manifest.local_psnr_db == pytest.approx(fn.local_psnr_db, abs=1e-2)
    assert fp16.local_psnr_db == manifest.local_psnr_db
    assert Manifest.from_dict(manifest.to_dict()).local_psnr_db == manifest.local_psnr_db
    with pytest.raises(PublishError, match="profile-psnr"):
        build(BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(root / "neg"),
                          weights=str(weights), profile_psnr=-1), log=lambda *_: None)


def test_build_publishes_to_an_s3_bucket_the_edge_reads(small_setup, monkeypatch):
    """``--publish s3://bucket/prefix``: the catalog lands in the bucket (catalog.json last),
    and the edge client reads a configuration from it with one presigned Range GET."""
    import asyncio

    from sakura.cloud.origins import MotoS3
    from sakura.cloud.storage import S3Storage
    from sakura.edge.client import PackClient

    root, weights = small_setup
    moto = MotoS3()
    with moto:
        for k, v in moto.env().items():
            monkeypatch.setenv(k, v)
        moto.create_bucket("packs")
        out = root / "out-s3"
        cfg = BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(out),
                          codecs=("fp16", "sakura"), weights=str(weights), resolution=32,
                          publish="s3://packs/prod")
        report = build(cfg, log=lambda *_: None)
        assert report.published[-1] == "catalog.json"
        local = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                       if p.is_file() and not p.name.startswith("."))
        assert S3Storage("packs", "prod").list() == local

        async def fetch():
            async with PackClient("s3://packs/prod") as c:
                m = await c.manifest("car-32", "sakura")
                cfg = m["shards"][1]["configs"][-1]
                return m, cfg, (await c.fetch_config("car-32", "sakura", 1, cfg["id"],
                                                     manifest=m)).data
        m, cfg_entry, data = asyncio.run(fetch())
    (offset, length), = cfg_entry["ranges"]
    pack = (out / "templates" / "car-32" / "sakura" / m["pack_file"]).read_bytes()
    assert data == pack[offset : offset + length]


def test_a_forced_rebuild_of_the_same_inputs_is_byte_identical(small_setup):
    """Same weights, catalog and codec settings: the same pack bytes (no timings inside the
    hashed content), so a rebuild publishes no new version and invalidates no cache; the
    versioned manifest already published is left as it was (it is immutable)."""
    root, weights = small_setup
    out = root / "out-repro"
    cfg = BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(out),
                      codecs=("fp16", "sakura", "intq"), weights=str(weights), resolution=32)
    build(cfg, log=lambda *_: None)
    first = json.loads((out / "catalog.json").read_text())["templates"]["car-32"]["codecs"]
    versioned = {c: (out / "templates" / "car-32" / c /
                     e["pack_file"].replace(".pack", ".manifest.json")).read_bytes()
                 for c, e in first.items()}
    build(BuildConfig(**{**cfg.__dict__, "force": True}), log=lambda *_: None)
    second = json.loads((out / "catalog.json").read_text())["templates"]["car-32"]["codecs"]
    for codec in first:
        assert second[codec]["pack_sha256"] == first[codec]["pack_sha256"], codec
        vpath = out / "templates" / "car-32" / codec / first[codec]["pack_file"].replace(
            ".pack", ".manifest.json")
        assert vpath.read_bytes() == versioned[codec]
    packs = sorted(p.name for p in out.rglob("*.pack"))
    assert len(packs) == 3  # no second version of anything
    assert not any(p.name.startswith(".build-") for p in out.iterdir())
