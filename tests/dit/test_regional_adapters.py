"""FlashDiff on the diffusers adapters (tiny seeded FLUX.2 and SD3.5 configs): the fused
probes equal the explicit attention matrices, and the paper's gate and partition drive
an adapter end to end."""

from __future__ import annotations

import pytest
import torch
from sakura.dit.adapters.hook import AdapterHook
from sakura.dit.adapters.regional import AdapterRegional, regional_generate
from sakura.dit.adapters.tiny import tiny_adapter, tiny_request, tiny_spec, tiny_template
from sakura.dit.attention import IMG, TXT
from sakura.dit.regional import RegionalConfig, make_partition


class _Explicit(AdapterHook):
    """The adapters' own probability path (materialised), recorded in ``blocks``."""

    def __init__(self, blocks, **kw):
        super().__init__(**kw)
        self.blocks, self.probs = set(blocks), []

    def attend(self, block, q, k, v, layout):
        self.needs_probs = block in self.blocks
        return super().attend(block, q, k, v, layout)

    def on_probs(self, block, probs, q_segs, k_segs):
        def idx(segs, role):
            at, out = 0, []
            for r, n in segs:
                if r == role:
                    out.append(torch.arange(at, at + n))
                at += n
            return torch.cat(out)

        p = probs[0].float().mean(0)
        self.probs.append(p[idx(q_segs, IMG)][:, torch.cat([idx(k_segs, TXT), idx(k_segs, IMG)])])


@pytest.mark.parametrize("kind", ["flux2", "sd3.5"])
def test_adapter_fused_probes_equal_explicit_attention(kind):
    a = tiny_adapter(kind)
    spec = tiny_spec(kind)
    tpl = tiny_template(a, spec, steps=4)
    req = tiny_request(a, spec)
    branches = a._branches(tpl, req, cache_refs=True)
    rows = torch.arange(tpl.tokens)
    be = AdapterRegional(a, branches, tpl.guidance, tpl.grid, rows)
    x = a.edit_noise(tpl, 3)[0]
    t = 0.6
    T = be.text_tokens
    full = be.run_full(0, t, x, probe=True, want_kv=False)
    ref = _Explicit(be.probe_blocks, heads=a.heads)
    a.velocity(x[None], rows, tpl.grid, torch.tensor(t) * 1000, branches[0], ref)
    explicit = torch.stack(ref.probs).mean(0)
    assert torch.allclose(full.text_attn, explicit[:, :T], atol=1e-5)
    patches = list(make_partition("otsu", be.coords, torch.rand(tpl.tokens), 3).patches)
    pr = be.probe(2, t, x, patches, depth=1)
    ref = _Explicit({min(be.probe_blocks)}, heads=a.heads)
    a.velocity(x[None], rows, tpl.grid, torch.tensor(t) * 1000, branches[0], ref)
    img = ref.probs[0][:, T:]
    want = torch.stack([img[p][:, p].sum() for p in patches])
    assert torch.allclose(pr.mass, want, atol=1e-5)
    assert 0 < pr.macs < 0.5 * be.cost(tpl.tokens + T, tpl.tokens + T) / len(branches)


@pytest.mark.parametrize("kind", ["flux2", "sd3.5"])
def test_adapter_generation_with_the_paper_gate_skips_more_as_eps_grows(kind):
    a = tiny_adapter(kind)
    spec = tiny_spec(kind)
    tpl = tiny_template(a, spec, steps=6)
    gen = type(tpl)(tpl.latents, tpl.grid, torch.ones_like(tpl.mask), tpl.cond, tpl.seed,
                    tpl.steps, tpl.guidance)
    req = tiny_request(a, spec)
    full = a.full_edit(gen, req)
    exact, st0 = regional_generate(a, gen, req, RegionalConfig(warmup=2, eps=0.0, patches=4))
    assert st0.stats.skipped_patch_steps == 0
    assert (exact - full).abs().max().item() <= 1e-4  # joint, nothing skipped = full
    skipped, compute = [], []
    for eps in (0.01, 0.05, 1.0):
        x, st = regional_generate(a, gen, req, RegionalConfig(warmup=2, eps=eps, patches=4))
        assert torch.isfinite(x).all() and st.stats.probes == 5
        skipped.append(st.stats.skipped_fraction)
        compute.append(st.stats.compute_fraction)
    # (random weights: quality is measured by the bench, not asserted here)
    assert skipped == sorted(skipped) and skipped[-1] > 0
    assert compute == sorted(compute, reverse=True) and compute[-1] < 1
