"""The cloud render engine: scheduler invariants (pure), and the real thing with spawned
worker processes: equality with single-process regional execution, recovery from a
SIGKILLed worker, the HTTP front and arrival-trace replay."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import httpx
import pytest
import torch
from sakura.cloud.render import RenderEngine
from sakura.cloud.render_api import EngineConfig, RenderError, RenderRequest
from sakura.cloud.render_sched import FULL, PATCH, WARMUP, Scheduler, Task, TaskKey
from sakura.cloud.render_trace import (
    bursty_arrivals,
    load_trace,
    poisson_arrivals,
    replay,
    request_factory,
    save_trace,
)
from sakura.dit.model import MMDiT, MMDiTConfig
from sakura.dit.regional import RegionalConfig
from sakura.dit.regional_mmdit import regional_generate
from sakura.dit.sampler import generate
from sakura.dit.weights import save_model


def _task(rid, step, patch, kind, cost=10.0, seq=None):
    return Task(TaskKey(rid, step, patch), kind, rid if seq is None else seq, cost)


# ----------------------------------------------------------------------------- scheduler


def test_priorities_warmup_first_then_arrival_order():
    s = Scheduler(capacity=1e9)
    s.add_worker(0)
    s.add(_task(0, 5, 1, PATCH))
    s.add(_task(0, 5, 0, PATCH))
    s.add(_task(1, 0, -1, FULL))
    s.add(_task(2, 0, -1, WARMUP))
    s.add(_task(3, 1, -1, WARMUP))
    order = [t.key for g in s.place() for t in g.tasks]
    assert order == [TaskKey(2, 0, -1), TaskKey(3, 1, -1), TaskKey(0, 5, 0), TaskKey(0, 5, 1),
                     TaskKey(1, 0, -1)]


def test_least_maximum_load_and_capacity():
    s = Scheduler(capacity=25.0)
    for w in (0, 1):
        s.add_worker(w)
    for p in range(6):
        s.add(_task(0, 3, p, PATCH))
    groups = s.place()
    # equal costs alternate between the workers; each takes 3 before it is full (>= 25)
    assert sorted(len(g.tasks) for g in groups) == [3, 3]
    assert {g.worker for g in groups} == {0, 1}
    assert s.load(0) == s.load(1) == 30.0
    s.add(_task(1, 0, -1, WARMUP))
    assert s.place() == []  # nobody has room: it waits in the queue
    s.complete(TaskKey(0, 3, 0), [w for (k, w) in s.stats.placements if k.patch == 0][0])
    (g,) = s.place()
    assert g.tasks[0].key == TaskKey(1, 0, -1)


def test_affinity_breaks_ties_and_transfer_cost_is_weighed_against_load():
    holder = {0}  # worker 0 holds the request's state
    s = Scheduler(capacity=1e9, transfer=lambda t, w: 0.0 if w in holder else 8.0)
    for w in (0, 1):
        s.add_worker(w)
    for p in range(3):
        s.add(_task(0, 2, p, PATCH, cost=10.0))
    groups = s.place()
    # task 0 -> worker 0 (affinity); task 1: worker 0 would reach 20, worker 1 18 -> w1;
    # task 2: worker 0 reaches 20, worker 1 28 (its state is there now) -> w0
    assert [(g.worker, [t.key.patch for t in g.tasks]) for g in groups] == [(0, [0, 2]), (1, [1])]
    assert s.load(1) == 18.0  # the transfer was charged once
    s2 = Scheduler(capacity=1e9, transfer=lambda t, w: 0.0 if w in holder else 50.0)
    for w in (0, 1):
        s2.add_worker(w)
    for p in range(3):
        s2.add(_task(0, 2, p, PATCH, cost=10.0))
    # shipping the state costs more than queueing behind: everything stays on worker 0
    assert [(g.worker, len(g.tasks)) for g in s2.place()] == [(0, 3)]


def test_no_lost_or_duplicated_outputs_after_a_worker_dies():
    s = Scheduler(capacity=1e9)
    for w in (0, 1):
        s.add_worker(w)
    keys = [TaskKey(r, 4, p) for r in range(3) for p in range(4)]
    for k in keys:
        s.add(Task(k, PATCH, k.rid, 10.0))
    placed = {t.key: g.worker for g in s.place() for t in g.tasks}
    assert set(placed) == set(keys)
    done_before = [k for k in keys if placed[k] == 0][:2]
    for k in done_before:
        assert s.complete(k, 0)
    requeued = s.worker_lost(0)
    assert {t.key for t in requeued} == {k for k in keys if placed[k] == 0} - set(done_before)
    s.add_worker(2)  # the replacement
    replaced = {t.key: g.worker for g in s.place() for t in g.tasks}
    assert set(replaced) == {t.key for t in requeued}
    assert 0 not in replaced.values()
    for k, w in list(replaced.items()) + [(k, w) for k, w in placed.items() if w == 1]:
        assert s.complete(k, w)
    # a late or repeated output of a finished key is a duplicate and is refused
    assert not s.complete(done_before[0], 0)
    assert not s.complete(TaskKey(9, 9, 9), 1)
    assert s.done == set(keys) and not s.inflight and s.pending == 0
    assert s.stats.completed == len(keys) and s.stats.duplicates == 2
    assert not s.add(Task(keys[0], PATCH, 0, 10.0))  # finished outputs are never re-queued


def test_preemption_only_at_step_boundaries():
    s = Scheduler(capacity=15.0)
    s.add_worker(0)
    s.add(_task(0, 7, 0, PATCH))
    s.add(_task(0, 7, 1, PATCH))
    (g,) = s.place()
    assert [t.key.patch for t in g.tasks] == [0, 1]  # dispatched: they run to the end
    s.add(_task(5, 0, -1, WARMUP))  # a new request arrives
    s.add(_task(0, 8, 0, PATCH))    # (what the old request's next step would queue)
    assert s.place() == []          # the running step is not interrupted
    assert set(s.inflight) == {TaskKey(0, 7, 0), TaskKey(0, 7, 1)}
    s.complete(TaskKey(0, 7, 0), 0)
    s.complete(TaskKey(0, 7, 1), 0)
    groups = s.place()              # at the boundary the warm-up goes first
    assert [g.tasks[0].key for g in groups] == [TaskKey(5, 0, -1), TaskKey(0, 8, 0)]


def test_gang_tasks_of_a_joint_step_go_to_one_worker():
    s = Scheduler(capacity=25.0)
    for w in (0, 1):
        s.add_worker(w)
    for p in range(4):
        s.add(Task(TaskKey(0, 3, p), PATCH, 0, 10.0, gang=True))
    s.add(_task(1, 0, -1, WARMUP))
    groups = s.place()
    # the warm-up first; then the whole gang on the other worker even though it overfills it
    assert [(g.worker, [t.key.patch for t in g.tasks]) for g in groups] == [(0, [-1]),
                                                                           (1, [0, 1, 2, 3])]
    lost = s.worker_lost(1)
    assert len(lost) == 4  # a gang is requeued whole
    (g,) = s.place()
    assert g.worker == 0 and len(g.tasks) == 4


def test_a_split_gang_goes_to_idle_workers_and_merges_on_one():
    """Patch parallelism: the parts of a step's gang are placed one by one; apart while
    that lowers the maximum load, one group again when they land on one worker."""
    def add(s, part_of):
        for p, part in part_of.items():
            s.add(Task(TaskKey(0, 3, p), PATCH, 0, 10.0, gang=True, part=part))

    s = Scheduler(capacity=100.0)
    for w in (0, 1):
        s.add_worker(w)
    add(s, {0: 0, 1: 1, 2: 0, 3: 1})
    groups = s.place()
    assert sorted((g.worker, sorted(t.key.patch for t in g.tasks)) for g in groups) == \
        [(0, [0, 2]), (1, [1, 3])]
    one = Scheduler(capacity=100.0)
    one.add_worker(0)
    add(one, {0: 0, 1: 1, 2: 0, 3: 1})
    (g,) = one.place()
    assert sorted(t.key.patch for t in g.tasks) == [0, 1, 2, 3]
    # shipping the request's state to the idle worker costs more than the part saves
    far = Scheduler(capacity=100.0, transfer=lambda task, w: 0.0 if w == 0 else 50.0)
    for w in (0, 1):
        far.add_worker(w)
    add(far, {0: 0, 1: 1, 2: 0, 3: 1})
    (g,) = far.place()
    assert g.worker == 0 and len(g.tasks) == 4


def test_patch_gangs_balance_token_counts():
    from sakura.cloud.render import patch_gangs

    assert patch_gangs({0: 9, 1: 3, 2: 5, 3: 4}, 2) == {0: 0, 2: 1, 3: 1, 1: 0}
    assert set(patch_gangs({0: 4, 1: 4}, 1).values()) == {0}
    assert patch_gangs({7: 4}, 2) == {7: 0}


# ----------------------------------------------------------------------------- trace


def test_kv_sync_moves_a_replica_across_steps_that_wrote_nothing():
    """A step where every patch was skipped writes no K/V, so a worker whose replica is
    at the last writing step gets a delta (its version moves on several steps), not the
    whole store; a replica older than the last write needs the snapshot."""
    from types import SimpleNamespace

    import numpy as np
    from sakura.cloud.render_replicas import ReplicaVersions
    from sakura.cloud.render_worker import Replica, ResyncNeeded, _Worker

    idx = np.array([0, 1])
    one = np.ones((1, 1, 1, 2, 1), dtype=np.float32)
    others = (idx, one, one, 1)
    # request 7: patches ran at step 3 (worker 0 and worker 1 wrote), steps 4-5 skipped all
    r = SimpleNamespace(rid=7, kv_since=4, last=(3, {0: others}))
    replicas = ReplicaVersions()
    replicas.versions = {0: {7: 3}, 1: {7: 4}, 2: {7: 2}, 3: {}}
    kind = lambda wid, step=6: replicas.sync_kind(r, step, wid)  # noqa: E731
    assert kind(0) == "delta"      # at the last writing step: its stash + worker 1's writes
    assert kind(1) == "delta"      # already past it: only the version moves
    assert kind(2) == "snapshot"   # misses step 3's writes
    assert kind(3) == "snapshot"   # holds nothing
    assert kind(0, step=3) == "none"
    assert [w[0].tolist() for w in replicas.delta_writes(r, 0)] == [[0, 1]]
    assert replicas.delta_writes(r, 1) == []

    w = _Worker(model=None)
    k = torch.zeros(1, 1, 1, 4, 1)
    own = (np.array([2]), torch.full((1, 1, 1, 1, 1), 2.0), torch.full((1, 1, 1, 1, 1), 2.0))
    w.replicas[7] = Replica(k.clone(), k.clone(), 3, {3: [own]})
    rep = w.sync(7, 6, ("delta", 3, 6, [others[:3]]))
    assert rep.version == 6 and rep.k.flatten().tolist() == [1.0, 1.0, 2.0, 0.0]
    with pytest.raises(ResyncNeeded):  # a delta from a step the replica is not at
        w.sync(7, 8, ("delta", 5, 8, []))


def test_arrival_traces_are_seeded_and_have_the_requested_rate(tmp_path):
    prompts = ["a", "b", "c"]
    b1 = bursty_arrivals(400, rate=4.0, prompts=prompts, burst=5, seed=3)
    assert b1 == bursty_arrivals(400, rate=4.0, prompts=prompts, burst=5, seed=3)
    assert len(b1) == 400 and all(x.t <= y.t for x, y in zip(b1, b1[1:]))
    assert 2.5 < 400 / b1[-1].t < 6.5
    gaps = sorted(y.t - x.t for x, y in zip(b1, b1[1:]))
    assert gaps[len(gaps) // 2] < 0.05  # most gaps are inside bursts
    p = poisson_arrivals(400, rate=4.0, prompts=prompts, seed=3)
    assert 3.0 < 400 / p[-1].t < 5.3
    save_trace(b1[:5], tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == b1[:5]
    (tmp_path / "t.csv").write_text("t,prompt,seed\n0.5,x,1\n0.1,y,2\n")
    assert [a.prompt for a in load_trace(tmp_path / "t.csv")] == ["y", "x"]
    (tmp_path / "bad.jsonl").write_text('{"t": 1}\n')
    with pytest.raises(RenderError):
        load_trace(tmp_path / "bad.jsonl")


# ----------------------------------------------------------------------------- engine

STEPS, SIZE, GUIDANCE = 8, 32, 2.0
CFG = RegionalConfig(warmup=2, eps=0.3, max_skips=2, patches=4)  # the paper's gate


def _model() -> MMDiT:
    torch.manual_seed(0)
    cfg = MMDiTConfig(hidden_size=48, num_heads=3, double_blocks=2, single_blocks=2,
                      mlp_ratio=2.0, text_dim=384, text_tokens=16, rope_axes=(4, 6, 6))
    model = MMDiT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    return model.eval()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, text_encoder):
    model = _model()
    path = tmp_path_factory.mktemp("render") / "tiny.safetensors"
    save_model(model, path)
    eng = RenderEngine(EngineConfig(workers=2, weights=str(path), regional=CFG,
                                    capacity_rows=400, quality_eps=None), encoder=text_encoder)
    eng.start()
    eng.test_model = model
    yield eng
    eng.stop()


def _reference(model, req: RenderRequest, cfg: RegionalConfig):
    if req.mode == "full":
        return generate(model, req.txt, req.txt_uncond, SIZE, req.seed, STEPS, GUIDANCE)[0], None
    if req.mode == "naive":
        cfg = RegionalConfig(**{**cfg.__dict__, "context": "none"})
    if req.mode == "separate":
        cfg = RegionalConfig(**{**cfg.__dict__, "execution": "separate"})
    img, st = regional_generate(model, req.txt, req.txt_uncond, SIZE, req.seed, STEPS, GUIDANCE,
                                cfg, req.salient)
    return img[0], st


def _requests(engine, n, text_encoder):
    prompts = ["smileys: grinning face", "animals & nature: dog face", "food: red apple"]
    modes = ("regional", "full", "naive", "separate")
    out = []
    for i in range(n):
        req = engine.prepare(RenderRequest(prompt=prompts[i % 3], seed=i, steps=STEPS,
                                           size=SIZE, guidance=GUIDANCE, mode=modes[i % 4]))
        out.append(req)
    return out


def test_engine_matches_single_process_execution(engine, text_encoder):
    reqs = _requests(engine, 8, text_encoder)
    futs = [engine.submit(r) for r in reqs]
    for req, fut in zip(reqs, futs):
        res = fut.result(timeout=120)
        ref, st = _reference(engine.test_model, req, CFG)
        assert res.image.shape == (3, SIZE, SIZE)
        assert float((res.image - ref).abs().max()) < 1e-4
        if st is not None:  # the same gate decisions, made by the engine
            assert res.stats["skipped_patch_steps"] == st.stats.skipped_patch_steps > 0
            assert res.stats["patches"] == 4
    m = engine.metrics()
    assert m["completed"] == m["dispatched"] and m["duplicates"] == 0
    assert m["affinity_hits"] > 0


def test_engine_recovers_from_a_killed_worker(engine, text_encoder):
    reqs = _requests(engine, 9, text_encoder)
    before = engine.metrics()
    applied_before = len(engine.applied)
    futs = [engine.submit(r) for r in reqs]
    deadline = time.monotonic() + 60
    victim = min(engine.worker_pids())
    # kill a worker once it has work in flight (the backlog holds several tasks)
    while victim not in engine.busy_workers():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(engine.worker_pids()[victim], signal.SIGKILL)
    results = [f.result(timeout=120) for f in futs]
    after = engine.metrics()
    assert after["worker_deaths"] == before["worker_deaths"] + 1
    assert after["respawned"] == before["respawned"] + 1
    assert after["requeued"] > before["requeued"]
    while len(engine.worker_pids()) < 2:  # the replacement loads the model meanwhile
        assert time.monotonic() < deadline + 60
        time.sleep(0.05)
    assert victim not in engine.worker_pids()
    # every output applied exactly once: no (request, step, patch) twice, none missing
    applied = list(engine.applied)[applied_before:]
    assert not [k for k, c in Counter(applied).items() if c > 1]
    expected = sum(r.stats["warmup"] + r.stats["executed_patch_steps"] + r.stats["probe_steps"]
                   if r.mode != "full" else STEPS for r in results)
    assert len(applied) == expected
    for req, res in zip(reqs, results):
        ref, _ = _reference(engine.test_model, req, CFG)
        assert float((res.image - ref).abs().max()) < 1e-4


def test_engine_rejects_bad_requests(engine):
    with pytest.raises(RenderError):
        engine.submit(RenderRequest(prompt="x", size=30))
    with pytest.raises(RenderError):
        engine.submit(RenderRequest(prompt="x", steps=0))
    with pytest.raises(RenderError):
        engine.submit(RenderRequest(prompt="x", mode="fast"))


def test_http_front_and_trace_replay(engine):
    from sakura.cloud.render_http import create_render_app
    from sakura.cloud.runner import serve_in_thread

    with serve_in_thread(create_render_app(engine)) as base:
        r = httpx.post(f"{base}/v1/renders", json={"prompt": "food: red apple", "seed": 2,
                                                   "steps": 4, "size": 32, "wait": True,
                                                   "priority": "high", "patches": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "done" and body["stats"]["steps"] == 4
        assert body["priority"] == "high" and body["stats"]["patches"] == 2
        assert httpx.post(f"{base}/v1/renders", json={"prompt": "x", "priority": "now"}
                          ).status_code == 422
        png = httpx.get(base + body["image"], timeout=10)
        assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
        q = httpx.post(f"{base}/v1/renders", json={"prompt": "dog", "steps": 3, "size": 32})
        assert q.status_code == 202
        rid = q.json()["id"]
        for _ in range(600):
            st = httpx.get(f"{base}/v1/renders/{rid}").json()
            if st["status"] != "queued":
                break
            time.sleep(0.05)
        assert st["status"] == "done"
        assert httpx.get(f"{base}/v1/renders/999").status_code == 404
        bad = httpx.post(f"{base}/v1/renders", json={"prompt": "x", "size": 30})
        assert bad.status_code == 400 and "size" in bad.json()["error"]
        assert httpx.post(f"{base}/v1/renders", json={"seed": 1}).status_code == 422
        assert httpx.get(f"{base}/v1/engine").json()["completed"] > 0
        # a full-mode request: a figure that does not apply (no partition: "explained") is
        # null, not the NaN that made every full-mode answer a 500
        f = httpx.post(f"{base}/v1/renders", json={"prompt": "food: red apple", "seed": 2,
                                                   "steps": 4, "size": 32, "wait": True,
                                                   "mode": "full"}, timeout=60)
        assert f.status_code == 200, f.text
        assert f.json()["mode"] == "full" and f.json()["stats"]["explained"] is None
        assert httpx.get(f"{base}/v1/renders/{f.json()['id']}").status_code == 200

    trace = bursty_arrivals(5, rate=20.0, prompts=["smileys: grinning face"], burst=3, seed=1)
    rep = replay(engine, trace, request_factory(RenderRequest(steps=4, size=32, guidance=GUIDANCE)))
    summary = rep.summary()
    assert summary["requests"] == 5 and summary["throughput_rps"] > 0
    assert summary["p50_latency_s"] <= summary["p90_latency_s"] <= summary["p99_latency_s"]


# ----------------------------------------------------------------------------- CLI


def test_cli_registers_bench_flashdiff_and_render():
    import argparse

    from sakura.cloud import render_cli

    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command")
    bench = commands.add_parser("bench").add_subparsers(dest="bench")
    render_cli.register(commands, bench)
    a = parser.parse_args(["bench", "flashdiff", "--json", "x.json", "--quick", "--workers", "3"])
    assert (a.json, a.quick, a.workers, a.no_serve) == ("x.json", True, 3, False)
    assert a.func.__module__ == "sakura.cloud.render_cli"
    r = parser.parse_args(["render", "replay", "--requests", "4", "--mode", "full", "--eps", "1.2"])
    assert (r.requests, r.mode, r.eps, r.priority) == (4, "full", 1.2, "warmup_first")
    assert (r.gate, r.partition, r.preempt, r.patches, r.request_priority) == (
        "paper", "grid", "benefit", None, "normal")
    d = parser.parse_args(["render", "serve", "--gate", "drift", "--partition", "cuts",
                           "--patches", "6", "--no-quality-mode"])
    assert (d.gate, d.partition, d.patches, d.no_quality_mode, d.eps) == (
        "drift", "cuts", 6, True, None)
    s = parser.parse_args(["render", "serve", "--port", "0", "--priority", "fifo"])
    assert (s.port, s.priority, s.patch_split) == (0, "fifo", 1)
    assert parser.parse_args(["render", "serve", "--patch-split", "2"]).patch_split == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["render", "serve", "--patch-split", "0"])


class _SplitBackend:
    """Single-process reference of a step whose gangs ran on different workers: each gang
    runs jointly against the store as it was at the start of the step."""

    def __init__(self, inner, k):
        self.inner, self.k = inner, k

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run_patches(self, step, t, x, patches, context, joint=False, measure=True):
        from sakura.cloud.render import patch_gangs

        gangs = patch_gangs({i: len(p) for i, p in enumerate(patches)}, self.k)
        out = [None] * len(patches)
        for g in sorted(set(gangs.values())):
            ids = [i for i in range(len(patches)) if gangs[i] == g]
            res = self.inner.run_patches(step, t, x, [patches[i] for i in ids], context,
                                         joint=joint, measure=measure)
            for i, r in zip(ids, res):
                out[i] = r
        return out


def test_patch_parallel_splits_a_lone_request_over_two_workers(tmp_path, text_encoder):
    """One request on two idle workers with ``patch_split=2``: its patch steps run as two
    gangs on the two workers, their K/V exchanged through the replicas, and the image is
    the single-process run of the same split (each gang sees the other one step old)."""
    from sakura.dit.regional import run_regional
    from sakura.dit.regional_mmdit import (
        generation_backend,
        generation_state,
        latents_to_image,
    )

    model = _model()
    path = tmp_path / "tiny.safetensors"
    save_model(model, path)
    cfg = RegionalConfig(warmup=2, eps=0.0, max_skips=2, patches=4)  # every patch runs
    ecfg = EngineConfig(workers=2, weights=str(path), regional=cfg, quality_eps=None,
                        patch_split=2, transfer_weight=0.0, group_overhead_rows=0.0)
    with RenderEngine(ecfg, encoder=text_encoder) as eng:
        req = eng.prepare(RenderRequest(prompt="smileys: grinning face", seed=3, steps=STEPS,
                                        size=SIZE, guidance=GUIDANCE))
        res = eng.submit(req).result(timeout=120)
        syncs = eng.metrics()["kv_syncs"]
    assert res.stats["split_steps"] == STEPS - cfg.warmup
    # the warm-up steps ran one guidance branch per worker, so neither holds the store:
    # one snapshot each; later the gang that finished first had its K/V sent ahead
    assert syncs["ahead"] >= 1 and syncs["snapshot"] == 2
    assert res.stats["exchange_bytes"] > 0 and res.stats["exchange_s"] > 0
    backend = _SplitBackend(generation_backend(model, req.txt, req.txt_uncond, SIZE,
                                               GUIDANCE), 2)
    st = run_regional(backend, generation_state(model, SIZE, req.seed, STEPS, cfg,
                                                backend.inner, req.salient))
    split = latents_to_image(model, st.x, SIZE)[0]
    assert float((res.image - split).abs().max()) < 1e-4
    joint, _ = _reference(model, req, cfg)
    assert float((res.image - joint).abs().max()) > 1e-3  # the split is not the joint step


def test_whole_steps_split_by_guidance_branch_equal_full_generation(tmp_path, text_encoder):
    """With ``patch_split=2`` a lone full-mode request runs each step as two tasks, one
    guidance branch per worker, combined by the engine: the image is full generation's."""
    model = _model()
    path = tmp_path / "tiny.safetensors"
    save_model(model, path)
    ecfg = EngineConfig(workers=2, weights=str(path), regional=CFG, quality_eps=None,
                        patch_split=2, transfer_weight=0.0, group_overhead_rows=0.0)
    with RenderEngine(ecfg, encoder=text_encoder) as eng:
        req = eng.prepare(RenderRequest(prompt="food: red apple", seed=5, steps=STEPS,
                                        size=SIZE, guidance=GUIDANCE, mode="full"))
        applied = len(eng.applied)
        res = eng.submit(req).result(timeout=120)
        keys = list(eng.applied)[applied:]
        placed = {(k, w) for k, w in eng.sched.stats.placements if k.rid == keys[0].rid}
    assert sorted(k.patch for k in keys) == [-4] * STEPS + [-3] * STEPS
    assert {w for _, w in placed} == {0, 1}  # the branches ran on both workers
    ref, _ = _reference(model, req, CFG)
    assert float((res.image - ref).abs().max()) < 1e-4


def test_an_engine_stopped_with_requests_in_flight_answers_every_client(tmp_path, text_encoder):
    """Stopping the engine (a restart) with requests running and queued: every future
    resolves, to its (correct) result or to one clear error, none is lost; a stopped
    engine refuses new work; the restarted engine serves the failed requests."""
    model = _model()
    path = tmp_path / "tiny.safetensors"
    save_model(model, path)
    ecfg = EngineConfig(workers=2, weights=str(path), regional=CFG, quality_eps=None)
    eng = RenderEngine(ecfg, encoder=text_encoder)
    eng.start()
    reqs = _requests(eng, 8, text_encoder)
    futs = [eng.submit(r) for r in reqs]
    deadline = time.monotonic() + 60
    while not eng.busy_workers():
        assert time.monotonic() < deadline
        time.sleep(0.002)
    eng.stop()
    assert all(f.done() for f in futs)
    failed = [r for r, f in zip(reqs, futs) if f.exception() is not None]
    for f in futs:
        if f.exception() is not None:
            assert str(f.exception()) == "the render engine stopped"
    assert failed  # it was stopped mid-request
    for req, f in zip(reqs, futs):
        if f.exception() is None:
            ref, _ = _reference(model, req, CFG)
            assert float((f.result().image - ref).abs().max()) < 1e-4
    with pytest.raises(RenderError, match="not running"):
        eng.submit(reqs[0])
    with RenderEngine(ecfg, encoder=text_encoder) as again:
        res = again.submit(failed[0]).result(timeout=120)
    ref, _ = _reference(model, failed[0], CFG)
    assert float((res.image - ref).abs().max()) < 1e-4


def test_a_request_queued_but_not_yet_admitted_is_failed_by_stop():
    """The engine loop admits queued requests between placements: one still queued when
    the engine stops is answered too (it used to wait forever)."""
    from concurrent.futures import Future

    eng = RenderEngine(EngineConfig(workers=1))  # never started: no loop to admit it
    fut: Future = Future()
    eng._inbox.put((0, RenderRequest(prompt="x"), fut, time.monotonic()))
    eng.stop()
    assert fut.done() and str(fut.exception()) == "the render engine stopped"
