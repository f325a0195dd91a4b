"""Layer-wise offload returns the FP16 cache exactly, with and without prefetch."""

from __future__ import annotations

import torch
from sakura.dit.editing import cached_edit, template_run
from sakura.dit.offload import OffloadedCache

from tests.dit.common import tiny_model, tiny_request, tiny_template


def test_offloaded_cache_matches_fp16_cache_in_an_edit():
    model = tiny_model()
    tpl = tiny_template(model)
    run = template_run(model, tpl)
    req = tiny_request(model)
    exact16 = cached_edit(model, tpl, run.geometry, run.cache.to_fp16_exact(), req)
    for prefetch in (False, True):
        with OffloadedCache(run.cache, prefetch=prefetch) as off:
            k, v = off.get(2, 1)
            assert torch.equal(k, run.cache.keys[2, 1].half().float())
            out = cached_edit(model, tpl, run.geometry, off, req)
            assert torch.equal(out, exact16)
            # every block read once (prefetch never reads twice)
            assert off.reads == 1 + tpl.steps * model.cfg.num_blocks
