"""The trained pixel FLUX.2 in the MMDiT's form (``dit.flux2_native``) computes its velocity.

On the committed weights (``dit/weights/sakura-flux2``): the converted MMDiT's velocity is
PixelFlux2's within 1e-5 at 32 and 64 px, several timesteps, two batch rows of different
text (a guidance batch); the one residual is the RoPE tables (FLUX.2 takes cos/sin of the
float64 angle, the MMDiT of the float32 one): with those matched the two agree to the last
bit on the machine this was written on. References follow FLUX.2-klein's KV "extract"
semantics in both; the template run's captured K/V (what a pack holds) are the same rows
in the same layout on the adapter path and in the MMDiT form.
"""

from __future__ import annotations

import json

import pytest
import torch
from sakura.dit import model as mmdit
from sakura.dit.adapters.flux2 import Flux2Adapter, image_ids, text_ids
from sakura.dit.adapters.hook import AdapterHook
from sakura.dit.adapters.inputs import Conditioning
from sakura.dit.adapters.processors import Branch
from sakura.dit.editing import CaptureHook
from sakura.dit.flux2_native import mmdit_config, mmdit_form
from sakura.dit.flux2_pixel import load_flux2
from sakura.dit.model import MMDiTConfig, TokenBatch

TOL = 1e-5
TEXT_TOKENS = 16


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    flux2 = load_flux2()
    return flux2, mmdit_form(flux2)


def _inputs(grid: int, t: float, seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(batch, grid * grid, 48, generator=g)
    txt = torch.randn(batch, TEXT_TOKENS, 384, generator=g)
    return img, txt, torch.full((batch,), t)


def _velocities(models, grid: int, t: float, seed: int):
    flux2, conv = models
    img, txt, ts = _inputs(grid, t, seed)
    with torch.no_grad():
        want = flux2(TokenBatch(img=img, img_pos=image_ids((grid, grid)), txt=txt, t=ts))
        got = conv(TokenBatch(img=img, img_pos=conv.image_positions(grid), txt=txt, t=ts))
    return want, got


@pytest.mark.parametrize("size", [32, 64])
def test_velocity_equals_pixel_flux2(models, size):
    grid = size // 4
    for i, t in enumerate((0.05, 0.5, 0.95)):
        want, got = _velocities(models, grid, t, seed=10 * size + i)
        assert got.shape == want.shape == (2, grid * grid, 48)
        assert want.abs().max() > 1.0  # a velocity, not a zero output
        err = (got - want).abs().max().item()
        assert err <= TOL, f"{size} px, t={t}: max abs difference {err:.3g}"


def test_only_the_rope_tables_differ(models, monkeypatch):
    """With the RoPE tables taken as FLUX.2 takes them (cos/sin of the float64 angle, then
    float32), nothing else is left: 0.0 on an x86 CPU with torch 2.x (the bound leaves a
    float32 rounding of the velocity for other kernels)."""

    def rope_angles(pos, axes, theta):  # float64 angles
        out = []
        for i, dim in enumerate(axes):
            freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
            out.append(pos[:, i : i + 1].double() * freqs[None])
        return torch.cat(out, dim=-1)

    def apply_rope(x, angles):
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    monkeypatch.setattr(mmdit, "rope_angles", rope_angles)
    monkeypatch.setattr(mmdit, "apply_rope", apply_rope)
    want, got = _velocities(models, 8, 0.5, seed=3)
    assert (got - want).abs().max().item() <= 1e-6


def test_references_follow_klein_kv_extract(models):
    """The MMDiT's reference tokens (t = 0, self-attending, image weights) are FLUX.2's in
    the pipeline's "extract" mode (untrained on references, but the same function)."""
    from diffusers.models.transformers.transformer_flux2 import (  # lazy: diffusers
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    flux2, conv = models
    f = flux2.transformer
    stock = f.attn_processors
    f.set_attn_processor({name: (Flux2KVParallelSelfAttnProcessor() if name.startswith("single")
                                 else Flux2KVAttnProcessor()) for name in stock})
    try:
        img, txt, ts = _inputs(8, 0.4, seed=5, batch=1)
        ref = torch.randn(1, 36, 48, generator=torch.Generator().manual_seed(6))
        ref_ids = image_ids((6, 6), 10.0)
        with torch.no_grad():
            want, _ = f(hidden_states=torch.cat([ref, img], dim=1), encoder_hidden_states=txt,
                        timestep=ts, img_ids=torch.cat([ref_ids, image_ids((8, 8))]),
                        txt_ids=text_ids(TEXT_TOKENS), kv_cache_mode="extract",
                        num_ref_tokens=36, return_dict=False)
            got = conv(TokenBatch(img=img, img_pos=conv.image_positions(8), txt=txt, t=ts,
                                  ref=ref, ref_pos=ref_ids, ref_sizes=(36,)))
    finally:
        f.set_attn_processor(stock)
    assert (got - want).abs().max().item() <= TOL


def test_template_kv_is_the_adapters(models):
    """One template pass: the adapter path's captured K/V (``AdapterHook``, what its packs
    hold) and ``dit.editing.CaptureHook``'s on the MMDiT form, block by block: the same
    unmasked rows, ``[U, H*d]`` channels head-major, after QK-norm and RoPE."""
    flux2, conv = models
    grid, unmasked = 8, torch.tensor([0, 1, 2, 9, 17, 40, 63])
    img, txt, ts = _inputs(grid, 0.7, seed=8, batch=1)
    adapter = Flux2Adapter(flux2.transformer, pixels_per_token=4)
    try:
        ahook = AdapterHook(heads=adapter.heads, capture=unmasked)
        adapter.velocity(img, torch.arange(grid * grid), (grid, grid), ts * 1000,
                         Branch(Conditioning(txt)), ahook)
    finally:
        adapter.restore_processors()
    mhook = CaptureHook("joint", unmasked)
    with torch.no_grad():
        conv(TokenBatch(img=img, img_pos=conv.image_positions(grid), txt=txt, t=ts), mhook)
    assert sorted(ahook.keys) == sorted(mhook.keys) == list(range(conv.cfg.num_blocks))
    for b in range(conv.cfg.num_blocks):
        for a, m in ((ahook.keys[b], mhook.keys[b]), (ahook.values[b], mhook.values[b])):
            assert a.shape == m.shape == (len(unmasked), conv.cfg.hidden_size)
            assert (a - m).abs().max().item() <= TOL, f"block {b}"


def test_config_options(models):
    """The conversion options travel in the config; the shipped config's dict is unchanged."""
    flux2, conv = models
    cfg = mmdit_config(flux2)
    assert (cfg.mlp_act, cfg.layer_norm_eps, cfg.bias, cfg.positions, cfg.rope_axes) == (
        "swiglu", 1e-6, False, "flux_ids", (8, 8, 8, 8))
    assert MMDiTConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert set(MMDiTConfig().to_dict()) == {
        "in_channels", "patch_size", "hidden_size", "num_heads", "double_blocks",
        "single_blocks", "mlp_ratio", "text_dim", "text_tokens", "pos_span", "rope_theta",
        "rope_axes", "attention_mode", "extra"}
    assert sum(p.numel() for p in conv.parameters()) == sum(
        p.numel() for p in flux2.transformer.parameters())
    assert conv.text_positions(3).tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]]
    assert torch.equal(conv.image_positions(4), image_ids((4, 4)))


def test_references_are_refused_by_a_model_trained_without_them():
    """The converted sakura-flux2 (FLUX's integer ids, trained without references) cannot
    place reference tokens: one clear error, not a shape error inside attention."""
    from sakura.dit.refcache import reference_tokens

    model = mmdit.MMDiT(mmdit.MMDiTConfig(positions="flux_ids", rope_axes=(8, 8, 8, 8)))
    with pytest.raises(ValueError, match="trained without references"):
        reference_tokens(model, torch.zeros(1, 3, 16, 16))
