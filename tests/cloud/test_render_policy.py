"""The render engine's priorities and online policy: priority classes, step-boundary
preemption by the benefit-vs-switch-cost rule (pure scheduler), the online patch-count
search and the low-load quality mode (pure), and both live in the engine: a high-priority
request overtakes low ones at their step boundaries, a lone request runs in the quality
mode and equals full execution, R comes from the search; regional execution of a
diffusers checkpoint (tiny FLUX.2) through the engine equals the single-process result."""

from __future__ import annotations

import pytest
import torch
from sakura.cloud.render import RenderEngine
from sakura.cloud.render_api import EngineConfig, RenderError, RenderRequest
from sakura.cloud.render_policy import PatchCountSearch, quality_mode
from sakura.cloud.render_sched import PATCH, PROBE, WARMUP, Scheduler, Task, TaskKey
from sakura.dit.regional import RegionalConfig
from sakura.dit.sampler import generate
from sakura.dit.weights import save_model

from tests.cloud.test_render import GUIDANCE, _model


def _task(rid, step, patch, kind, cost=10.0, cls=1, gang=False):
    return Task(TaskKey(rid, step, patch), kind, rid, cost, gang=gang, cls=cls)


# ----------------------------------------------------------------------------- scheduler


def test_classes_order_before_kinds_and_arrival():
    s = Scheduler(capacity=1e9)
    s.add_worker(0)
    s.add(_task(0, 3, 0, PATCH, cls=2))
    s.add(_task(1, 0, -1, WARMUP, cls=1))
    s.add(_task(2, 5, 1, PATCH, cls=0))
    s.add(_task(3, 2, -2, PROBE, cls=0))
    order = [t.key for g in s.place() for t in g.tasks]
    assert order == [TaskKey(3, 2, -2), TaskKey(2, 5, 1), TaskKey(1, 0, -1), TaskKey(0, 3, 0)]


def _preemption_case(c_low: float, transfer_high: float, preempt="benefit"):
    """Worker 0 runs low request 1 (its state is there); high request 2 is new to it."""
    def transfer(task, w):
        return 0.0 if task.key.rid == 1 else transfer_high
    s = Scheduler(capacity=1e9, transfer=transfer, group_overhead=0.0, preempt=preempt)
    s.add_worker(0)
    s.add(_task(1, 4, 0, PATCH, cost=c_low, cls=2))
    s.add(_task(2, 0, -1, WARMUP, cost=100.0, cls=0))
    return s, [g.tasks[0].key.rid for g in s.place()]


def test_preemption_when_the_benefit_outweighs_the_switch_cost():
    # Benefit = W_high * c_low = 4 * 60 = 240 > SwitchCost = W_low * (100 + 10) = 110
    s, order = _preemption_case(c_low=60.0, transfer_high=10.0)
    assert order == [2, 1] and s.stats.preemptions == 1 and s.stats.kept == 0
    # Benefit = 4 * 20 = 80 < SwitchCost = 1 * (100 + 10): the low request keeps its
    # worker for one more step (a cheap step is not worth a switch)
    s, order = _preemption_case(c_low=20.0, transfer_high=10.0)
    assert order == [1, 2] and s.stats.kept == 1
    # the switch cost counts: moving the high request's state tips the balance
    assert _preemption_case(c_low=30.0, transfer_high=10.0)[1] == [2, 1]    # 120 > 110
    assert _preemption_case(c_low=30.0, transfer_high=30.0)[1] == [1, 2]    # 120 < 130
    # strict: the higher class always goes first
    assert _preemption_case(c_low=20.0, transfer_high=10.0, preempt="strict")[1] == [2, 1]


def test_no_preemption_question_when_the_high_request_runs_where_its_state_is():
    def transfer(task, w):
        return 0.0 if (task.key.rid, w) in {(1, 0), (2, 1)} else 50.0
    s = Scheduler(capacity=1e9, transfer=transfer, preempt="benefit")
    s.add_worker(0)
    s.add_worker(1)
    s.add(_task(1, 4, 0, PATCH, cost=5.0, cls=2))
    s.add(_task(2, 4, 0, PATCH, cost=100.0, cls=0))
    groups = s.place()
    assert [(g.tasks[0].key.rid, g.worker) for g in groups] == [(2, 1), (1, 0)]
    assert s.stats.preemptions == s.stats.kept == 0


# ----------------------------------------------------------------------------- policy


def test_patch_count_search_descends_a_unimodal_cost_and_stops_at_its_minimum():
    """Bounded descent: from the middle R over its neighbours toward the lower score,
    never trying the candidates past the minimum."""
    cost = {2: 1.6, 4: 1.3, 6: 1.1, 8: 1.0, 12: 1.2, 16: 1.5}  # unimodal, minimum at 8
    s = PatchCountSearch(candidates=(16, 2, 4, 6, 8, 12), explore_every=0, quality_weight=0)
    assert s.candidates == (2, 4, 6, 8, 12, 16)
    for _ in range(12):
        r = s.choose()
        s.observe(r, cost[r], 0.0)
    assert s.to_dict()["current"] == 8
    assert set(s.obs) == {4, 6, 8, 12}  # from 6: its neighbours, then 8's other one
    assert s.history[-4:] == [8] * 4
    with pytest.raises(ValueError):
        PatchCountSearch(candidates=(2, 4), start=3)


def test_patch_count_search_explores_then_exploits_the_best_score():
    s = PatchCountSearch(candidates=(2, 4, 8), trials=2, explore_every=5, quality_weight=1.0)
    first = [s.choose() for _ in range(6)]
    assert sorted(first) == [2, 2, 4, 4, 8, 8]  # every candidate tried twice, round robin
    truth = {2: (1.0, 0.30), 4: (0.8, 0.10), 8: (0.9, 0.05)}  # service s/step, reuse error
    for r in first:
        s.observe(r, *truth[r])
    sc = s.scores()
    # score = service / best service * (1 + error): 4 -> 1.1, 8 -> 1.18, 2 -> 1.625
    assert sc[4] == pytest.approx(1.1) and min(sc, key=sc.get) == 4
    picks = [s.choose() for _ in range(8)]
    assert picks.count(4) >= 6  # exploitation, with a periodic re-try of another candidate
    assert set(picks) - {4}
    # a slower workload for R=4 moves the choice
    for _ in range(16):
        s.observe(4, 2.0, 0.10)
    assert min(s.scores(), key=s.scores().get) == 8
    with pytest.raises(ValueError):
        PatchCountSearch(candidates=())


def test_quality_mode_only_under_low_load():
    assert quality_mode(1, 2, 0.5) and not quality_mode(2, 2, 0.5) and quality_mode(0, 2, 0.5)
    assert not quality_mode(1, 2, 0.0)


# ----------------------------------------------------------------------------- live engine

STEPS, SIZE = 6, 32


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    model = _model()
    path = tmp_path_factory.mktemp("policy") / "tiny.safetensors"
    save_model(model, path)
    return model, str(path)


def test_lone_request_runs_in_quality_mode_and_equals_full_execution(weights, text_encoder):
    model, path = weights
    cfg = EngineConfig(workers=2, weights=path, regional=RegionalConfig(warmup=2, eps=0.05),
                       quality_eps=0.0, low_load=0.5)
    with RenderEngine(cfg, text_encoder) as eng:
        req = eng.prepare(RenderRequest(prompt="food: red apple", seed=4, steps=STEPS,
                                        size=SIZE, guidance=GUIDANCE))
        res = eng.submit(req).result(timeout=120)
        full = generate(model, req.txt, req.txt_uncond, SIZE, 4, STEPS, GUIDANCE)[0]
        # one request on two workers: low load, every patch every step, jointly = full
        assert res.stats["quality_steps"] == STEPS - 2
        assert res.stats["skipped_patch_steps"] == 0
        assert float((res.image - full).abs().max()) < 1e-4
        # R came from the online search
        assert res.stats["patches_searched"] and res.stats["patches"] in (2, 4, 6, 8)
        m = eng.metrics()["patch_search"]
        # a request run in the quality mode is no observation of the gated cost
        assert m["choices"] == 1 and sum(m["observations"].values()) == 0


def test_high_priority_overtakes_low_priority_requests(weights, text_encoder):
    _, path = weights
    cfg = EngineConfig(workers=1, weights=path, quality_eps=None, capacity_rows=50,
                       regional=RegionalConfig(warmup=2, eps=0.01))
    with RenderEngine(cfg, text_encoder) as eng:
        base = RenderRequest(prompt="animals & nature: dog face", steps=STEPS, size=SIZE,
                             guidance=GUIDANCE)
        # prompts encoded first, so that the five submissions follow each other at once
        reqs = [eng.prepare(RenderRequest(**{**base.__dict__, "seed": i, "priority": p}))
                for i, p in enumerate(["low"] * 4 + ["high"])]
        futs = [eng.submit(r) for r in reqs]
        lows, high = futs[:4], futs[4]
        hr = high.result(timeout=120)
        lr = [f.result(timeout=120) for f in lows]
        # the high request arrived last but finished before every low one: from its
        # admission on, its tasks went first at every step boundary of the low ones
        assert hr.finish < min(r.finish for r in lr)
        assert hr.priority == "high" and hr.stats["priority"] == "high"
        assert all(r.priority == "low" for r in lr)
        # R came from the online search (the middle candidate and its neighbours tried
        # first; 8 only once 6 has scored below 4), which saw them all
        assert eng.search.history[:3] == [4, 2, 6]
        assert {r.stats["patches"] for r in [hr, *lr]} <= {2, 4, 6}
        assert sum(eng.metrics()["patch_search"]["observations"].values()) == 5
        with pytest.raises(RenderError, match="priority"):
            eng.submit(RenderRequest(prompt="x", priority="urgent"))


@pytest.mark.parametrize("kind,name", [("flux2", "flux2"), ("sd3.5", "sd3")])
def test_adapter_checkpoint_served_regionally_equals_single_process(tmp_path, kind, name):
    """A tiny seeded FLUX.2 / SD3.5 pipeline saved as a real checkpoint folder: the engine
    holds a weightless copy, its workers load the weights; the result equals
    ``dit.adapters.regional.regional_generate`` with the same gate decisions."""
    from sakura.dit.adapters.inputs import Conditioning, LatentRequest, LatentTemplate
    from sakura.dit.adapters.regional import regional_generate
    from sakura.dit.adapters.registry import load_adapter
    from sakura.dit.adapters.tiny import save_tiny_pipeline

    path = save_tiny_pipeline(kind, tmp_path / kind)
    adapter = load_adapter(name, path)
    g = torch.Generator().manual_seed(0)
    width = adapter.model.config.joint_attention_dim
    pooled = adapter.model.config.get("pooled_projection_dim") or 0

    def cond(tokens):
        return Conditioning(torch.randn(1, tokens, width, generator=g),
                            torch.randn(1, pooled, generator=g) if pooled else None)

    req = LatentRequest(cond(7), cond(3), 0)
    rc = RegionalConfig(warmup=2, eps=0.4, max_skips=2, patches=3)  # the paper's gate
    cfg = EngineConfig(workers=1, model=name, model_path=str(path), regional=rc,
                       quality_eps=None, max_size=256)
    size = 6 * adapter.pixels_per_token
    with RenderEngine(cfg) as eng:
        with pytest.raises(RenderError, match="conditioning"):
            eng.submit(RenderRequest(prompt="x", size=size))
        futs = [eng.submit(RenderRequest(seed=s, steps=STEPS, size=size, guidance=2.0,
                                         cond=req.cond, uncond=req.uncond, mode=mode))
                for s, mode in ((1, "regional"), (2, "full"))]
        res = [f.result(timeout=300) for f in futs]
    n = 36
    for r, (seed, mode) in zip(res, ((1, "regional"), (2, "full"))):
        assert r.image is None and r.latents.shape == (n, adapter.latent_channels)
        tpl = LatentTemplate(torch.zeros(n, adapter.latent_channels), (6, 6),
                             torch.ones(n, dtype=torch.bool), req.cond, 0, STEPS, 2.0)
        one = type(req)(req.cond, req.uncond, seed)
        c = rc if mode == "regional" else RegionalConfig(warmup=STEPS)
        x, st = regional_generate(adapter, tpl, one, c)
        assert float((r.latents - x).abs().max()) < 1e-3
        if mode == "regional":
            assert r.stats["skipped_patch_steps"] == st.stats.skipped_patch_steps > 0
            assert r.stats["probe_steps"] == STEPS - 2


def test_a_kept_lower_class_request_without_room_yields_to_the_higher_class():
    """At reserve 0 a lower class may take no backlog while a higher class is open. When the
    benefit rule keeps the low request on its worker (a cheap step is not worth a switch),
    that request has no room, so the high one must go: before, nothing was placed and an
    engine with no task in flight waited forever."""
    def transfer(task, w):
        return 0.0 if task.key.rid == 1 else 10.0
    s = Scheduler(capacity=100.0, transfer=transfer, reserve=0.0)
    s.add_worker(0)
    s.open_request(1, 2)
    s.open_request(2, 0)
    s.add(_task(1, 4, 0, PATCH, cost=20.0, cls=2))   # 4 * 20 < 1 * (100 + 10): kept
    s.add(_task(2, 0, -1, WARMUP, cost=100.0, cls=0))
    assert [g.tasks[0].key.rid for g in s.place()] == [2]
    assert s.stats.kept == 1


def test_lower_classes_leave_backlog_room_while_a_higher_class_is_open():
    s = Scheduler(capacity=100.0, reserve=0.5)
    s.add_worker(0)
    s.open_request(1, 2)
    for p in range(6):
        s.add(_task(1, 3, p, PATCH, cost=20.0, cls=2))
    assert sum(len(g.tasks) for g in s.place()) == 5  # alone: the whole backlog (>= 100)
    s = Scheduler(capacity=100.0, reserve=0.5)
    s.add_worker(0)
    s.open_request(1, 2)
    s.open_request(2, 0)  # a high request is open (between two of its steps)
    for p in range(6):
        s.add(_task(1, 3, p, PATCH, cost=20.0, cls=2))
    assert sum(len(g.tasks) for g in s.place()) == 3  # only to half the capacity
    s.add(_task(2, 4, -2, PROBE, cost=20.0, cls=0))
    assert [t.key.rid for g in s.place() for t in g.tasks] == [2]  # the room kept for it
    s.forget(2)  # the high request finished: the low one may fill the backlog again
    assert sum(len(g.tasks) for g in s.place()) == 1
