"""Stale reuse (dit/stale.py): a late step runs on each block's last K/V, up to an age."""

from __future__ import annotations

import torch
from sakura.dit.cache import StepLate
from sakura.dit.editing import cached_edit, template_run
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


def test_late_steps_reuse_the_last_kv_up_to_the_age_cap_then_compute_locally():
    model, tpl, run, req = _world()
    late = Late(run.cache, range(3, 10))  # steps 3-9 late; the cap allows 3 steps of age
    out = cached_edit(model, tpl, run.geometry, late, req)
    # the same edit built by hand: steps 3-5 on step 2's K/V, 6-9 with every token
    want = cached_edit(model, tpl, run.geometry,
                       Mapped(run.cache, {s: 2 for s in range(3, 6)}, local=range(6, 10)),
                       req, stale_max_age=0)
    assert torch.equal(out, want)
    assert [s for s, _, _ in late.told] == [3, 4, 5]
    n = model.cfg.num_blocks
    assert all(src == dict.fromkeys(range(n), 2) and t > 0 for _, src, t in late.told)
    assert STALE_MAX_AGE == 3


def test_reuse_off_computes_every_late_step_locally():
    model, tpl, run, req = _world()
    late = Late(run.cache, range(3, 10))
    off = cached_edit(model, tpl, run.geometry, late, req, stale_max_age=0)
    assert late.told == []
    on = cached_edit(model, tpl, run.geometry, Late(run.cache, range(3, 10)), req)
    assert not torch.equal(off, on)


def test_no_reuse_before_any_kv_arrived():
    # an outage from the start: nothing to reuse, every step is computed locally
    model, tpl, run, req = _world(steps=4)
    late = Late(run.cache, range(4))
    out = cached_edit(model, tpl, run.geometry, late, req)
    assert late.told == []
    want = cached_edit(model, tpl, run.geometry, Late(run.cache, range(4)), req,
                       stale_max_age=0)
    assert torch.equal(out, want)

