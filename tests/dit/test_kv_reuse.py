"""Reference-KV caching, text-KV approximation and block-causal prefix caching."""

from __future__ import annotations

import torch
from sakura.dit.editing import cached_edit, template_run
from sakura.dit.model import TokenBatch, grid_positions
from sakura.dit.prefix import PrefixKV, latent_velocity
from sakura.dit.refcache import reference_tokens

from tests.dit.common import tiny_model, tiny_request, tiny_template


def test_reference_kv_cache_equals_uncached():
    model = tiny_model()
    tpl = tiny_template(model)
    run = template_run(model, tpl)
    for refs in (1, 3):
        req = tiny_request(model, refs=refs)
        cached = cached_edit(model, tpl, run.geometry, run.cache, req, cache_refs=True)
        uncached = cached_edit(model, tpl, run.geometry, run.cache, req, cache_refs=False)
        assert (cached - uncached).abs().max().item() <= 1e-4
        no_ref = cached_edit(model, tpl, run.geometry, run.cache, tiny_request(model))
        assert (cached - no_ref).abs().max().item() > 1e-3  # references matter


def test_text_kv_reuse_is_an_approximation():
    model = tiny_model()
    tpl = tiny_template(model)
    run = template_run(model, tpl)
    req = tiny_request(model)
    exact = cached_edit(model, tpl, run.geometry, run.cache, req)
    approx = cached_edit(model, tpl, run.geometry, run.cache, req, reuse_text_kv=True)
    err = (exact - approx).abs().max().item()
    assert 0 < err < 1.0


def test_block_causal_segmented_prefix_equals_one_masked_attention():
    model = tiny_model(mode="block_causal")
    g = torch.Generator().manual_seed(3)
    txt = torch.randn(2, model.cfg.text_tokens, model.cfg.text_dim, generator=g)
    refs = torch.rand(2, 3, 16, 16, generator=g) * 2 - 1
    x = torch.randn(2, 64, model.cfg.patch_dim, generator=g)
    pos = grid_positions(8, model.cfg.pos_span)
    t = torch.tensor([0.7, 0.7])
    ref_toks, ref_pos, sizes = reference_tokens(model, refs)
    full = model(TokenBatch(img=x, img_pos=pos, txt=txt, t=t, ref=ref_toks.expand(2, -1, -1),
                            ref_pos=ref_pos, ref_sizes=sizes))
    prefix = PrefixKV.extract(model, txt, refs)
    seg = latent_velocity(model, prefix, x, pos, t, txt)
    assert (full - seg).abs().max().item() <= 1e-4
    # the prefix is step-independent: the same cache serves another timestep exactly
    t2 = torch.tensor([0.2, 0.2])
    full2 = model(TokenBatch(img=x, img_pos=pos, txt=txt, t=t2, ref=ref_toks.expand(2, -1, -1),
                             ref_pos=ref_pos, ref_sizes=sizes))
    assert (full2 - latent_velocity(model, prefix, x, pos, t2, txt)).abs().max().item() <= 1e-4
