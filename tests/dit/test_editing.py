"""Masked editing with template-KV reuse: cached execution vs the slow pinned reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sakura.dit.editing import (
    Geometry,
    cached_edit,
    edit_noise,
    edit_schedule,
    edit_start,
    full_edit,
    pinned_reference_edit,
    profile_importance,
    template_run,
    token_mask,
)

from tests.dit.common import tiny_model, tiny_request, tiny_template


def test_token_mask_marks_any_touched_patch():
    m = torch.zeros(8, 8, dtype=torch.bool)
    m[0, 5] = True
    tm = token_mask(m, 4)
    assert tm.tolist() == [False, True, False, False]


def test_capture_shapes_and_cache_geometry():
    model = tiny_model()
    tpl = tiny_template(model)
    run = template_run(model, tpl)
    geo = Geometry.of(model, tpl)
    c = run.cache
    assert c.keys.shape == (tpl.steps, model.cfg.num_blocks, len(geo.unmasked), 48)
    assert torch.equal(c.token_index, geo.unmasked)
    assert len(geo.masked) + len(geo.unmasked) == (32 // 4) ** 2
    assert c.fp16_bytes() == 2 * c.keys.numel() * 2


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_cached_edit_equals_pinned_reference(strength):
    model = tiny_model()
    tpl = dataclasses.replace(tiny_template(model), strength=strength)
    run = template_run(model, tpl, keep_hidden=True)
    req = tiny_request(model)
    fast = cached_edit(model, tpl, run.geometry, run.cache, req)
    slow = pinned_reference_edit(model, tpl, run, req)
    err = (fast - slow).abs().max().item()
    assert err <= 1e-4, err
    # outside the mask the output is the template, exactly
    outside = ~tpl.mask
    assert torch.equal(fast[:, outside], tpl.image[:, outside])
    # and the edit did change the masked region
    assert (fast[:, tpl.mask] - tpl.image[:, tpl.mask]).abs().mean() > 0.05


def test_cache_reuse_differs_from_full_but_is_close_on_template_prompt():
    model = tiny_model()
    tpl = tiny_template(model)
    run = template_run(model, tpl)
    req = tiny_request(model)
    req.txt = tpl.txt
    cached = cached_edit(model, tpl, run.geometry, run.cache, req)
    full = full_edit(model, tpl, req)
    # not identical (unmasked tokens are pinned vs recomputed) but the same content
    diff = (cached - full).abs()
    assert diff.max() > 0
    assert diff.mean() < 0.5


def test_importance_is_attention_mass_on_cached_tokens():
    model = tiny_model()
    tpl = tiny_template(model)
    run = template_run(model, tpl)
    reqs = [tiny_request(model, seed=s) for s in (1, 2)]
    imp = profile_importance(model, tpl, run, reqs)
    assert imp.shape == run.cache.keys.shape[:3]
    assert (imp >= 0).all()
    masked = len(run.geometry.masked)
    # each masked query's probabilities sum to 1 over all keys: the mass on cached tokens is
    # at most queries x heads x guidance branches x requests per (step, block)
    bound = masked * model.cfg.num_heads * 2 * len(reqs)
    sums = imp.sum(-1)
    assert (sums <= bound + 1e-3).all() and (sums > 0.05 * bound).all()
    assert torch.equal(run.cache.importance, imp)


def test_strength_starts_from_the_noised_template():
    model = tiny_model()
    tpl = tiny_template(model)
    assert torch.equal(edit_start(model, tpl, 5), edit_noise(model, tpl, 5))
    assert edit_schedule(tpl)[0] == 1.0 and len(edit_schedule(tpl)) == tpl.steps + 1
    half = dataclasses.replace(tpl, strength=0.5)
    ts = edit_schedule(half)
    assert ts[0] == 0.5 and ts[-1] == 0.0 and len(ts) == tpl.steps + 1  # same step count
    from sakura.dit.model import patchify

    x0 = patchify(tpl.image[None].float(), model.cfg.patch_size)
    want = 0.5 * x0 + 0.5 * edit_noise(model, tpl, 5)
    assert torch.allclose(edit_start(model, half, 5), want)
    # the cache follows the same schedule: its first step is the template noised to 0.5
    assert template_run(model, half).cache.timesteps[0] == 0.5
    # a lower strength keeps the region closer to the template
    req = tiny_request(model)
    far = [(cached_edit(model, t, Geometry.of(model, t), template_run(model, t).cache, req)
            - tpl.image)[:, tpl.mask].abs().mean() for t in (tpl, dataclasses.replace(tpl, strength=0.2))]
    assert far[1] < far[0]


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_strength_out_of_range_is_refused(bad):
    model = tiny_model()
    with pytest.raises(ValueError, match="strength"):
        dataclasses.replace(tiny_template(model), strength=bad)
