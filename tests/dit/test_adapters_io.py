"""Adapters around the pipeline: loading local checkpoints (and their errors), template
capture -> codec pack -> decode -> cached edit, RoPE options for the codec, cache geometry of
the released checkpoints, and the `sakura bench adapters` command."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from sakura.dit.adapters.errors import (
    CheckpointMismatchError,
    ModelPathError,
    UnknownModelError,
)
from sakura.dit.adapters.hook import AdapterHook
from sakura.dit.adapters.processors import Branch
from sakura.dit.adapters.registry import MODELS, load_adapter
from sakura.dit.adapters.tiny import (
    tiny_adapter,
    tiny_request,
    tiny_spec,
    tiny_template,
    tiny_transformer,
    tiny_vae,
)


def _velocity(a, spec, tpl):
    n = tpl.tokens
    x = torch.randn(1, n, a.latent_channels, generator=torch.Generator().manual_seed(2))
    return a.velocity(x, torch.arange(n), tpl.grid, torch.tensor(700.0), Branch(tpl.cond),
                      AdapterHook(heads=a.heads))


def _config(model) -> dict:
    """A model's config as JSON sees it (tuples and lists alike), without diffusers' own
    ``_``-prefixed bookkeeping (where it was loaded from)."""
    return json.loads(json.dumps({k: v for k, v in model.config.items()
                                  if not k.startswith("_")}))


def test_load_adapter_from_a_pipeline_folder_and_a_bare_transformer(tmp_path):
    ref = tiny_adapter("sd3.5")
    spec = tiny_spec("sd3.5")
    tpl = tiny_template(ref, spec)
    pipe = tmp_path / "pipe"
    ref.model.save_pretrained(pipe / "transformer")
    (pipe / "scheduler").mkdir()
    (pipe / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
         "shift": 2.0}))
    a = load_adapter("sd3", pipe)
    assert a.scheduler_config["shift"] == 2.0 and a.name == "sd3"
    # what the round trip must keep exactly: every weight, bit for bit, and the config
    want, got = ref.model.state_dict(), a.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert _config(a.model) == _config(ref.model)
    # ... so both compute the same function. Not bit-exactly in float32: the BLAS kernels
    # may sum in another order for weights at another address (measured here: 1.4e-6 on
    # outputs up to 5.2, ~3 ulp). In float64 the two evaluations differ by float64
    # rounding only (relative ~1e-13 here, far below half a float32 ulp, 3e-8), so the
    # float32 velocities the adapters return (cast from float64) agree to within one ulp.
    ref.model.double()
    a.model.double()
    v_loaded, v_ref = _velocity(a, spec, tpl), _velocity(ref, spec, tpl)
    ulp = torch.finfo(torch.float32).eps * torch.maximum(v_loaded.abs(), v_ref.abs())
    assert ((v_loaded - v_ref).abs() <= ulp).all()
    bare = tmp_path / "bare"
    tiny_transformer("flux2").save_pretrained(bare)
    f = load_adapter("flux2", bare)
    assert f.block_names == ["double.0", "double.1", "single.0", "single.1"]
    assert f.scheduler_config["use_dynamic_shifting"]  # the pipeline default when none ships


def test_load_adapter_errors(tmp_path):
    with pytest.raises(UnknownModelError, match="flux2-klein-4b"):
        load_adapter("flux3", tmp_path)
    with pytest.raises(ModelPathError, match="does not exist"):
        load_adapter("flux2", tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelPathError, match="not a folder"):
        load_adapter("flux2", tmp_path / "file")
    with pytest.raises(ModelPathError, match="config.json"):
        load_adapter("flux2", tmp_path)
    d = tmp_path / "tiny"
    tiny_transformer("flux2").save_pretrained(d)
    with pytest.raises(CheckpointMismatchError, match="SD3Transformer2DModel"):
        load_adapter("sd3.5-medium", d)
    with pytest.raises(CheckpointMismatchError, match=r"num_layers=2 \(expected 5\)"):
        load_adapter("flux2-klein-4b", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attention_head_dim"] = 8
    cfg["axes_dims_rope"] = [2, 2, 2, 2]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointMismatchError, match="do not match its config.json"):
        load_adapter("flux2", d)
    for w in d.glob("*.safetensors"):
        w.unlink()
    with pytest.raises(ModelPathError, match="weights"):
        load_adapter("flux2", d)


@pytest.mark.parametrize("kind", ["flux2"])
def test_capture_pack_decode_cached_edit_round_trip(tmp_path, kind):
    """Template capture -> importance -> codec pack -> read back -> cached edit (3 blocks per
    shard over 4 blocks: a full and a ragged shard per step)."""
    from sakura.codec import get_codec
    from sakura.codec.pack import open_pack, write_pack
    from sakura.codec.provider import PackProvider

    a = tiny_adapter(kind)
    spec = tiny_spec(kind)
    tpl = tiny_template(a, spec)
    run = a.template_run(tpl)
    a.profile_importance(tpl, run, [tiny_request(a, spec, seed=s) for s in (1, 2)])
    req = tiny_request(a, spec, seed=9)
    exact = a.cached_edit(tpl, run.geometry, run.cache.to_fp16_exact(), req)
    spread = (a.cached_edit(tpl, run.geometry, run.cache.to_fp16_exact(),
                            tiny_request(a, spec, seed=10)) - exact)[run.geometry.masked].abs().mean()
    for name, opts in (("fp16", {}), ("intq", {})):
        write_pack(tmp_path / name, "tpl", run.cache, get_codec(name, **opts), blocks_per_shard=3,
                   model=a.model_info(), compute_cost=None)
        manifest, reader = open_pack(tmp_path / name, "tpl")
        assert manifest.model["class"] == type(a.model).__name__
        assert manifest.geometry["blocks"] == a.num_blocks
        best = [max(s.configs, key=lambda c: c.bytes).id for s in manifest.shards]
        with reader:
            out = a.cached_edit(tpl, run.geometry, PackProvider(manifest, reader, best), req)
        err = (out - exact)[run.geometry.masked].abs().mean()
        if name == "fp16":
            assert torch.equal(out, exact)  # fp16 delivers the exact reference
        else:
            assert torch.isfinite(out).all() and err < 0.5 * spread, (err, spread)


def test_rope_options_reproduce_the_models_rotary_tables():
    from sakura.codec.lowrank import rope_angles

    a = tiny_adapter("flux2")
    tpl = tiny_template(a, tiny_spec("flux2"))
    geo = a.geometry(tpl)
    opt = a.rope_option(geo)
    ang = rope_angles(opt, len(geo.unmasked), a.heads * a.head_dim)
    from sakura.dit.adapters.flux2 import image_ids

    cos, _ = a.model.pos_embed(image_ids(geo.grid)[geo.unmasked])
    assert torch.allclose(ang.cos().repeat_interleave(2, dim=-1), cos.float(), atol=1e-5)
    for kind in ("qwenimage", "qwenimage-2.1"):
        a = tiny_adapter(kind)
        spec = tiny_spec(kind)
        tpl = tiny_template(a, spec)
        geo = a.geometry(tpl)
        if kind == "qwenimage":
            table = a.model.pos_embed([[(1, *geo.grid)]], max_txt_seq_len=5, device="cpu")[0]
            opt = a.rope_option(geo)
        else:
            table = a.extract_prefix_kv(tpl.cond, geo.grid).target_rope
            opt = a.rope_option(geo, frame=a.frame_of(tpl.cond))
        ang = rope_angles(opt, len(geo.unmasked), a.heads * a.head_dim)
        assert torch.allclose(torch.polar(torch.ones_like(ang), ang), table[geo.unmasked], atol=1e-4)


def test_cache_geometry_of_tiny_and_released_models():
    from sakura.dit.adapters.geometry import GIB, cache_geometry, paper_comparison, released

    for kind in ("flux2", "sd3.5"):
        a = tiny_adapter(kind)
        tpl = tiny_template(a, tiny_spec(kind))
        run = a.template_run(tpl)
        cfg = dict(a.model.config)
        ppt = 16  # flux2: VAE 8 x 2x2 packing; sd3: VAE 8 x patch 2
        g = cache_geometry(kind, type(a.model).__name__, cfg, tpl.grid[0] * ppt, tpl.steps)
        ratio = len(run.geometry.masked) / tpl.tokens
        assert g.tokens == tpl.tokens and g.blocks == a.num_blocks
        assert g.fp16_bytes(ratio) == run.cache.fp16_bytes()
    geo = released(512)
    klein = geo["flux2-klein-4b"]
    assert (klein.tokens, klein.blocks, klein.channels) == (1024, 25, 3072)
    assert klein.bytes_per_step() == 2 * 25 * 1024 * 3072 * 2
    assert geo["sd3.5-medium"].blocks == 24 + 13 and geo["sd3.5-large"].blocks == 38
    cmp = paper_comparison(klein)
    assert abs(cmp["ours_full_grid_gib_per_step"] - klein.bytes_per_step() / GIB) < 1e-12
    assert 4.9 < cmp["steps_equivalent_to_paper"] < 5.1
    assert set(MODELS) >= {"flux2-klein-4b", "flux2-klein-4b-kv", "sd3.5-medium", "qwenimage",
                           "qwenimage-2.1"}


def test_bench_command_registers_and_runs(tmp_path):
    from sakura.dit.adapters.cli import register

    parser = argparse.ArgumentParser(prog="sakura")
    commands = parser.add_subparsers(dest="command")
    bench = commands.add_parser("bench").add_subparsers(dest="bench")
    register(commands, bench)
    out = tmp_path / "adapters.json"
    args = parser.parse_args(["bench", "adapters", "--json", str(out), "--quick",
                              "--models", "qwenimage"])
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    m = res["models"]["qwenimage"]
    assert m["exact_max_abs_err"] <= 1e-4 and m["masked_speedup_10pct"] > 0
    assert res["cache_geometry_512"]["flux2-klein-4b"]["blocks"] == 25
    assert res["paper_comparison"]["paper_fp16_gib"] == 1.46
    with pytest.raises(SystemExit) as info:  # an unknown model is a usage error: exit 2
        parser.parse_args(["bench", "adapters", "--models", "nope"])
    assert info.value.code == 2


def _tiny_vae(family: str):
    return tiny_vae(family)


@pytest.mark.parametrize("kind,family", [("flux2", "flux2"), ("sd3.5", "sd3"),
                                         ("qwenimage", "qwenimage")])
def test_image_latents_through_the_checkpoints_vae(tmp_path, kind, family):
    """VAE encode -> the pipeline's normalization and packing -> tokens on the adapter's grid,
    and back; the token/latent steps are exact inverses."""
    from sakura.dit.adapters.latents import family_of, load_image_latents

    a = tiny_adapter(kind)
    assert family_of(a) == family
    _tiny_vae(family).save_pretrained(tmp_path / "vae")
    io = load_image_latents(a, tmp_path)
    spec = tiny_spec(kind)
    img = torch.rand(3, spec.grid[0] * 16, spec.grid[1] * 16) * 2 - 1
    lat = io.encode(img)
    assert lat.grid == spec.grid and lat.tokens.shape == (spec.grid[0] * spec.grid[1],
                                                            a.latent_channels)
    z = torch.randn(1, 4, spec.grid[0] * 2, spec.grid[1] * 2)
    back = io.from_tokens(io.to_tokens(z).tokens, spec.grid)
    assert torch.allclose(back, z, atol=1e-5)
    if family == "sd3":  # the same token layout as the adapter's own packing
        zn = (z - 0.06) * 1.5
        assert torch.allclose(io.to_tokens(z).tokens, a.pack(zn)[0], atol=1e-6)
    out = io.decode(lat.tokens, lat.grid)
    assert out.shape == img.shape and torch.isfinite(out).all()
    with pytest.raises(ModelPathError, match="no VAE"):
        load_image_latents(a, tmp_path / "nowhere")


class _HashEncoder:
    """Test-only text encoder: deterministic random embeddings per prompt (MiniLM-shaped for
    the default model, a Conditioning for diffusers models)."""

    def __init__(self, dim: int, tokens: int, pooled: int = 0):
        self.dim, self.tokens, self.pooled = dim, tokens, pooled

    def _gen(self, text: str) -> torch.Generator:
        return torch.Generator().manual_seed(sum(map(ord, text)) * 7919 + len(text))

    def encode(self, texts: list[str]) -> torch.Tensor:
        return torch.cat([torch.randn(1, self.tokens, self.dim, generator=self._gen(t))
                          for t in texts])

    def conditioning(self, text: str):
        from sakura.dit.adapters.inputs import Conditioning

        g = self._gen(text)
        emb = torch.randn(1, self.tokens + len(text) % 3, self.dim, generator=g)
        return Conditioning(emb, torch.randn(1, self.pooled, generator=g) if self.pooled else None)


def _engines(tmp_path):
    from sakura.dit.adapters.engine import DefaultEngine, DiffusersEngine
    from sakura.dit.adapters.latents import load_image_latents

    from tests.dit.common import tiny_model

    model = tiny_model()
    yield DefaultEngine(model, _HashEncoder(model.cfg.text_dim, model.cfg.text_tokens)), 32
    a = tiny_adapter("flux2")
    _tiny_vae("flux2").save_pretrained(tmp_path / "vae")
    enc = _HashEncoder(tiny_spec("flux2").text_dim, 5)
    yield DiffusersEngine(a, load_image_latents(a, tmp_path), enc.conditioning, 4, 2.0), 96


def test_engine_build_pack_edit_round_trip_for_both_model_kinds(tmp_path):
    """The uniform caller interface: pixels + prompts -> template run -> importance -> pack
    (fp16 and sakura) -> decoded provider -> cached edit -> pixels, for the default model and a
    diffusers adapter through the same calls."""
    from sakura.codec import get_codec
    from sakura.codec.pack import open_pack, write_pack
    from sakura.codec.provider import PackProvider

    for i, (engine, size) in enumerate(_engines(tmp_path)):
        gen = torch.Generator().manual_seed(i)
        image = torch.rand(3, size, size, generator=gen) * 2 - 1
        mask = torch.zeros(size, size, dtype=torch.bool)
        mask[size // 4: size // 2, size // 3: 2 * size // 3] = True
        prep = engine.prepare(image, mask, "a template prompt", seed=3, steps=3, guidance=2.0)
        assert 0 < prep.token_mask_ratio < 0.5
        run = engine.template_run(prep)
        engine.profile_importance(prep, run, [engine.request(p, 100 + j) for j, p in
                                              enumerate(["profile one", "profile two"])])
        assert run.cache.importance.sum() > 0
        req = engine.request("the private prompt", seed=9)
        exact = engine.edit(prep, run.cache.to_fp16_exact(), req)
        assert exact.shape == image.shape
        costs = engine.block_costs()
        assert len(costs) == run.cache.blocks
        g = engine.cache_geometry(prep)
        assert (g["steps"], g["blocks"], g["tokens"], g["channels"], g["heads"]) == (
            run.cache.steps, run.cache.blocks, run.cache.tokens, run.cache.channels,
            run.cache.num_heads)
        # sakura with the RoPE frame on the diffusers model (the default model's sakura packs
        # are covered by the codec tests)
        for name in ("fp16", "sakura") if i else ("fp16",):
            rope = engine.rope_option(prep) if name == "sakura" else None
            codec = get_codec(name, **({"rope": rope} if rope else {}))
            d = tmp_path / f"{i}-{name}"
            write_pack(d, "tpl", run.cache, codec, blocks_per_shard=2,
                       model=engine.model_info(), compute_cost=None)
            manifest, reader = open_pack(d, "tpl")
            best = [max(s.configs, key=lambda c: c.bytes).id for s in manifest.shards]
            steps = []
            with reader:
                out = engine.edit(prep, PackProvider(manifest, reader, best), req,
                                  on_step=steps.append)
            assert steps == [0, 1, 2] and torch.isfinite(out).all()
            if name == "fp16":
                assert torch.equal(out, exact)
        assert (engine.local_edit(prep, req) - exact).abs().max() > 0
