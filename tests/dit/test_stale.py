"""Stale reuse (dit/stale.py): a late step runs on each block's last K/V, up to an age."""

from __future__ import annotations

from dataclasses import replace

import torch
from sakura.dit.cache import ShardSkipped, StepLate
from sakura.dit.editing import RecomputedKV, cached_edit, template_run
from sakura.dit.stale import STALE_MAX_AGE

from tests.dit.common import tiny_model, tiny_request, tiny_template


class Late:
    """The exact cache, except that the steps in ``late`` raise StepLate (a stream whose
    shards for them did not come); records what a streaming provider is told."""

    def __init__(self, cache, late):
        self.cache, self.late, self.told = cache, set(late), []

    def get(self, step, block):
        if step in self.late:
            raise StepLate(step)
        return self.cache.get(step, block)

    def ran_stale(self, step, sources, compute_s):
        self.told.append((step, dict(sources), compute_s))


class Mapped:
    """The exact cache with step s's K/V taken from ``source[s]``; steps in ``local`` late."""

    def __init__(self, cache, source, local=()):
        self.cache, self.source, self.local = cache, source, set(local)

    def get(self, step, block):
        if step in self.local:
            raise StepLate(step)
        return self.cache.get(self.source.get(step, step), block)


def _world(steps=12):
    model = tiny_model()
    tpl = tiny_template(model, steps=steps)
    run = template_run(model, tpl)
    return model, tpl, run, tiny_request(model)


def test_late_steps_reuse_the_last_kv_up_to_the_age_cap_then_recompute_it():
    model, tpl, run, req = _world()
    late = Late(run.cache, range(3, 10))  # steps 3-9 late; the cap allows 3 steps of age
    out = cached_edit(model, tpl, run.geometry, late, req)
    # the same edit built by hand: steps 3-5 on step 2's K/V; step 6 (age 4) recomputed, so
    # on its own K/V (the recompute step is the template run's computation); 7-9 on step 6's
    want = cached_edit(model, tpl, run.geometry,
                       Mapped(run.cache, {3: 2, 4: 2, 5: 2, 7: 6, 8: 6, 9: 6}), req,
                       stale_max_age=0)
    assert (out - want).abs().max().item() <= 1e-5
    assert [s for s, _, _ in late.told] == [3, 4, 5, 7, 8, 9]
    n = model.cfg.num_blocks
    assert all(src == dict.fromkeys(range(n), 2 if s < 6 else 6) and t > 0
               for s, src, t in late.told)
    assert STALE_MAX_AGE == 3


def test_reuse_off_recomputes_every_late_step():
    model, tpl, run, req = _world()
    late = Late(run.cache, range(3, 10))
    off = cached_edit(model, tpl, run.geometry, late, req, stale_max_age=0)
    assert late.told == []
    exact = cached_edit(model, tpl, run.geometry, run.cache, req)
    assert (off - exact).abs().max().item() <= 1e-5
    on = cached_edit(model, tpl, run.geometry, Late(run.cache, range(3, 10)), req)
    assert not torch.equal(off, on)


def test_no_reuse_before_any_kv_arrived():
    # an outage from the start: nothing to reuse, step 0 is recomputed, then its K/V serve
    # steps 1-3 (ages 1-3)
    model, tpl, run, req = _world(steps=4)
    late = Late(run.cache, range(4))
    out = cached_edit(model, tpl, run.geometry, late, req)
    assert [s for s, _, _ in late.told] == [1, 2, 3]
    want = cached_edit(model, tpl, run.geometry, Mapped(run.cache, {1: 0, 2: 0, 3: 0}), req)
    assert (out - want).abs().max().item() <= 1e-5



class Skipped:
    """The exact cache, except that (step, block) pairs in ``skip`` raise ShardSkipped (the
    stale plan did not fetch their shard); records what the provider is told."""

    def __init__(self, cache, skip):
        self.cache, self.skip, self.told = cache, set(skip), []

    def get(self, step, block):
        if (step, block) in self.skip:
            raise ShardSkipped(step, block)
        return self.cache.get(step, block)

    def stale_shard(self, step, block, source):
        self.told.append((step, block, source))

    def ran_stale(self, step, sources, compute_s):
        pass


def test_a_skipped_block_runs_on_its_own_last_kv_and_the_others_on_theirs():
    """The stale plan (edge/stale_plan.py): a block whose shard was not fetched runs on the
    K/V it last ran on, while the step's other blocks run on their own fresh K/V; the
    provider hears the source step of each skipped block."""
    model, tpl, run, req = _world(steps=6)
    n = model.cfg.num_blocks
    skip = {(s, b) for s in (2, 3) for b in range(n // 2)}  # first half of blocks, steps 2-3
    prov = Skipped(run.cache, skip)
    out = cached_edit(model, tpl, run.geometry, prov, req)
    assert sorted(prov.told) == sorted((s, b, 1) for s, b in skip)

    class ByBlock:
        def get(self, step, block):
            return run.cache.get(1 if (step, block) in skip else step, block)

    want = cached_edit(model, tpl, run.geometry, ByBlock(), req, stale_max_age=0)
    assert (out - want).abs().max().item() <= 1e-5
    exact = cached_edit(model, tpl, run.geometry, run.cache, req)
    assert (out - exact).abs().max().item() > 1e-4  # (so the check can fail)


def test_a_skipped_block_with_kv_too_old_makes_its_step_late():
    """Kept K/V older than the cap (or none): the provider hears None and the step is late,
    computed on the device (the recompute step: exact K/V, kept for the next steps)."""
    model, tpl, run, req = _world(steps=6)
    prov = Skipped(run.cache, {(s, 0) for s in range(6)})  # block 0 never fetched
    out = cached_edit(model, tpl, run.geometry, prov, req, stale_max_age=3)
    # step 0: nothing kept; steps 1-3 on step 0's (recomputed); step 4 (age 4) recomputed;
    # step 5 on step 4's
    assert prov.told == [(0, 0, None), (1, 0, 0), (2, 0, 0), (3, 0, 0), (4, 0, None),
                         (5, 0, 4)]

    class ByBlock:
        def get(self, step, block):
            src = {1: 0, 2: 0, 3: 0, 5: 4}.get(step, step) if block == 0 else step
            return run.cache.get(src, block)

    want = cached_edit(model, tpl, run.geometry, ByBlock(), req, stale_max_age=0)
    assert (out - want).abs().max().item() <= 1e-5
    told = []
    prov2 = Skipped(run.cache, {(4, 0)})
    prov2.stale_shard = lambda s, b, src: told.append((s, b, src))
    off = cached_edit(model, tpl, run.geometry, prov2, req, stale_max_age=0)
    assert told == []  # no stale reuse: a skipped block is a late step, recomputed
    exact = cached_edit(model, tpl, run.geometry, run.cache, req)
    assert (off - exact).abs().max().item() <= 1e-5

# ------------------------------------------------------------------ the recompute step


def test_the_recompute_step_is_the_template_runs_own_kv():
    """RecomputedKV (dit/editing.py): the K/V of step s recomputed on the device from the
    template's public data are those the cloud's template run captured."""
    model, tpl, run, _req = _world(steps=4)
    rec = RecomputedKV(model, tpl, run.geometry)
    for s in range(4):
        kv = rec.step(s, run.cache.timesteps[s])
        for b in range(model.cfg.num_blocks):
            k, v = run.cache.get(s, b)
            assert (kv[b][0] - k.float()).abs().max().item() <= 1e-6
            assert (kv[b][1] - v.float()).abs().max().item() <= 1e-6


def test_without_the_template_prompt_a_late_step_runs_with_every_token():
    """A device template has no prompt embeddings until its runtime encodes the prompt:
    then a late step cannot be recomputed and runs with every token, as ``local`` does."""
    model, tpl, run, req = _world(steps=4)
    bare = replace(tpl, txt=torch.zeros(1, 0, tpl.txt.shape[-1]))
    assert not RecomputedKV.possible(bare) and RecomputedKV.possible(tpl)
    late = [1, 2, 3]
    got = cached_edit(model, bare, run.geometry, Late(run.cache, late), req, stale_max_age=0)
    full = cached_edit(model, tpl, run.geometry, Late(run.cache, late), req, stale_max_age=0,
                       recompute=False)
    exact = cached_edit(model, tpl, run.geometry, run.cache, req)
    assert torch.equal(got, full)
    # a different trajectory: far outside the recompute step's float error (1e-5 above)
    assert (got - exact).abs().max().item() > 1e-4
