"""The cloud render engine: FlashDiff regional execution served across worker processes.

``RenderEngine`` owns a pool of spawned worker processes (``cloud.render_pool``, each
running ``cloud.render_worker``; one per GPU when there are GPUs, CPU otherwise; or, with
``EngineConfig(pool="ray")``, Ray actors behind the same interface: ``cloud.render_ray``), a
scheduler (``cloud.render_sched``: priority classes, step-boundary preemption by benefit vs
switch cost, least-maximum-load placement with affinity), the online policy
(``cloud.render_policy``: the patch count R searched from observed service time and reuse
error, the quality mode under low load) and, per request, a
``dit.regional.RegionalState``: the same state machine the single-process sampler drives.
The engine turns the state's next step into monotasks (a warm-up step, a gate probe, or one
task per active patch), ships them to workers with what brings their K/V replicas up to
date (``cloud.render_replicas``), and applies their outputs at the step boundary. This
module is that loop: requests in, monotasks out, outputs applied.

The model is the shipped default MMDiT (``weights``) or a diffusers checkpoint
(``model`` + ``model_path``, any ``dit.adapters`` model): the engine process then holds
a weightless (``meta``) copy of the transformer for geometry, schedule and costs
(``cloud.render_model``); the workers load the weights. Adapter requests carry their
encoded conditioning and return latents (the VAE is not part of the engine).

Recovery: outputs are keyed by (request, step, patch) and applied exactly once. The
engine holds the authoritative per-request state (latents, last velocities, K/V store), so
when a worker dies (its pipe closes or its process sentinel fires) its unfinished tasks go
back to the queue, a replacement worker is spawned, and the tasks re-run elsewhere from
the engine's copy (a snapshot of the store), giving the same outputs.

Requests (``cloud.render_api``: ``RenderRequest``, ``RenderResult``, ``EngineConfig``)
arrive through :meth:`RenderEngine.submit` (returns a ``concurrent.futures`` future), the
HTTP front (``cloud.render_http``) or an arrival-trace replay (``cloud.render_trace``).
See ``cloud/RENDER.md``.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from sakura.cloud.render_api import (
    MODES,
    EngineConfig,
    RenderError,
    RenderRequest,
    RenderResult,
    size_problem,
)
from sakura.cloud.render_model import as_numpy, model_view
from sakura.cloud.render_policy import PatchCountSearch, quality_mode
from sakura.cloud.render_pool import WorkerPool, WorkerProc
from sakura.cloud.render_replicas import ReplicaVersions
from sakura.cloud.render_sched import (
    CLASSES,
    FULL,
    PATCH,
    PROBE,
    WARMUP,
    Group,
    Scheduler,
    Task,
    TaskKey,
    class_index,
)
from sakura.dit.regional import (
    FullResult,
    KVStore,
    PatchResult,
    ProbeResult,
    RegionalState,
    salient_token_mask,
)
from sakura.dit.regional_mmdit import join_branches

POOLS = ("process", "ray")
# task keys (patch field) of a whole step's two guidance branches, cond then uncond
BRANCH_KEYS = (-3, -4)


def patch_gangs(sizes: dict[int, int], k: int) -> dict[int, int]:
    """Cut a step's active patches (patch -> token count) into at most ``k`` gangs of
    balanced token counts: largest patch first (ties: lower id), each to the lightest gang
    (ties: lower gang). Patch -> gang; all in gang 0 when ``k < 2``."""
    k = max(1, min(k, len(sizes)))
    load = [0] * k
    gangs = {}
    for p in sorted(sizes, key=lambda p: (-sizes[p], p)):
        g = min(range(k), key=lambda i: (load[i], i))
        gangs[p] = g
        load[g] += sizes[p]
    return gangs


def _sync_bytes(sync: tuple) -> int:
    """K/V bytes a replica sync carries (arrays only: object-store references count 0)."""
    if sync[0] == "snapshot":
        arrays = sync[2:4]
    else:
        arrays = [a for _, k, v in sync[3] for a in (k, v)]
    return int(sum(getattr(a, "nbytes", 0) for a in arrays))


@dataclass
class _Req:
    """A request in flight: its state machine and the engine's bookkeeping of it."""

    rid: int
    seq: int
    req: RenderRequest
    state: RegionalState
    spec: dict
    future: Future
    arrival: float
    # patch -> (result, worker, its K/V as object-store references or None)
    pending: dict[int, tuple[PatchResult, int, tuple | None]] = field(default_factory=dict)
    # the last patch step that wrote K/V, and its writes (token ids, k, v, worker); k / v
    # are object-store references on the Ray pool (deltas forward them), arrays otherwise
    last: tuple[int, dict[int, tuple[np.ndarray, object, object, int]]] | None = None
    kv_since: int = 0            # the K/V store is unchanged since the start of this step
    # worker -> (step, patches): outputs of that step already sent to its replica ahead
    # of the step boundary (patch parallelism; ``cloud.render_replicas``)
    ahead: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    branches: dict[int, FullResult] = field(default_factory=dict)  # this step's, by branch
    seen: set[int] = field(default_factory=set)   # workers holding its backend
    tasks: int = 0
    cls: int = 1
    searched: bool = False       # R came from the online search
    busy_s: float = 0.0          # worker seconds spent on its tasks
    mode_step: int = -1          # the step whose gate threshold was last set
    quality_steps: int = 0       # patch steps run in the quality mode
    split_steps: int = 0         # patch steps whose gangs ran on more than one worker
    exchange_s: float = 0.0      # workers' time receiving and applying K/V syncs
    exchange_bytes: int = 0      # K/V bytes sent to workers in syncs (snapshots, deltas)
    engine_s: float = 0.0        # the engine loop's time building its tasks, applying outputs


class RenderEngine:
    """Serving loop over worker processes. Use as a context manager or start()/stop()."""

    def __init__(self, cfg: EngineConfig | None = None, encoder=None):
        self.cfg = cfg or EngineConfig()
        self.view = model_view(self.cfg)
        self.model_cfg = self.view.cfg if self.view.kind == "mmdit" else None
        self.encoder = encoder
        self._encode_lock = threading.Lock()
        self._uncond: torch.Tensor | None = None
        self.sched = Scheduler(self.cfg.capacity_rows, self._transfer,
                               self.cfg.group_overhead_rows, self.cfg.priority,
                               self.cfg.preempt, self.cfg.reserve)
        self.search = PatchCountSearch(tuple(self.cfg.patch_candidates))
        if self.cfg.pool not in POOLS:
            raise RenderError(f"pool must be one of {POOLS}")
        if self.cfg.pool == "ray":
            from sakura.cloud.render_ray import RayWorkerPool  # lazy: the [ray] extra

            self.pool = RayWorkerPool(self.cfg)
        else:
            self.pool = WorkerPool(self.cfg)
        self._rid = itertools.count()
        self._reqs: dict[int, _Req] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._replicas = ReplicaVersions()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.deaths = 0
        self.respawned = 0
        self.syncs: collections.Counter[str] = collections.Counter()  # K/V sync kinds sent
        # outputs applied, in order (bounded; tests check there is no duplicate)
        self.applied: collections.deque[TaskKey] = collections.deque(maxlen=100_000)
        self.loop_error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> RenderEngine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for _ in range(self.cfg.workers):
            self._spawn()
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not all(w.ready for w in self.pool.workers.values()):
            if time.monotonic() > deadline:
                self.stop()
                raise RenderError("render workers did not start in time")
            self._poll(0.2)
            if not any(w.alive for w in self.pool.workers.values()):
                self.stop()
                raise RenderError("every render worker died while loading the model")
        self._thread = threading.Thread(target=self._loop, name="render-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.pool.wake()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.pool.close()
        for r in list(self._reqs.values()):
            if not r.future.done():
                r.future.set_exception(RenderError("the render engine stopped"))
        self._reqs.clear()
        self._fail_inbox()

    def _fail_inbox(self) -> None:
        """Fail the requests submitted but not yet admitted (the engine stopped first):
        every client gets its answer, none waits forever."""
        while True:
            try:
                _, _, fut, _ = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                fut.set_exception(RenderError("the render engine stopped"))

    def _spawn(self) -> WorkerProc:
        w = self.pool.spawn()
        self._replicas.reset(w.wid)
        return w

    def worker_pids(self) -> dict[int, int]:
        """Live workers: id -> process id (to watch them, or to kill one in a test)."""
        return {w.wid: w.pid for w in self.pool.workers.values() if w.alive and w.ready}

    def busy_workers(self) -> set[int]:
        """Workers with dispatched, unfinished tasks (a racy snapshot, for tests/monitoring)."""
        for _ in range(10):
            try:
                return {w for w, load in list(self.sched.workers.items()) if load > 0}
            except RuntimeError:  # resized by the engine thread meanwhile
                continue
        return set()

    def metrics(self) -> dict:
        s = self.sched.stats
        return {"workers": {w.wid: {"pid": w.pid, "device": w.device, "alive": w.alive,
                                    "groups": w.done_groups} for w in self.pool.workers.values()},
                "dispatched": s.dispatched, "completed": s.completed,
                "duplicates": s.duplicates, "requeued": s.requeued,
                "affinity_hits": s.affinity_hits, "preemptions": s.preemptions,
                "kept": s.kept, "worker_deaths": self.deaths,
                "respawned": self.respawned, "active_requests": len(self._reqs),
                "kv_syncs": {k: self.syncs[k] for k in ("none", "delta", "snapshot", "ahead")},
                "patch_search": self.search.to_dict()}

    # -- requests --------------------------------------------------------------------

    def submit(self, req: RenderRequest) -> Future:
        """Queue a request; the future resolves to a :class:`RenderResult`."""
        if self._thread is None or self._stop.is_set():
            raise RenderError("the render engine is not running (start() it first)")
        req = self.prepare(req)
        fut: Future = Future()
        rid = next(self._rid)
        self._inbox.put((rid, req, fut, time.monotonic()))
        self.pool.wake()
        if self._stop.is_set():  # stopped meanwhile: stop() may have drained the inbox
            self._fail_inbox()
        return fut

    def prepare(self, req: RenderRequest) -> RenderRequest:
        """Validate a request and encode its prompt (text embeddings, salient tokens)."""
        if req.mode not in MODES:
            raise RenderError(f"mode must be one of {MODES}")
        if req.priority not in CLASSES:
            raise RenderError(f"priority must be one of {CLASSES}")
        if not 1 <= req.steps <= self.cfg.max_steps:
            raise RenderError(f"steps must be in 1..{self.cfg.max_steps}")
        u = self.view.unit
        problem = size_problem(req.size, u, self.cfg.max_size)
        if problem:
            raise RenderError(f"size {problem}")
        if req.patches is not None and not 1 <= req.patches <= (req.size // u) ** 2:
            raise RenderError("patches must be between 1 and the token count")
        if self.view.kind == "adapter":
            self.view.check(req)
            return req
        if req.txt is None:
            if self.encoder is None:
                raise RenderError("no text encoder: pass embeddings (txt) with the request")

            with self._encode_lock:
                txt = self.encoder.encode([req.prompt])
                if self._uncond is None:
                    self._uncond = self.encoder.encode([""])
                salient = salient_token_mask(self.encoder.tokenizer, req.prompt,
                                             self.encoder.max_tokens)
            req = replace(req, txt=txt, txt_uncond=self._uncond,
                          salient=req.salient if req.salient is not None else salient)
        self.view.check(req)
        return req

    def _admit(self, rid: int, req: RenderRequest, fut: Future, arrival: float) -> None:
        cfg = self.cfg.regional
        if req.mode == "full":
            cfg = replace(cfg, warmup=req.steps)
        elif req.mode == "naive":
            cfg = replace(cfg, context="none")
        elif req.mode == "separate":
            cfg = replace(cfg, execution="separate")
        else:
            cfg = replace(cfg, execution="joint")
        coords, ts, x, text_tokens, cost, spec = self.view.start(req)
        patches, searched = req.patches or cfg.patches, False
        if patches is None and req.mode != "full" and self.cfg.patch_search \
                and cfg.partition != "cuts":
            patches, searched = self.search.choose(), True
        state = RegionalState(cfg, coords, ts, x, text_tokens, req.salient, cost, patches)
        r = _Req(rid, rid, req, state, spec, fut, arrival, cls=class_index(req.priority),
                 searched=searched)
        self._reqs[rid] = r
        self.sched.open_request(rid, r.cls)
        self._enqueue(r)

    def _set_threshold(self, r: _Req, step: int) -> None:
        """At a step boundary: the quality mode under low load, the normal gate otherwise."""
        if r.mode_step == step:
            return
        r.mode_step = step
        st = r.state
        quality = (self.cfg.quality_eps is not None and r.req.mode != "full"
                   and quality_mode(len(self._reqs), self.cfg.workers, self.cfg.low_load))
        st.eps = self.cfg.quality_eps if quality else st.cfg.threshold
        r.quality_steps += int(quality)

    def _enqueue(self, r: _Req) -> None:
        st = r.state
        if st.done:
            self._finish(r)
            return
        s = st.step
        n, t = st.n, st.text_tokens
        if st.phase(s) == "full":
            kind = WARMUP if r.req.mode != "full" else FULL
            if self._split_branches(r):  # one task per guidance branch (BRANCH_KEYS)
                for b in BRANCH_KEYS:
                    self.sched.add(Task(TaskKey(r.rid, s, b), kind, r.seq, float(n + t) / 2,
                                        n, cls=r.cls))
            else:
                self.sched.add(Task(TaskKey(r.rid, s, -1), kind, r.seq, float(n + t), n,
                                    cls=r.cls))
            return
        self._set_threshold(r, s)
        probes = st.probe_inputs(s)
        if probes:  # the gate decides on a probe of this step's latents
            cost = float(len(probes) * (n + t) / max(1, self.view.num_blocks))
            self.sched.add(Task(TaskKey(r.rid, s, -2), PROBE, r.seq, cost, 0, cls=r.cls))
            return
        d = st.decide(s)
        if not d.active_ids():  # every patch skipped: the step is the reused velocities
            st.apply_patches(s, {})  # the store is unchanged: r.last and kv_since stay
            self._enqueue(r)
            return
        parts = self._parts(r, d.active_ids())
        for p in d.active_ids():
            m = len(st.partition.patches[p])
            cost = float(m + (0 if st.joint else t))
            self.sched.add(Task(TaskKey(r.rid, s, p), PATCH, r.seq, cost, m, gang=st.joint,
                                cls=r.cls, part=parts.get(p, 0)))

    def _split_branches(self, r: _Req) -> bool:
        """Whether a whole step of ``r`` runs as two tasks, one per guidance branch (exact:
        the branches meet only in the guided velocity, combined here). The companion of
        patch parallelism for the steps that have no patches: same switch
        (``patch_split``), same condition (fewer open requests than live workers); the
        default MMDiT only."""
        return (self.cfg.patch_split >= 2 and self.view.kind == "mmdit"
                and r.req.txt_uncond is not None and r.req.guidance != 1.0
                and self._spare_workers())

    def _spare_workers(self) -> bool:
        """Fewer open requests than live workers: a worker would otherwise idle (the one
        condition of both splits)."""
        return len(self._reqs) < len(self.sched.workers)

    def _parts(self, r: _Req, active: list[int]) -> dict[int, int]:
        """Patch parallelism: the gang a joint step's active patch belongs to. While fewer
        requests are open than live workers (a worker would otherwise idle), the patches
        are cut into up to ``patch_split`` gangs of balanced token counts (largest first,
        each to the lightest gang); the placement rule then decides whether they really
        run apart (``cloud.render_sched``). Otherwise one gang."""
        st = r.state
        if not st.joint or not self._spare_workers():
            return {}
        return patch_gangs({p: len(st.partition.patches[p]) for p in active},
                           min(self.cfg.patch_split, len(self.sched.workers)))

    def _finish(self, r: _Req) -> None:
        img, latents = self.view.output(r.state.x, r.req)
        st = r.state
        stats = st.stats.to_dict()
        exchange_s = r.exchange_s + sum(w.sync_send_s.pop(r.rid, 0.0)
                                        for w in self.pool.workers.values())
        stats.update(tasks=r.tasks, priority=r.req.priority, service_s=r.busy_s,
                     quality_steps=r.quality_steps, patches_searched=r.searched,
                     split_steps=r.split_steps, exchange_s=exchange_s,
                     exchange_bytes=r.exchange_bytes, engine_s=r.engine_s)
        if r.searched and st.partition is not None and not r.quality_steps:
            # (a request run partly in the quality mode says nothing about gated cost)
            cost = r.busy_s + exchange_s + r.engine_s  # compute, K/V moved, engine time
            self.search.observe(st.partition.count, cost / max(1, st.steps),
                                st.stats.reuse_error)
        res = RenderResult(r.rid, img, r.arrival, time.monotonic(), stats, r.req.mode,
                           latents, r.req.priority)
        self._close(r)
        r.future.set_result(res)

    def _close(self, r: _Req) -> None:
        self._reqs.pop(r.rid, None)
        self.sched.drop_request(r.rid)
        self.sched.forget(r.rid)
        for wid in r.seen:
            self._replicas.forget(wid, r.rid)
            w = self.pool.workers.get(wid)
            if w is not None:
                w.send(("close", r.rid))

    def _fail(self, r: _Req, message: str) -> None:
        self._close(r)
        if not r.future.done():
            r.future.set_exception(RenderError(message))

    # -- placement and messages ------------------------------------------------------

    def _transfer(self, task: Task, wid: int) -> float:
        r = self._reqs.get(task.key.rid)
        if r is None:
            return 0.0
        w = self.cfg.transfer_weight
        if task.kind != PATCH or r.state.cfg.context != "stale":
            return 0.0 if wid in r.seen else w * 16
        kind = self._replicas.sync_kind(r, task.key.step, wid)
        if kind == "none":
            return 0.0
        if kind == "delta":
            return w * sum(len(o[0]) for o in self._replicas.delta_writes(r, wid))
        return w * r.state.n

    def _send(self, g: Group) -> None:
        r = self._reqs.get(g.rid)
        w = self.pool.workers[g.worker]
        keys = [t.key for t in g.tasks]
        if r is None:
            for k in keys:
                self.sched.complete(k, g.worker)
            return
        st = r.state
        s = g.step
        payload = {"rid": r.rid, "step": s, "t": st.t(s), "x": as_numpy(st.x),
                   "keys": [(k.rid, k.step, k.patch) for k in keys],
                   "spec": None if g.worker in r.seen else r.spec}
        if st.phase(s) == "full":
            branch = None  # the whole step, or both of its branch tasks on this worker
            if len(keys) == 1 and keys[0].patch in BRANCH_KEYS:
                branch = BRANCH_KEYS.index(keys[0].patch)
            payload.update(kind="full", probe=st.wants_probe(s), want_kv=st.wants_kv(s),
                           branch=branch)
        elif keys[0].patch == -2:
            payload.update(kind="probe",
                           patches=[as_numpy(p) for p in st.partition.patches],
                           probes=[(label, t, as_numpy(x), depth)
                                   for label, t, x, depth in st.probe_inputs(s)])
        else:
            ctx = st.cfg.context == "stale"
            payload.update(kind="patches", context=ctx, joint=st.joint, measure=st.measures,
                           patches=[(k.patch, as_numpy(st.partition.patches[k.patch]))
                                    for k in keys])
            if ctx:
                kind, sync = self._replicas.sync(r, s, g.worker, st.store)
                self.syncs[kind] += 1
                if sync is not None:
                    payload["sync"] = sync
                    r.exchange_bytes += _sync_bytes(sync)
        w.send(("run", payload))
        r.seen.add(g.worker)
        r.tasks += len(keys)

    def _send_ahead(self, r: _Req, step: int, wid: int, patches: list[int]) -> None:
        """Patch parallelism: while a step's other gangs still run elsewhere, send the
        outputs of ``patches`` (computed on ``wid``) to the other workers whose replica is
        at this step, so the K/V exchange overlaps their compute instead of waiting for
        the step boundary (process pool only: Ray ships K/V through its object store)."""
        if self.cfg.pool != "process" or r.state.cfg.context != "stale" or not patches:
            return
        targets = [(u, w) for u, w in self.pool.workers.items()
                   if u != wid and w.alive
                   and self._replicas.versions.get(u, {}).get(r.rid) == step]
        if not targets:
            return
        parts = r.state.partition.patches
        writes = [(as_numpy(parts[p]), as_numpy(r.pending[p][0].k), as_numpy(r.pending[p][0].v))
                  for p in patches]
        for u, w in targets:
            w.send(("ahead", r.rid, step, writes))
            self.syncs["ahead"] += 1
            r.exchange_bytes += sum(a.nbytes for _, k, v in writes for a in (k, v))
            got = r.ahead.get(u)
            r.ahead[u] = (step, (got[1] if got and got[0] == step else set()) | set(patches))

    # -- results ---------------------------------------------------------------------

    def _on_message(self, w: WorkerProc, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            _, _, pid, device = msg
            w.ready, w.pid, w.device = True, pid, device
            self.sched.add_worker(w.wid)
            return
        if kind == "done":
            w.done_groups += 1
            t0 = time.perf_counter()
            try:
                self._on_done(w, msg[2])
                self._charge(msg[2]["rid"], t0)
            except (ValueError, RuntimeError) as exc:  # a bad output fails its request only
                r = self._reqs.get(msg[2]["rid"])
                if r is not None:
                    self._fail(r, f"step {msg[2]['step']} could not be applied: {exc}")
            return
        if kind == "resync":
            _, _, rid, step, keys = msg
            self._replicas.forget(w.wid, rid)
            r = self._reqs.get(rid)
            if r is not None:
                r.seen.discard(w.wid)
            self._retry(w, keys)
            return
        if kind == "error":
            _, _, rid, step, keys, tb = msg
            for k in keys:
                self.sched.complete(TaskKey(*k), w.wid)
            r = self._reqs.get(rid)
            if r is not None:
                self._fail(r, f"worker {w.wid} failed on step {step}:\n{tb}")

    def _charge(self, rid: int, t0: float) -> None:
        """Engine time since ``t0`` spent on request ``rid`` (its cost to the service)."""
        r = self._reqs.get(rid)
        if r is not None:
            r.engine_s += time.perf_counter() - t0

    def _retry(self, w: WorkerProc, keys) -> None:
        for k in keys:
            self.sched.retry(TaskKey(*k))

    def _on_done(self, w: WorkerProc, out: dict) -> None:
        r = self._reqs.get(out["rid"])
        keys = [TaskKey(*k) for k in out["keys"]]
        fresh = [k for k in keys if self.sched.complete(k, w.wid)]
        if r is None or not fresh:
            return
        st = r.state
        s = out["step"]
        r.busy_s += float(out.get("seconds", 0.0)) / max(1, len(keys)) * len(fresh)
        r.exchange_s += float(out.get("sync_s", 0.0))
        if out["kind"] == "probe":
            st.apply_probes(s, {label: ProbeResult(torch.from_numpy(m), keys_, macs)
                                for label, (m, keys_, macs) in out["probes"].items()})
            self.applied.append(keys[0])
            self._enqueue(r)
            return
        if out["kind"] == "full":
            f = out["full"]
            branch = out.get("branch")
            kv = None
            if f["k"] is not None:
                kv = KVStore(torch.from_numpy(f["k"]), torch.from_numpy(f["v"]))
                if branch is None:  # a branch alone makes no replica on its worker
                    self._replicas.move(w.wid, r.rid, s + 1)
            res = FullResult(torch.from_numpy(f["velocity"]), kv,
                             None if f["text_attn"] is None else torch.from_numpy(f["text_attn"]),
                             f["img_keys"], f["probe_macs"])
            self.applied.extend(fresh)
            if branch is not None:
                r.branches[branch] = res
                if len(r.branches) < len(BRANCH_KEYS):
                    return  # the other branch still runs
                res = join_branches(r.branches.pop(0), r.branches.pop(1), r.req.guidance)
            st.apply_full(s, res)
            if kv is not None:
                r.last, r.kv_since = None, s + 1
            self._enqueue(r)
            return
        want = {k.patch for k in fresh}
        for p in out["patches"]:
            if p["patch"] in want:
                pr = PatchResult(torch.from_numpy(p["velocity"]), torch.from_numpy(p["k"]),
                                 torch.from_numpy(p["v"]), p["self_mass"], p["img_keys"],
                                 p["probe_macs"])
                refs = (p["k_ref"], p["v_ref"]) if "k_ref" in p else None
                r.pending[p["patch"]] = (pr, w.wid, refs)
                self.applied.append(TaskKey(r.rid, s, p["patch"]))
        if set(r.pending) != set(st.decide(s).active_ids()):  # other gangs still run
            self._send_ahead(r, s, w.wid, [p["patch"] for p in out["patches"]
                                           if p["patch"] in want])
        else:
            results = {p: pr for p, (pr, _, _) in r.pending.items()}
            r.split_steps += int(len({wid for _, wid, _ in r.pending.values()}) > 1)
            parts = st.partition.patches
            r.last = (s, {p: (as_numpy(parts[p]),
                              *(refs or (as_numpy(pr.k), as_numpy(pr.v))), wid)
                          for p, (pr, wid, refs) in r.pending.items()})
            r.kv_since = s + 1
            r.pending = {}
            st.apply_patches(s, results)
            self._enqueue(r)

    # -- the loop --------------------------------------------------------------------

    def _lost(self, w: WorkerProc) -> None:
        if not w.alive:
            return
        w.mark_lost()
        self.deaths += 1
        self._replicas.reset(w.wid)
        for r in self._reqs.values():
            r.seen.discard(w.wid)
        if w.ready:
            self.sched.worker_lost(w.wid)
        # a worker that died while loading the model is not replaced (it would again)
        if self.cfg.respawn and w.ready and not self._stop.is_set():
            self._spawn()
            self.respawned += 1

    def _poll(self, timeout: float) -> None:
        self.pool.poll(timeout, self._on_message, self._lost)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        self._admit(*item)
                    except (ValueError, RuntimeError) as exc:  # this request only
                        item[2].set_exception(RenderError(f"request rejected: {exc}"))
                for g in self.sched.place():
                    t0 = time.perf_counter()
                    self._send(g)
                    self._charge(g.rid, t0)
                self._poll(0.05)
        except BaseException as exc:  # pragma: no cover - surfaced to every waiter
            self.loop_error = exc
            for r in list(self._reqs.values()):
                self._fail(r, f"render engine loop failed: {exc!r}")
            raise


__all__ = ["POOLS", "RenderEngine", "patch_gangs"]
