"""FlashDiff regional execution: Otsu partition, R search, the gate, the state machine, and
the MMDiT backend (exactness with a full warm-up, packing = separate execution)."""

from __future__ import annotations

import itertools

import pytest
import torch
from sakura.dit.editing import cached_edit, template_run
from sakura.dit.regional import (
    FullResult,
    KVStore,
    PatchGate,
    PatchResult,
    ProbeResult,
    RegionalConfig,
    RegionalState,
    choose_partition,
    explained_variance,
    otsu_partition,
    otsu_split,
    run_probes,
    run_regional,
    salient_token_mask,
)
from sakura.dit.regional_mmdit import (
    generation_backend,
    grid_coords,
    regional_edit,
    regional_generate,
)
from sakura.dit.sampler import generate, schedule

from tests.dit.common import tiny_model, tiny_request, tiny_template


def _between(sal: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> float:
    s = sal.double()
    n = len(s)
    w0, w1 = len(left) / n, len(right) / n
    return w0 * w1 * float(s[left].mean() - s[right].mean()) ** 2


def _brute_force_best(coords, sal, lo, hi) -> float:
    best = -1.0
    for axis in (0, 1):
        for c in sorted(set(coords[:, axis].tolist()))[1:]:
            left = torch.nonzero(coords[:, axis] < c).flatten()
            right = torch.nonzero(coords[:, axis] >= c).flatten()
            if lo <= len(left) <= hi:
                best = max(best, _between(sal, left, right))
    return best


# ----------------------------------------------------------------------------- Otsu


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_otsu_split_is_optimal_among_balanced_cuts(seed):
    g = torch.Generator().manual_seed(seed)
    coords = grid_coords(9)
    sal = torch.rand(81, generator=g) ** 3
    sal[coords[:, 1] < 3] += 0.7  # a salient band plus noise
    sp = otsu_split(coords, sal, 0.5, 0.4)
    lo, hi = 0.5 * 81 - 0.4 * 0.5 * 81, 0.5 * 81 + 0.4 * 0.5 * 81
    assert lo <= len(sp.left) <= hi
    assert _between(sal, sp.left, sp.right) == pytest.approx(_brute_force_best(coords, sal, lo, hi),
                                                             rel=1e-9)
    assert sp.between_var == pytest.approx(_between(sal, sp.left, sp.right), rel=1e-9)
    # every token on exactly one side, and the sides are separated by the cut
    assert sorted(torch.cat([sp.left, sp.right]).tolist()) == list(range(81))
    assert coords[sp.left, sp.axis].max() < sp.cut < coords[sp.right, sp.axis].min()


def test_otsu_split_finds_the_salient_edge():
    coords = grid_coords(10)
    sal = (coords[:, 1] < 4).double()  # columns 0-3 salient: 40% of the tokens
    sp = otsu_split(coords, sal, 0.5, 0.25)
    assert sp.axis == 1 and sp.cut == 3.5
    assert set(sp.left.tolist()) == set(torch.nonzero(sal > 0).flatten().tolist())


def test_otsu_split_respects_balance_even_against_a_better_cut():
    coords = grid_coords(10)
    sal = (coords[:, 1] < 2).double()  # the edge is at 20%: outside the allowed range
    sp = otsu_split(coords, sal, 0.5, 0.25)
    assert 37.5 <= len(sp.left) <= 62.5
    assert sp.axis == 1 and sp.cut == 3.5  # as close to the edge as the balance allows


def test_uniform_saliency_cuts_equal_halves():
    coords = grid_coords(8)
    sp = otsu_split(coords, torch.ones(64), 0.5, 0.25)
    assert len(sp.left) == 32 and len(sp.right) == 32


def test_recursive_partition_isolates_a_salient_quadrant():
    coords = grid_coords(8)
    square = (coords[:, 0] < 4) & (coords[:, 1] < 4)
    sal = square.double() * 5 + 1
    part = otsu_partition(coords, sal, 4)
    assert sorted(part.sizes()) == [16, 16, 16, 16]
    assert any(set(p.tolist()) == set(torch.nonzero(square).flatten().tolist())
               for p in part.patches)
    assert part.explained == pytest.approx(1.0)


@pytest.mark.parametrize("r", [2, 3, 4, 5, 6, 8])
def test_partition_covers_once_balanced_and_rectangular(r):
    g = torch.Generator().manual_seed(r)
    coords = grid_coords(16)
    sal = torch.rand(256, generator=g)
    part = otsu_partition(coords, sal, r, balance_tol=0.25)
    allidx = torch.cat(part.patches)
    assert sorted(allidx.tolist()) == list(range(256))  # disjoint and complete
    unit = 256 / r
    # powers of two always fit the tolerance on a 16x16 grid; other counts can reach a
    # rectangle whose row/column granularity leaves no cut in range (then the most
    # balanced cut is taken)
    tol = 0.25 if r in (2, 4, 8) else 0.5
    for p in part.patches:
        assert (1 - tol) * unit - 1e-9 <= len(p) <= (1 + tol) * unit + 1e-9
        box = coords[p]
        h = box[:, 0].max() - box[:, 0].min() + 1
        w = box[:, 1].max() - box[:, 1].min() + 1
        assert h * w == len(p)  # axis-aligned cuts of a full grid give rectangles
    assert 0 <= part.explained <= 1
    assert part.explained == pytest.approx(explained_variance(sal, part.patches))


def test_partition_of_an_irregular_region_masked_tokens():
    coords = grid_coords(12)
    keep = ((coords[:, 0] - 5.5) ** 2 + (coords[:, 1] - 5.5) ** 2) < 20  # a disc
    region = coords[keep]
    sal = torch.rand(len(region), generator=torch.Generator().manual_seed(0))
    part = otsu_partition(region, sal, 3)
    assert sorted(torch.cat(part.patches).tolist()) == list(range(len(region)))


def test_choose_partition_bounded_search():
    coords = grid_coords(16)
    flat = choose_partition(coords, torch.ones(256), (2, 4, 8), overhead_tokens=16)
    assert flat.count == 2  # nothing to separate: the fewest patches
    q = (coords[:, 0] >= 8).long() * 2 + (coords[:, 1] >= 8).long()
    four = torch.tensor([0.1, 1.0, 3.0, 7.0])[q]
    pick = choose_partition(coords, four, (2, 4, 8), overhead_tokens=16)
    assert pick.count == 4 and pick.explained == pytest.approx(1.0)
    assert [r for r, _ in pick.searched] == [2, 4, 8]
    # the bound: never more patches than n / min_patch_tokens
    small = choose_partition(coords[:12], torch.rand(12), (2, 4, 8), min_patch_tokens=4)
    assert max(r for r, _ in small.searched) == 2


# ----------------------------------------------------------------------------- gate


def test_gate_skips_below_eps_and_forces_after_k_skips():
    gate = PatchGate(3, eps=0.5, max_skips=2)
    imp = torch.ones(3)
    change = torch.tensor([1.0, 1.0, 0.1])  # weights 1.43, 1.43, 0.14
    seq = [gate.decide(imp, change) for _ in range(7)]
    assert [d.active.tolist() for d in seq] == [
        [True, True, False], [True, True, False], [True, True, True],  # forced 3rd
        [True, True, False], [True, True, False], [True, True, True], [True, True, False]]
    assert [bool(d.forced[2]) for d in seq] == [False, False, True, False, False, True, False]
    assert seq[0].weights.mean().item() == pytest.approx(1.0)


def test_running_normalisation_skips_more_in_quiet_steps():
    step, run = PatchGate(2, eps=1.0, max_skips=9), PatchGate(2, eps=1.0, max_skips=9,
                                                                normalize="running")
    imp = torch.ones(2)
    loud, quiet = torch.tensor([4.0, 3.0]), torch.tensor([0.4, 0.3])
    assert step.decide(imp, loud).active.tolist() == run.decide(imp, loud).active.tolist() \
        == [True, False]
    # a quiet step: per-step normalisation still runs the larger one; against the run's
    # mean both are small and skip
    assert step.decide(imp, quiet).active.tolist() == [True, False]
    assert run.decide(imp, quiet).active.tolist() == [False, False]
    # a loud step after quiet ones: everything runs
    assert run.decide(imp, torch.tensor([5.0, 4.5])).active.tolist() == [True, True]


def test_gate_weights_are_relative_and_reactivate_on_change():
    a, b = PatchGate(2, eps=0.5, max_skips=10), PatchGate(2, eps=0.5, max_skips=10)
    imp = torch.tensor([2.0, 1.0])
    c = torch.tensor([1.0, 0.2])
    assert a.decide(imp, c).active.tolist() == b.decide(imp * 1e3, c * 1e-4).active.tolist()
    assert a.decide(imp, c).active.tolist() == [True, False]
    # the low-importance patch's change grows: it comes back without being forced
    d = a.decide(imp, torch.tensor([1.0, 3.0]))
    assert d.active.tolist() == [True, True] and not d.forced.any()
    # all-zero scores: nothing to compare, everything runs
    assert a.decide(torch.zeros(2), torch.zeros(2)).active.all()


# ----------------------------------------------------------------------------- state


class ScriptedBackend:
    """A model stand-in with scripted velocities and probes: the left half (salient) keeps
    changing, the right half does not. Attention is uniform, except that the probed
    self-attention importance of the left half grows with the step."""

    text_tokens = 2

    def __init__(self, grid: int = 6):
        self.coords = grid_coords(grid)
        self.n = grid * grid
        self.calls: list[tuple[int, list[int]]] = []
        self.probed: list[tuple[int, float]] = []

    def _left(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.coords[idx, 1] < 3).float()

    def _v(self, step: int, idx: torch.Tensor) -> torch.Tensor:
        return torch.ones(len(idx), 2) + self._left(idx)[:, None] * step

    def run_full(self, step, t, x, probe, want_kv):
        n = self.n
        ta = torch.zeros(n, 3)
        ta[:, 1] = self._left(torch.arange(n))  # left half salient
        kv = KVStore(torch.zeros(1, 1, 1, n, 1), torch.zeros(1, 1, 1, n, 1)) if want_kv else None
        return FullResult(self._v(step, torch.arange(n)), kv, ta if probe else None, n)

    def run_patches(self, step, t, x, patches, context, joint=False, measure=True):
        self.calls.append((step, [len(p) for p in patches]))
        return [PatchResult(self._v(step, p), torch.full((1, 1, 1, len(p), 1), float(step)),
                            torch.zeros(1, 1, 1, len(p), 1),
                            len(p) / self.n if measure else float("nan"), self.n)
                for p in patches]

    def probe(self, step, t, x, patches, depth=None):
        self.probed.append((step, t))
        # uniform attention: a patch's queries put |p| / n on it (summed: |p|^2 / n)
        mass = torch.tensor([len(p) ** 2 / self.n * (1 + 2 * t * float(self._left(p).mean()))
                             for p in patches])
        return ProbeResult(mass, self.n, macs=5.0)

    def cost(self, queries, keys):
        return float(queries * 100 + queries * keys)


def test_state_skips_static_patch_reuses_velocity_and_forces_it_back():
    """The drift gate (the named alternative): the static patch's velocity never changes."""
    be = ScriptedBackend()
    steps = 10
    cfg = RegionalConfig(warmup=2, gate="drift", eps=0.5, max_skips=2, patches=2)
    st = RegionalState(cfg, be.coords, schedule(steps), torch.zeros(36, 2), be.text_tokens,
                       torch.tensor([False, True, False]), be.cost)
    run_regional(be, st)
    part = st.partition
    assert part.count == 2
    # the Otsu cut separates the changing (salient) left half from the static right half
    left = next(i for i, p in enumerate(part.patches) if (be.coords[p, 1] < 3).all())
    right = 1 - left
    log = st.stats.active_log
    assert all(left in a for a in log)
    assert [right in a for a in log] == [False, False, True, False, False, True, False, False]
    assert st.stats.skipped_patch_steps == 6 and st.stats.executed_patch_steps == 10
    assert st.stats.forced_patch_steps == 2
    # skipped patches reused their last velocity (1 everywhere on the right): x = -sum(dt)
    assert torch.allclose(st.x[part.patches[right]], torch.full((18, 2), -1.0), atol=1e-6)
    # the store took the executed patches' K/V only, after each step
    assert st.store.k[0, 0, 0, part.patches[right]].unique().tolist() == [7.0]
    assert st.store.k[0, 0, 0, part.patches[left]].unique().tolist() == [9.0]
    assert 0 < st.stats.compute_fraction < 1


def test_state_refuses_out_of_order_or_partial_results():
    be = ScriptedBackend()
    st = RegionalState(RegionalConfig(warmup=2, eps=0.01, patches=2), be.coords, schedule(5),
                       torch.zeros(36, 2), 2, None, be.cost)
    with pytest.raises(RuntimeError):
        st.apply_full(1, be.run_full(1, 0.0, st.x, False, False))
    for s in range(2):
        st.apply_full(s, be.run_full(s, 0.0, st.x, s == 1, s == 1))
    with pytest.raises(RuntimeError, match="probes"):
        st.decide(2)  # the importance gate decides on this step's probe
    with pytest.raises(RuntimeError):
        st.apply_probes(2, {"now": be.probe(2, 0.6, st.x, list(st.partition.patches))})
    run_probes(be, st, 2)
    ids = st.decide(2).active_ids()
    outs = be.run_patches(2, 0.0, st.x, [st.partition.patches[i] for i in ids], st.store)
    assert ids
    with pytest.raises(RuntimeError):
        st.apply_patches(2, {})  # a missing patch output is refused
    st.apply_patches(2, dict(zip(ids, outs)))
    with pytest.raises(RuntimeError):
        st.apply_patches(2, dict(zip(ids, outs)))  # a step is applied exactly once


# ----------------------------------------------------------------------------- MMDiT backend


def test_full_warmup_is_exactly_generate_and_cached_edit():
    model = tiny_model()
    req = tiny_request(model)
    ref = generate(model, req.txt, req.txt_uncond, 32, seed=3, steps=4, guidance=2.0)
    img, st = regional_generate(model, req.txt, req.txt_uncond, 32, 3, 4, 2.0,
                                RegionalConfig(warmup=4))
    assert torch.equal(img, ref) and st.partition is None
    tpl = tiny_template(model, steps=4)
    run = template_run(model, tpl)
    ce = cached_edit(model, tpl, run.geometry, run.cache, req)
    im2, _ = regional_edit(model, tpl, run.geometry, run.cache, req, RegionalConfig(warmup=4))
    assert torch.equal(im2, ce)


def test_packed_patches_equal_separate_execution():
    model = tiny_model()
    req = tiny_request(model)
    be = generation_backend(model, req.txt, req.txt_uncond, 32, 2.0)
    x = torch.randn(64, model.cfg.patch_dim, generator=torch.Generator().manual_seed(0))
    full = be.run_full(0, 0.7, x, probe=True, want_kv=True)
    assert full.text_attn.shape == (64, model.cfg.text_tokens)
    assert (full.text_attn.sum(-1) < 1).all() and (full.text_attn >= 0).all()
    part = otsu_partition(be.coords, torch.rand(64), 4)
    patches = list(part.patches)
    packed = be.run_patches(1, 0.6, x, patches, full.kv)
    for i, p in enumerate(patches):
        alone = be.run_patches(1, 0.6, x, [p], full.kv)[0]
        assert torch.allclose(packed[i].velocity, alone.velocity, atol=2e-5)
        assert torch.allclose(packed[i].k, alone.k, atol=2e-5)
        assert packed[i].self_mass == pytest.approx(alone.self_mass, abs=1e-5)
    pair = be.run_patches(1, 0.6, x, [patches[2], patches[0]], full.kv)
    assert torch.allclose(pair[1].velocity, packed[0].velocity, atol=2e-5)
    # with the whole region as one patch and a current context, this is a full step
    one = be.run_patches(0, 0.7, x, [torch.arange(64)], full.kv)[0]
    assert torch.allclose(one.velocity, full.velocity, atol=2e-5)


def test_joint_execution_runs_active_patches_together():
    model = tiny_model()
    req = tiny_request(model)
    be = generation_backend(model, req.txt, req.txt_uncond, 32, 2.0)
    x = torch.randn(64, model.cfg.patch_dim, generator=torch.Generator().manual_seed(0))
    full = be.run_full(0, 0.7, x, probe=False, want_kv=True)
    patches = list(otsu_partition(be.coords, torch.rand(64), 4).patches)
    # every patch together with a current store = the full step (tokens in another order)
    alljoint = be.run_patches(0, 0.7, x, patches, full.kv, joint=True)
    for p, r in zip(patches, alljoint):
        assert torch.allclose(r.velocity, full.velocity[p], atol=2e-5)
        assert torch.allclose(r.k, full.kv.k[:, :, :, p], atol=2e-5)
        assert r.img_keys == 64
    # two patches jointly: they see each other fresh, the rest from the store
    two = be.run_patches(1, 0.6, x, [patches[1], patches[3]], full.kv, joint=True)
    sep = be.run_patches(1, 0.6, x, [patches[1], patches[3]], full.kv, joint=False)
    assert not torch.allclose(two[0].velocity, sep[0].velocity, atol=1e-6)
    assert float((two[0].velocity - sep[0].velocity).abs().max()) < 0.05
    # with eps = 0 nothing is skipped and joint regional execution is full execution
    ref = generate(model, req.txt, req.txt_uncond, 32, seed=3, steps=5, guidance=2.0)
    img, st = regional_generate(model, req.txt, req.txt_uncond, 32, 3, 5, 2.0,
                                RegionalConfig(warmup=2, eps=0.0, patches=4))
    assert float((img - ref).abs().max()) < 1e-4
    s = st.stats  # the model's compute is the full step's; the probes come on top
    assert (s.macs - s.probe_macs - s.saliency_macs) / s.full_macs == pytest.approx(1.0)
    assert 0 < s.probe_fraction < 0.05


def test_stale_context_beats_naive_patches_and_gate_saves_compute():
    model = tiny_model()
    req = tiny_request(model)
    ref = generate(model, req.txt, req.txt_uncond, 32, seed=3, steps=6, guidance=2.0)
    errs = {}
    for ctx in ("stale", "none"):
        img, st = regional_generate(model, req.txt, req.txt_uncond, 32, 3, 6, 2.0,
                                    RegionalConfig(warmup=2, eps=0.0, patches=4, context=ctx,
                                                   execution="separate"))
        errs[ctx] = float((img - ref).abs().mean())
        assert st.stats.skipped_fraction == 0
    assert errs["stale"] < 0.5 * errs["none"]
    img, st = regional_generate(model, req.txt, req.txt_uncond, 32, 3, 6, 2.0,
                                RegionalConfig(warmup=2, eps=1.0, max_skips=1, patches=4))
    assert 0 < st.stats.skipped_fraction <= 0.5  # max_skips=1: at most every other step
    assert st.stats.compute_fraction < 1


def test_salient_tokens_exclude_function_words(text_encoder):
    tok = text_encoder.tokenizer
    prompt = "people & body: a man of the technologist: light skin tone"
    mask = salient_token_mask(tok, prompt, 16)
    ids = tok(prompt.lower(), padding="max_length", truncation=True, max_length=16)["input_ids"]
    words = tok.convert_ids_to_tokens(ids)
    chosen = {w for w, m in zip(words, mask.tolist()) if m}
    assert {"people", "body", "man", "light", "skin", "tone"} <= chosen
    assert not chosen & {"&", ":", "a", "of", "the", "[CLS]", "[SEP]", "[PAD]"}
    # word pieces follow their word
    for i, w in enumerate(words):
        if w.startswith("##"):
            assert mask[i] == mask[i - 1]
    only_function = salient_token_mask(tok, "of the", 16)
    assert only_function.sum() == 2  # falls back to every non-special token


def test_edit_region_runs_regionally_inside_the_mask():
    model = tiny_model()
    req = tiny_request(model)
    tpl = tiny_template(model, steps=6)
    run = template_run(model, tpl)
    ce = cached_edit(model, tpl, run.geometry, run.cache, req)
    img, st = regional_edit(model, tpl, run.geometry, run.cache, req,
                            RegionalConfig(warmup=2, eps=0.8, max_skips=2, patches=3))
    assert st.partition.count == 3
    assert sum(st.partition.sizes()) == len(run.geometry.masked)
    outside = ~tpl.mask
    assert torch.equal(img[:, outside], tpl.image[:, outside])
    assert float((img - ce).abs().max()) < 0.2
    combos = set(itertools.chain.from_iterable(st.stats.active_log))
    assert combos <= {0, 1, 2}
