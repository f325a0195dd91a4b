"""Diffusers adapters on tiny random configs of the real classes (FLUX.2, SD3.5, QwenImage,
QwenImage 2.1): exactness of cached masked execution against the slow pinned reference,
fidelity of the SAKURA processors to the stock diffusers forward, reference and prefix KV
caching against the models' own uncached (and KV) paths, importance, regional subsets."""

from __future__ import annotations

import pytest
import torch
from sakura.dit.adapters.hook import AdapterHook
from sakura.dit.adapters.inputs import LatentTemplate
from sakura.dit.adapters.processors import Branch
from sakura.dit.adapters.tiny import KINDS, tiny_adapter, tiny_request, tiny_spec, tiny_template
from sakura.dit.attention import CACHE, KVSegment


@pytest.fixture(scope="module")
def setups():
    """Per kind: (adapter, spec, template, run with hidden states), built once."""
    out = {}
    for kind in KINDS:
        a = tiny_adapter(kind)
        spec = tiny_spec(kind)
        tpl = tiny_template(a, spec)
        out[kind] = (a, spec, tpl, a.template_run(tpl, keep_hidden=True))
    return out


def _req(a, spec, kind, **kw):
    return tiny_request(a, spec, prefix_image=kind == "qwenimage-2.1", **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_edit_equals_pinned_reference(setups, kind):
    a, spec, tpl, run = setups[kind]
    req = _req(a, spec, kind)
    fast = a.cached_edit(tpl, run.geometry, run.cache, req)
    slow = a.pinned_reference_edit(tpl, run, req)
    err = (fast - slow).abs().max().item()
    assert err <= 1e-4, (kind, err)
    geo = run.geometry
    assert torch.equal(fast[geo.unmasked], tpl.latents[geo.unmasked])  # template, bit-exact
    assert (fast[geo.masked] - tpl.latents[geo.masked]).abs().mean() > 0.1  # edited
    # the cache has the TemplateCache layout the codec / pack / edge pipeline consumes
    c = run.cache
    assert c.keys.shape == (tpl.steps, a.num_blocks, len(geo.unmasked), a.heads * a.head_dim)
    assert c.fp16_bytes() == geo.fp16_bytes(tpl.steps)
    assert torch.equal(c.token_index, geo.unmasked)
    # the edit is not the local full run (unmasked tokens are pinned vs recomputed)
    assert (fast - a.full_edit(tpl, req)).abs().max() > 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_processors_match_the_stock_forward(setups, kind):
    """A SAKURA forward over every token equals the model with its stock processors."""
    a, spec, tpl, _ = setups[kind]
    n = tpl.tokens
    x = torch.randn(1, n, a.latent_channels, generator=torch.Generator().manual_seed(3))
    t = torch.tensor(640.0)
    if kind == "qwenimage-2.1":
        from sakura.dit.adapters.qwenimage21 import native_velocity

        cond = _req(a, spec, kind).cond
        br = a.prepare_branch(cond, template=tpl)
        ours = a.velocity(x, torch.arange(n), tpl.grid, t, br, AdapterHook(heads=a.heads,
                                                                         extra=br.extra))
        stock = native_velocity(a, x, tpl.grid, t, cond)
    else:
        cond = tpl.cond
        ours = a.velocity(x, torch.arange(n), tpl.grid, t, Branch(cond), AdapterHook(heads=a.heads))
        with torch.inference_mode():
            if kind == "flux2":
                from sakura.dit.adapters.flux2 import native_velocity

                stock = native_velocity(a, x, tpl.grid, t, cond)
            elif kind == "sd3.5":
                stock = a.pack(a.model(hidden_states=a.unpack(x, tpl.grid),
                                       encoder_hidden_states=cond.embeds,
                                       pooled_projections=cond.pooled, timestep=t.reshape(1),
                                       return_dict=False)[0])
            else:
                stock = a.model(hidden_states=x, encoder_hidden_states=cond.embeds,
                                timestep=(t / 1000).reshape(1), img_shapes=[[(1, *tpl.grid)]],
                                return_dict=False)[0]
    assert (ours - stock).abs().max().item() <= 1e-5
    assert stock.abs().mean() > 0.05


@pytest.mark.parametrize("kind", KINDS)
def test_importance_is_attention_mass_on_cached_tokens(setups, kind):
    a, spec, tpl, run = setups[kind]
    reqs = [_req(a, spec, kind, seed=s) for s in (1, 2)]
    imp = a.profile_importance(tpl, run, reqs)
    assert imp.shape == run.cache.keys.shape[:3] and (imp >= 0).all()
    bound = len(run.geometry.masked) * a.heads * 2 * len(reqs)  # queries x heads x branches x reqs
    sums = imp.sum(-1)
    assert (sums <= bound + 1e-3).all() and (sums > 0.01 * bound).all()
    assert torch.equal(run.cache.importance, imp)


@pytest.mark.parametrize("kind", KINDS)
def test_regional_subset_with_kv_of_the_rest_equals_full(setups, kind):
    """The regional-execution primitive: compute only some tokens, the others' K/V supplied
    (as FlashDiff's skipped patches); equals the full forward on those tokens."""
    a, spec, tpl, _ = setups[kind]
    n = tpl.tokens
    x = torch.randn(1, n, a.latent_channels, generator=torch.Generator().manual_seed(4))
    t = torch.tensor(500.0)
    br = a.prepare_branch(tpl.cond, template=tpl)
    rec = AdapterHook(heads=a.heads, extra=br.extra, record=True)
    full = a.velocity(x, torch.arange(n), tpl.grid, t, br, rec)
    patch = torch.arange(n // 3, n // 3 + n // 4)
    rest = torch.tensor([i for i in range(n) if i not in set(patch.tolist())])
    extra = {b: list(br.extra.get(b, [])) + [KVSegment(CACHE, rec.keys[b][:, :, rest],
                                                       rec.values[b][:, :, rest])]
             for b in rec.keys}
    part = a.velocity(x[:, patch], patch, tpl.grid, t, br, AdapterHook(heads=a.heads, extra=extra))
    assert (part - full[:, patch]).abs().max().item() <= 1e-5


def test_flux2_reference_kv_equals_uncached_and_the_klein_kv_pipeline(setups):
    from sakura.dit.adapters.flux2 import native_velocity

    a, spec, tpl, run = setups["flux2"]
    for refs in (1, 3):
        req = tiny_request(a, spec, refs=refs)
        cached = a.cached_edit(tpl, run.geometry, run.cache, req, cache_refs=True)
        uncached = a.cached_edit(tpl, run.geometry, run.cache, req, cache_refs=False)
        assert (cached - uncached).abs().max().item() <= 1e-4
    no_ref = a.cached_edit(tpl, run.geometry, run.cache, tiny_request(a, spec))
    assert (cached - no_ref).abs().max().item() > 1e-3  # references matter
    # against diffusers' own Flux2-klein KV path: same K/V, same velocities
    refs = req.references
    x = torch.randn(1, tpl.tokens, a.latent_channels, generator=torch.Generator().manual_seed(5))
    t = torch.tensor(800.0)
    v_extract, kv = native_velocity(a, x, tpl.grid, t, req.cond, refs)
    ours = a.extract_reference_kv(refs)
    double = len(a.model.transformer_blocks)
    for b, segs in ours.items():
        layer = kv.get_double(b) if b < double else kv.get_single(b - double)
        k_ref, v_ref = layer.get()
        assert (segs[0].k - k_ref.transpose(1, 2)).abs().max() <= 1e-5
        assert (segs[0].v - v_ref.transpose(1, 2)).abs().max() <= 1e-5
    br = a.prepare_branch(req.cond, refs)
    rows = torch.arange(tpl.tokens)
    v_ours = a.velocity(x, rows, tpl.grid, t, br, AdapterHook(heads=a.heads, extra=br.extra))
    assert (v_ours - v_extract).abs().max() <= 1e-5
    t2 = torch.tensor(300.0)
    v_cached = native_velocity(a, x, tpl.grid, t2, req.cond, kv_cache=kv)
    v_ours2 = a.velocity(x, rows, tpl.grid, t2, br, AdapterHook(heads=a.heads, extra=br.extra))
    assert (v_ours2 - v_cached).abs().max() <= 1e-5


def test_qwenimage21_prefix_kv_equals_uncached_at_every_step(setups):
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
    from sakura.dit.adapters.qwenimage21 import native_velocity

    a, spec, tpl, _ = setups["qwenimage-2.1"]
    cond = tiny_request(a, spec, prefix_image=True).cond
    x = torch.randn(1, tpl.tokens, a.latent_channels, generator=torch.Generator().manual_seed(6))
    br = a.prepare_branch(cond, template=tpl)  # the prefix, extracted once
    rows = torch.arange(tpl.tokens)
    pad, shapes, _ = a._layout(cond, tpl.grid)
    img_mask = torch.cat([cond.image_slots, torch.ones(tpl.tokens // 4, dtype=torch.bool)])[None]
    hidden = torch.cat([cond.images[0].tokens, x[0]])[None]
    cache = QwenImage21KVCache(a.num_blocks)
    for i, t in enumerate((torch.tensor(900.0), torch.tensor(250.0))):
        ours = a.velocity(x, rows, tpl.grid, t, br, AdapterHook(heads=a.heads, extra=br.extra))
        stock = native_velocity(a, x, tpl.grid, t, cond)  # whole sequence, no cache
        assert (ours - stock).abs().max().item() <= 1e-5
        with torch.inference_mode():  # diffusers' own extract / cached steps
            pipe = a.model(hidden_states=hidden, encoder_hidden_states=cond.embeds,
                           timestep=(t / 1000).reshape(1), img_shapes=[shapes], img_mask=img_mask,
                           kv_cache=cache, kv_cache_mode="extract" if i == 0 else "cached",
                           return_dict=False)[0][:, -tpl.tokens:]
        assert (ours - pipe).abs().max().item() <= 1e-5


def test_qwenimage21_template_keys_need_the_rope_frame_shift(setups):
    """The edit prompt is longer than the template's: without rotating the cached keys into
    the edit's RoPE frame, cached execution would not equal the pinned reference."""
    a, spec, tpl, run = setups["qwenimage-2.1"]
    req = tiny_request(a, spec, prefix_image=True)
    assert a.frame_of(req.cond) != a.frame_of(tpl.cond)
    slow = a.pinned_reference_edit(tpl, run, req)
    right = a.cached_edit(tpl, run.geometry, run.cache, req)
    wrong = a.cached_edit(tpl, run.geometry, run.cache, req, hook_factory=lambda s, br: (
        AdapterHook(heads=a.heads, extra=br.extra, provider=run.cache, step=s)))
    assert (right - slow).abs().max() <= 1e-4 < (wrong - slow).abs().max()


def test_sd35_dual_attention_blocks_and_pooled_text(setups):
    a, spec, tpl, run = setups["sd3.5"]
    assert a.block_names == ["layer.0.attn", "layer.0.attn2", "layer.1.attn", "layer.2.attn"]
    costs = a.block_costs()
    assert len(costs) == 4 and abs(sum(costs) / 4 - 1) < 1e-9 and costs[1] < costs[0]
    # the request's pooled vector differs from the template's: the pinned reference keeps
    # the template's modulation on the pinned tokens (as their cached K/V have it)
    req = tiny_request(a, spec)
    assert not torch.equal(req.cond.pooled, tpl.cond.pooled)
    fast = a.cached_edit(tpl, run.geometry, run.cache, req)
    req_same = tiny_request(a, spec)
    req_same.cond.pooled = tpl.cond.pooled.clone()
    req_same.uncond.pooled = tpl.cond.pooled.clone()
    other = a.cached_edit(tpl, run.geometry, run.cache, req_same)
    assert (fast - other).abs().max() > 1e-3  # pooled text does condition the edit


def test_unsupported_and_bad_inputs(setups):
    from sakura.dit.adapters.errors import InputError, UnsupportedError

    a, spec, tpl, run = setups["sd3.5"]
    with pytest.raises(UnsupportedError):
        a.cached_edit(tpl, run.geometry, run.cache, tiny_request(a, spec, refs=1))
    bad = LatentTemplate(tpl.latents[:-1], tpl.grid, tpl.mask, tpl.cond, seed=0)
    with pytest.raises(InputError):
        a.geometry(bad)
    req = tiny_request(a, spec)
    req.uncond = None
    with pytest.raises(InputError, match="negative prompt"):
        a.cached_edit(tpl, run.geometry, run.cache, req)
    with pytest.raises(InputError, match="keep_hidden"):
        a.pinned_reference_edit(tpl, a.template_run(tpl), tiny_request(a, spec))


@pytest.mark.parametrize("kind", KINDS)
def test_regional_execution_through_the_adapters(kind):
    """sakura.dit.regional (FlashDiff) driving an adapter: with the warm-up covering every step, or
    every patch running every step, it is the cached edit; with skipping it skips."""
    from sakura.dit.adapters.regional import regional_edit, regional_generate
    from sakura.dit.regional import RegionalConfig

    a = tiny_adapter(kind)
    spec = tiny_spec(kind)
    tpl = tiny_template(a, spec, ratio=0.5, steps=5)
    req = _req(a, spec, kind)
    run = a.template_run(tpl)
    exact = a.cached_edit(tpl, run.geometry, run.cache, req)
    same, _ = regional_edit(a, tpl, run.geometry, run.cache, req, RegionalConfig(warmup=5))
    assert (same - exact).abs().max().item() <= 1e-5
    every, st = regional_edit(a, tpl, run.geometry, run.cache, req,
                              RegionalConfig(warmup=2, eps=0.0, patches=3))
    assert st.stats.patches == 3 and st.stats.skipped_patch_steps == 0
    assert (every - exact).abs().max().item() <= 1e-4
    skip, st = regional_edit(a, tpl, run.geometry, run.cache, req,
                             RegionalConfig(warmup=2, eps=1.5, max_skips=1, patches=3,
                                            execution="separate"))
    assert st.stats.skipped_patch_steps > 0 and torch.isfinite(skip).all()
    assert torch.equal(skip[run.geometry.unmasked], tpl.latents[run.geometry.unmasked])
    if kind == "flux2":  # generation: the whole grid is the region
        gen_tpl = LatentTemplate(tpl.latents, tpl.grid, torch.ones_like(tpl.mask), tpl.cond,
                                 tpl.seed, tpl.steps, tpl.guidance)
        full = a.full_edit(gen_tpl, req)
        x, _ = regional_generate(a, gen_tpl, req, RegionalConfig(warmup=5))
        assert (x - full).abs().max().item() <= 1e-5
