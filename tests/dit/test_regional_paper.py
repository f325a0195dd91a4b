"""FlashDiff as the paper describes it: Otsu focus/context partition with proportional patch
counts, the uniform-grid baseline, the importance-change gate with forced reactivation,
the periodic (cap-only) schedule, and the probes: fused attention-mass reductions equal
the explicit attention matrices they replace."""

from __future__ import annotations

import pytest
import torch
from sakura.dit.attention import AttentionHook
from sakura.dit.model import TokenBatch
from sakura.dit.regional import (
    ImportanceGate,
    PeriodicGate,
    RegionalConfig,
    RegionalState,
    focus_context_partition,
    grid_partition,
    make_partition,
    otsu_threshold,
    run_regional,
)
from sakura.dit.regional_mmdit import generation_backend, grid_coords, regional_generate
from sakura.dit.sampler import schedule

from tests.dit.common import tiny_model, tiny_request
from tests.dit.test_regional import ScriptedBackend


def _between(v: torch.Tensor, thr: float) -> float:
    lo, hi = v[v <= thr].double(), v[v > thr].double()
    w0, w1 = len(lo) / len(v), len(hi) / len(v)
    return w0 * w1 * float(lo.mean() - hi.mean()) ** 2


# ----------------------------------------------------------------------------- partition


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_otsu_threshold_maximises_between_class_variance(seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.cat([torch.rand(30, generator=g), 2 + torch.rand(10, generator=g)])
    thr = otsu_threshold(v)
    s = v.sort().values
    best = max(_between(v, float((s[i] + s[i + 1]) / 2)) for i in range(len(s) - 1))
    assert _between(v, thr) == pytest.approx(best, rel=1e-9)
    assert 1 < thr < 2  # between the two modes
    assert otsu_threshold(torch.ones(7)) != otsu_threshold(torch.ones(7))  # flat: NaN


def test_focus_context_partition_shares_patches_in_proportion():
    coords = grid_coords(16)
    blob = (coords[:, 0] < 8) & (coords[:, 1] < 8)  # a salient quadrant: 64 of 256 tokens
    sal = torch.rand(256, generator=torch.Generator().manual_seed(0)) * 0.1 + blob * 1.0
    part = focus_context_partition(coords, sal, 8)
    assert part.count == 8 and part.focus == 2  # round(8 * 64 / 256)
    focus = set(torch.cat(part.patches[:2]).tolist())
    assert focus == set(torch.nonzero(blob).flatten().tolist())
    assert sorted(torch.cat(part.patches).tolist()) == list(range(256))
    assert sorted(part.sizes()) == [32] * 8  # each set cut into equal patches
    for p in part.patches[:2]:  # balanced bisection of a rectangle gives rectangles
        box = coords[p]
        h = box[:, 0].max() - box[:, 0].min() + 1
        w = box[:, 1].max() - box[:, 1].min() + 1
        assert h * w == len(p)
    assert part.explained == pytest.approx(1.0, abs=0.02)


def test_focus_context_keeps_one_patch_per_set_and_handles_flat_maps():
    coords = grid_coords(8)
    speck = torch.zeros(64)
    speck[[0, 9]] = 5.0  # 2 salient tokens: round(4 * 2 / 64) = 0, but a set gets >= 1
    part = focus_context_partition(coords, speck, 4)
    assert part.focus == 1 and sorted(part.patches[0].tolist()) == [0, 9]
    assert sorted(len(p) for p in part.patches[1:]) == [20, 21, 21]
    flat = focus_context_partition(coords, torch.ones(64), 4)
    assert flat.focus == 0 and sorted(flat.sizes()) == [16] * 4
    assert focus_context_partition(coords, speck, 1).count == 1
    # an irregular region (an edit's masked tokens)
    disc = coords[((coords[:, 0] - 3.5) ** 2 + (coords[:, 1] - 3.5) ** 2) < 9]
    p = focus_context_partition(disc, torch.rand(len(disc)), 3)
    assert sorted(torch.cat(p.patches).tolist()) == list(range(len(disc)))


@pytest.mark.parametrize("r,shape", [(4, (8, 8)), (6, (8, 5)), (2, (16, 8)), (3, (16, 5))])
def test_uniform_grid_partition(r, shape):
    coords = grid_coords(16)
    part = grid_partition(coords, torch.rand(256), r)
    assert part.count == r
    assert sorted(torch.cat(part.patches).tolist()) == list(range(256))
    for p in part.patches:
        box = coords[p]
        h = int(box[:, 0].max() - box[:, 0].min() + 1)
        assert h == shape[0] and abs(len(p) - shape[0] * shape[1]) <= shape[0]
    with pytest.raises(ValueError):
        make_partition("voronoi", coords, torch.rand(256), 4)


# ----------------------------------------------------------------------------- gates


def test_importance_gate_skips_small_relative_changes_and_forces_after_k():
    gate = ImportanceGate(3, eps=0.05, max_skips=2)
    gate.start(torch.tensor([1.0, 1.0, 2.0]))
    # patch 0 changes by 0.4 of the total 4.4: runs; the others change by < 5%
    d = gate.decide(torch.tensor([1.4, 1.0, 2.0]))
    assert d.active.tolist() == [True, False, False]
    assert d.weights[0].item() == pytest.approx(0.4 / 4.4, rel=1e-6)
    seq = [gate.decide(torch.tensor([1.4, 1.0, 2.0])).active.tolist() for _ in range(3)]
    # nothing changes any more: skipped, patches 1 and 2 forced after 2 skips
    assert seq == [[False, False, False], [False, True, True], [True, False, False]]
    # scale invariance: relative to the sum over all patches
    a, b = ImportanceGate(2, eps=0.1), ImportanceGate(2, eps=0.1)
    a.start(torch.tensor([1.0, 3.0]))
    b.start(torch.tensor([1.0, 3.0]) * 1e4)
    x = torch.tensor([1.5, 3.1])
    assert a.decide(x).active.tolist() == b.decide(x * 1e4).active.tolist() == [True, False]


def test_importance_gate_compares_with_the_last_run_so_slow_drift_reactivates():
    gate = ImportanceGate(2, eps=0.05, max_skips=10)
    gate.start(torch.tensor([1.0, 1.0]))
    acts = []
    for s in range(1, 6):  # patch 1 drifts by about 3% of the total per step
        acts.append(gate.decide(torch.tensor([1.0, 1.0 + 0.06 * s])).active.tolist())
    # it runs once the drift since its last run reaches 5%, without being forced
    assert [a[1] for a in acts] == [False, True, False, True, False]
    assert not any(a[0] for a in acts)
    # no probe (eps = 0): everything runs, references kept
    assert gate.decide(None).active.all()


@pytest.mark.parametrize("f", [0.25, 0.5, 0.75])
def test_periodic_gate_runs_the_requested_fraction_staggered(f):
    gate = PeriodicGate(4, skip_fraction=f, max_skips=10)
    log = torch.stack([gate.decide().active for _ in range(40)])
    assert 1 - float(log.float().mean()) == pytest.approx(f, abs=0.03)
    per_step = log.sum(1)
    assert per_step.max() - per_step.min() <= 1  # phases staggered: even load
    for p in range(4):  # evenly spaced: the longest skip run is ceil(1 / (1 - f)) - 1
        runs, cur = [], 0
        for a in log[:, p].tolist():
            cur = 0 if a else cur + 1
            runs.append(cur)
        assert max(runs) <= -(-1 // (1 - f)) - 1 + 1e-9


# ----------------------------------------------------------------------------- state


def test_state_probes_every_step_and_skips_the_patch_whose_importance_is_still():
    be = ScriptedBackend()
    steps = 10
    cfg = RegionalConfig(warmup=2, gate="importance", eps=0.01, max_skips=2, patches=2,
                         partition="otsu")
    ts = schedule(steps)
    st = RegionalState(cfg, be.coords, ts, torch.zeros(36, 2), be.text_tokens,
                       torch.tensor([False, True, False]), be.cost)
    run_regional(be, st)
    part = st.partition
    assert part.focus == 1  # the salient left half is the focus set
    left, right = 0, 1
    assert (be.coords[part.patches[left], 1] < 3).all()
    # one reference probe of the last warm-up step's latents, then one probe per step
    assert [s for s, _ in be.probed] == [2, 2, 3, 4, 5, 6, 7, 8, 9]
    assert be.probed[0][1] == pytest.approx(float(ts[1]))
    assert [t for _, t in be.probed[1:]] == pytest.approx([float(t) for t in ts[2:10]])
    log = st.stats.active_log
    assert all(left in a for a in log)  # its importance changes with t every step
    assert [right in a for a in log] == [False, False, True, False, False, True, False, False]
    assert st.stats.forced_patch_steps == 2 and st.stats.probes == 9
    assert st.stats.probe_macs == 45.0
    # the reuse error: the right half's velocity never changes, so reusing it cost nothing
    assert st.stats.reuse_error == pytest.approx(0.0)


def test_periodic_state_matches_a_requested_skipped_fraction():
    be = ScriptedBackend()
    cfg = RegionalConfig(warmup=2, gate="periodic", skip_fraction=0.5, patches=4)
    st = RegionalState(cfg, be.coords, schedule(10), torch.zeros(36, 2), 2, None, be.cost)
    run_regional(be, st)
    assert st.stats.skipped_fraction == pytest.approx(0.5)
    assert not be.probed  # no signal, no probe


# ----------------------------------------------------------------------------- fused probes


class ExplicitProbs(AttentionHook):
    """Plain attention with the probabilities materialised in ``blocks`` (the reference)."""

    def __init__(self, blocks):
        super().__init__("joint")
        self.blocks, self.probs = set(blocks), []

    def attend(self, block, q, k, v, layout):
        p = ((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5).softmax(-1)
        if block in self.blocks:
            self.probs.append(p[0].mean(0))
        return p @ v


@torch.no_grad()
def test_fused_probe_masses_equal_the_explicit_attention_matrices():
    model = tiny_model()
    req = tiny_request(model)
    be = generation_backend(model, req.txt, req.txt_uncond, 32, 2.0)
    x = torch.randn(64, model.cfg.patch_dim, generator=torch.Generator().manual_seed(0))
    T = model.cfg.text_tokens
    t = 0.7
    # saliency: image -> text mass of the warm-up probe (both branches run, cond measured)
    full = be.run_full(0, t, x, probe=True, want_kv=False)
    ref = ExplicitProbs(be.probe_blocks)
    model(TokenBatch(img=x[None].expand(2, -1, -1), img_pos=be.pos,
                     txt=be.txt, t=torch.full((2,), t)), ref)
    explicit = torch.stack(ref.probs).mean(0)
    assert torch.allclose(full.text_attn, explicit[T:, :T], atol=1e-5)
    assert full.probe_macs > 0
    # the gate's probe: patch self mass in block 0, cond branch only, forward cut short
    patches = list(make_partition("otsu", be.coords, torch.rand(64), 4).patches)
    pr = be.probe(3, t, x, patches, depth=1)
    ref = ExplicitProbs({0})
    model(TokenBatch(img=x[None], img_pos=be.pos, txt=req.txt, t=torch.full((1,), t)), ref)
    p0 = ref.probs[0]
    want = torch.stack([p0[T + p][:, T + p].sum() for p in patches])
    assert torch.allclose(pr.mass, want, atol=1e-5)
    assert pr.img_keys == 64
    full_cost = be.cost(64 + T, 64 + T)
    assert 0 < pr.macs < 0.25 * full_cost  # one block of one branch, not the model
    # separate patches measure their self mass in the call the same way
    res = be.run_patches(1, t, x, patches[:1], None)[0]
    ref = ExplicitProbs(be.probe_blocks)
    idx = patches[0]
    model(TokenBatch(img=x[idx][None].expand(2, -1, -1), img_pos=be.pos[idx], txt=be.txt,
                     t=torch.full((2,), t)), ref)
    pm = torch.stack(ref.probs).mean(0)
    assert res.self_mass == pytest.approx(float(pm[T:, T:].sum(-1).mean()), abs=1e-5)
    assert torch.isnan(torch.tensor(be.run_patches(1, t, x, patches[:1], None,
                                                   measure=False)[0].self_mass))


def test_regional_generation_with_each_gate_and_partition_runs_and_accounts_probes():
    model = tiny_model()
    req = tiny_request(model)
    for gate, part in [("paper", "otsu"), ("importance", "otsu"), ("drift", "cuts"),
                       ("periodic", "grid")]:
        timer: dict = {}
        img, st = regional_generate(model, req.txt, req.txt_uncond, 32, 3, 6, 2.0,
                                    RegionalConfig(warmup=2, gate=gate, partition=part,
                                                   patches=4, eps=None, skip_fraction=0.5),
                                    timer=timer)
        assert torch.isfinite(img).all() and st.partition.count == 4
        s = st.stats
        assert s.skipped_patch_steps > 0
        assert (s.probes > 0) == (gate != "periodic") == ("probe_s" in timer)
        assert s.probe_macs + s.saliency_macs == pytest.approx(s.probe_fraction * s.macs)


def test_fused_masses_chunk_wide_indicators_and_respect_the_mask():
    from sakura.dit.regional import fused_masses

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 10, 8, generator=g), torch.randn(2, 3, 30, 8, generator=g)
    ind = (torch.rand(30, 20, generator=g) > 0.7).float()  # 20 groups > head dim 8: 3 chunks
    mask = torch.rand(10, 30, generator=g) > 0.3
    mask[:, 0] = True
    p = ((q @ k.transpose(-1, -2)) / 8 ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
    want = (p[0] @ ind).mean(0)  # first batch row (the cond branch), mean over heads
    assert torch.allclose(fused_masses(q, k, ind, mask), want, atol=1e-5)
