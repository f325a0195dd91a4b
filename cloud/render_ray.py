"""The render engine's workers as Ray actors: the same interface as the process pool
(``cloud.render_pool.WorkerPool``: ``workers``, ``spawn``, ``wake``, ``poll``, ``close``),
so the engine and its scheduler (``cloud.render_sched``: priority monotasks, least-maximum-
load placement, step-boundary preemption) do not change. Ray does the processes, the
transport, placement across nodes and failure detection.

* **Actors.** :class:`RenderActor` wraps the process worker's ``_Worker``
  (``cloud.render_worker``): it loads the model once (the default MMDiT or a diffusers
  checkpoint), keeps each request's backend and K/V replica, and answers each monotask
  group with the same messages (``done`` / ``resync`` / ``error``). One actor per worker,
  one CPU each (one GPU each where the cluster has GPUs), spread over the nodes. Calls
  from the engine to one actor run in the order they were made (Ray's actor ordering),
  which the replicas' versions rely on, as they rely on the order of a pipe.
* **K/V in the object store.** A patch group's K/V outputs are put in the object store by
  the actor that computed them, as one object per group (:class:`KVPart` names one patch's
  K or V in it: a put per array cost 2 puts and an engine ``get`` per patch, ~4 ms each
  measured under load here, for arrays of ~0.25 MB); the engine keeps the references
  (``k_ref`` / ``v_ref``)
  and forwards *references* in the deltas that bring other actors' replicas up to date,
  so the bytes go from the object store to the actor that needs them, not through the
  engine. Snapshots (a new or replaced actor) are put once per send. The engine still
  reads each output once (``ray.get``, zero-copy from the local store for numpy arrays)
  for its authoritative per-request state, which is what recovery re-runs from.
* **Failures.** A call whose actor died raises ``RayActorError``: the actor is reported
  lost, the engine requeues its unfinished monotasks and starts a replacement (outputs
  are idempotent per (request, step, patch)). A call that has not answered within
  ``EngineConfig.task_deadline_s`` means a hung actor: it is killed and handled the same
  way. A delta whose referenced objects died with their owner makes the receiving actor
  ask for a resync (a snapshot), as a replica at the wrong version does.

``EngineConfig(pool="ray", ray_address=...)`` selects it (``sakura render serve --ray
ADDRESS`` joins a running cluster; ``--pool ray`` starts a local one).
"""

from __future__ import annotations

import itertools
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from sakura.cloud.render_api import EngineConfig, RenderError


def _ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the [ray] extra is not installed
        raise RenderError("the Ray pool needs the [ray] extra: pip install 'sakura-kv[ray]'") from exc
    return ray


LOCAL = "local"  # a Ray address that starts a Ray instance on this machine (Ray's own word)


class KVPart(NamedTuple):
    """One patch's K or V inside its group's object (``{"k": [...], "v": [...]}``)."""

    ref: Any        # the group's ray.ObjectRef
    which: str      # "k" or "v"
    index: int      # the patch's place in the group

    def pick(self, got: dict) -> np.ndarray:
        return got[self.ref][self.which][self.index]


def resolve_parts(values: list) -> list:
    """``values`` with every :class:`KVPart` replaced by its array: one ``ray.get`` for all
    the groups they name."""
    refs = list(dict.fromkeys(v.ref for v in values if isinstance(v, KVPart)))
    got = dict(zip(refs, _ray().get(refs))) if refs else {}
    return [v.pick(got) if isinstance(v, KVPart) else v for v in values]


def init_ray(address: str | None, *, num_cpus: int | None = None,
             object_store_bytes: int | None = None, connect_timeout_s: float = 5.0) -> bool:
    """Connect this process to Ray, the one rule for every Ray user here (the render pool,
    ``sakura build --ray``): nothing when Ray is already initialised (a caller or a test
    chose the cluster); ``address`` None or ``"local"``: start a Ray instance on this
    machine with ``num_cpus`` CPUs and an object store of ``object_store_bytes``; any
    other address (``host:port``, ``auto``, ``ray://...``) joins that cluster. A
    ``host:port`` is first tried with a plain TCP connection (``connect_timeout_s``): Ray
    itself retries an unreachable address for minutes, so an unreachable one is one
    :class:`RenderError` line at once. Returns whether this call initialised Ray (the
    caller then shuts it down)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    common = {"include_dashboard": False, "log_to_driver": False, "logging_level": "warning"}
    if address in (None, LOCAL):
        ray.init(address=LOCAL, num_cpus=num_cpus, object_store_memory=object_store_bytes,
                 **common)
        return True
    _check_reachable(address, connect_timeout_s)
    try:
        ray.init(address=address, **common)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise RenderError(f"cannot join the Ray cluster at {address}: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                          ) from None
    return True


def _check_reachable(address: str, timeout_s: float) -> None:
    """A ``host:port`` Ray address answers a TCP connection (other forms: Ray checks)."""
    import socket

    if "://" in address or address == "auto":
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise RenderError(f"--ray {address!r}: give the head node's HOST:PORT (e.g. "
                          "10.0.0.1:6379), auto (a cluster started on this machine) or "
                          f"{LOCAL} (start one here)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise RenderError(f"cannot reach the Ray cluster at {address}: {reason} (is "
                          "`ray start --head` running there, and the port open?)") from None


class RenderActor:
    """One render worker as a Ray actor (wrapped by ``ray.remote`` in :func:`actor_class`)."""

    def __init__(self, wid: int, weights, device: str, threads: int, model_name, model_path):
        import torch
        from sakura.cloud.render_worker import _Worker, pick_device  # lazy: torch (actor)
        from sakura.dit.adapters.registry import load_adapter  # lazy: torch (actor)
        from sakura.dit.weights import load_model  # lazy: torch (actor)

        torch.set_num_threads(max(1, threads))
        self.wid = wid
        self.device = pick_device(wid, device)
        if model_name:
            model = load_adapter(model_name, model_path, device=self.device)
        else:
            model = load_model(weights).to(self.device)
        self.worker = _Worker(model)

    def info(self) -> tuple:
        node = _ray().get_runtime_context().get_node_id()
        return ("ready", self.wid, os.getpid(), self.device, node)

    def close(self, rid: int) -> None:
        self.worker.close(rid)

    def _resolve(self, payload: dict) -> None:
        """Fetch the object-store references a sync carries (in place)."""
        ray = _ray()
        sync = payload.get("sync")
        if sync is None:
            return
        if sync[0] == "snapshot":
            _, version, k, v = sync
            k, v = ray.get([k, v]) if isinstance(k, ray.ObjectRef) else (k, v)
            payload["sync"] = ("snapshot", version, k, v)
        elif sync[0] == "delta":
            _, since, version, writes = sync
            kv = resolve_parts([x for w in writes for x in w[1:3]])
            writes = [(w[0], kv[2 * n], kv[2 * n + 1]) for n, w in enumerate(writes)]
            payload["sync"] = ("delta", since, version, writes)

    def run(self, payload: dict) -> tuple:
        from sakura.cloud.render_worker import ResyncNeeded  # lazy: torch (actor)

        ray = _ray()
        keys = payload["keys"]
        payload["x"] = np.array(payload["x"])  # writable (object-store buffers are not)
        try:
            try:
                self._resolve(payload)
            except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError) as exc:
                raise ResyncNeeded(str(exc)) from exc
            out = self.worker.run(payload)
        except ResyncNeeded:
            self.worker.close(payload["rid"])  # the engine resends the spec and a snapshot
            return ("resync", self.wid, payload["rid"], payload["step"], keys)
        except Exception:
            return ("error", self.wid, payload["rid"], payload["step"], keys,
                    traceback.format_exc())
        out["keys"] = keys
        if out["kind"] == "patches":  # K/V to the object store; the engine keeps references
            patches = out["patches"]
            ref = ray.put({"k": [p["k"] for p in patches], "v": [p["v"] for p in patches]})
            for i, p in enumerate(patches):
                p["k_ref"], p["v_ref"] = KVPart(ref, "k", i), KVPart(ref, "v", i)
                # only the references go back: the arrays in the returned value too stored
                # every K/V twice (the engine reads them through the references)
                p["k"] = p["v"] = None
        return ("done", self.wid, out)


_ACTOR = None


def actor_class():
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _ray().remote(RenderActor)
    return _ACTOR


@dataclass
class RayWorker:
    """A render actor as the engine sees a worker (the fields of ``WorkerProc``)."""

    wid: int
    actor: object
    pending: dict = field(default_factory=dict)   # ObjectRef -> (sent at, what)
    ready: bool = False
    pid: int = 0
    device: str = ""
    alive: bool = True
    done_groups: int = 0
    node: str = ""
    # the process pool's feeder times K/V-carrying sends (WorkerProc.sync_send_s); Ray's
    # transfers are not timed here, so this stays empty
    sync_send_s: dict = field(default_factory=dict)

    def send(self, msg) -> None:
        if not self.alive:
            return
        if msg[0] == "run":
            payload = _to_store(msg[1])
            self.pending[self.actor.run.remote(payload)] = (time.monotonic(), "run")
        elif msg[0] == "close":
            self.actor.close.remote(msg[1])

    def mark_lost(self) -> None:
        self.alive = False
        self.pending.clear()
        try:
            _ray().kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass


def _to_store(payload: dict) -> dict:
    """Put a snapshot's K/V in the object store (the call then carries references)."""
    ray = _ray()
    sync = payload.get("sync")
    if sync is not None and sync[0] == "snapshot" and isinstance(sync[2], np.ndarray):
        payload = dict(payload)
        payload["sync"] = (sync[0], sync[1], ray.put(sync[2]), ray.put(sync[3]))
    return payload


class RayWorkerPool:
    """The engine's workers as Ray actors, by id (ids are never reused)."""

    def __init__(self, cfg: EngineConfig):
        ray = _ray()
        self.cfg = cfg
        self.workers: dict[int, RayWorker] = {}
        self._wid = itertools.count()
        self.started_ray = init_ray(cfg.ray_address, num_cpus=max(cfg.workers, 1),
                                    object_store_bytes=cfg.ray_object_store_bytes)
        gpus = ray.cluster_resources().get("GPU", 0)
        self.num_gpus = 1 if cfg.device != "cpu" and gpus >= 1 else 0

    def spawn(self) -> RayWorker:
        cfg = self.cfg
        wid = next(self._wid)
        actor = actor_class().options(
            num_cpus=1, num_gpus=self.num_gpus, max_restarts=0, scheduling_strategy="SPREAD",
            name=None).remote(wid, cfg.weights, "cuda" if self.num_gpus else
                              ("cpu" if cfg.device == "auto" else cfg.device),
                              cfg.threads, cfg.model, cfg.model_path)
        w = RayWorker(wid, actor)
        w.pending[actor.info.remote()] = (time.monotonic(), "info")
        self.workers[wid] = w
        return w

    def wake(self) -> None:
        """Nothing to cut short: :meth:`poll` waits at most its (short) timeout."""

    def poll(self, timeout: float, on_message: Callable[[RayWorker, tuple], None],
             on_lost: Callable[[RayWorker], None]) -> None:
        ray = _ray()
        live = [w for w in self.workers.values() if w.alive]
        owner = {ref: w for w in live for ref in w.pending}
        done = []
        if owner:  # wait for the first answer, then take every one already there
            first, rest = ray.wait(list(owner), num_returns=1, timeout=timeout)
            if first and rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                first = first + more
            done = first
        else:
            time.sleep(timeout)
        for ref in done:
            w = owner[ref]
            if not w.alive or ref not in w.pending:
                continue
            del w.pending[ref]
            try:
                msg = ray.get(ref)
            except ray.exceptions.RayError:  # the actor died (or its answer is lost)
                on_lost(w)
                continue
            if msg[0] == "ready":  # the engine's message has no node: keep it here
                w.node, msg = msg[4], msg[:4]
            if msg[0] == "done":
                out = msg[2]
                if out["kind"] == "patches":  # the engine keeps the references for deltas
                    ps = out["patches"]
                    kv = resolve_parts([x for p in ps for x in (p["k_ref"], p["v_ref"])])
                    for n, p in enumerate(ps):
                        p["k"], p["v"] = kv[2 * n], kv[2 * n + 1]
                elif out["kind"] == "probe":
                    out["probes"] = {label: (np.array(m), *rest)
                                     for label, (m, *rest) in out["probes"].items()}
                elif out["kind"] == "full":
                    # the engine's K/V store is written in place: its own copy, not the
                    # object store's read-only buffer
                    f = out["full"]
                    for key in ("velocity", "text_attn", "k", "v"):
                        if f[key] is not None:
                            f[key] = np.array(f[key])
            on_message(w, msg)
        now = time.monotonic()
        limit = self.cfg.task_deadline_s
        for w in live:  # a call past its deadline: the actor is hung
            if w.alive and w.ready and limit and any(
                    kind == "run" and now - t0 > limit for t0, kind in w.pending.values()):
                on_lost(w)

    def close(self) -> None:
        ray = _ray()
        for w in self.workers.values():
            if w.alive:
                w.alive = False
                try:
                    ray.kill(w.actor, no_restart=True)
                except Exception:
                    pass
        if self.started_ray:
            ray.shutdown()


def nodes_of(pool: RayWorkerPool) -> dict[int, str]:
    """Live workers: id -> the Ray node they run on."""
    return {w.wid: w.node for w in pool.workers.values() if w.alive and w.ready}


class LocalCluster:
    """A Ray cluster of ``nodes`` nodes on this machine, as an operator starts one: ``ray
    start --head`` then ``ray start --address`` per extra node, each ``--block``ed in its
    own process group (stopping it stops exactly what it started, nothing else of Ray on
    the machine). Token authentication is on (Ray's default once a token exists)."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 1,
                 object_store_bytes: int = 200_000_000, port: int = 6399):
        self.nodes, self.cpus, self.store, self.port = nodes, cpus_per_node, object_store_bytes, port
        self.procs: list = []
        self.address = ""

    def __enter__(self) -> LocalCluster:
        import sys
        import tempfile

        os.environ.setdefault("RAY_AUTH_MODE", "token")
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        exe = os.path.join(os.path.dirname(sys.executable), "ray")
        self.logs = tempfile.mkdtemp(prefix="sakura-ray-")  # kept: the nodes' logs
        common = [f"--num-cpus={self.cpus}", f"--object-store-memory={self.store}",
                  "--disable-usage-stats", "--block"]
        head_log = os.path.join(self.logs, "head.log")
        self._start([exe, "start", "--head", f"--port={self.port}",
                     "--include-dashboard=false", *common], env, head_log)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in open(head_log).read():
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                self.__exit__()
                raise RenderError(f"ray start --head failed (see {head_log})")
            time.sleep(0.5)
        self.address = f"127.0.0.1:{self.port}"
        for i in range(1, self.nodes):
            self._start([exe, "start", f"--address={self.address}", *common], env,
                        os.path.join(self.logs, f"node{i}.log"))
        ray = _ray()
        try:
            ray.init(address=self.address, log_to_driver=False, logging_level="warning")
        except (ConnectionError, RuntimeError) as exc:  # e.g. auth: stop what was started
            self.__exit__()
            raise RenderError(f"cannot join the Ray cluster started at {self.address}: "
                              f"{exc} (see {self.logs})") from None
        while len([n for n in ray.nodes() if n["Alive"]]) < self.nodes:
            if time.monotonic() > deadline:
                self.__exit__()
                raise RenderError(f"only {len(ray.nodes())} of {self.nodes} Ray nodes joined")
            time.sleep(0.5)
        return self

    def _start(self, cmd, env, log) -> None:
        import subprocess

        with open(log, "w") as f:
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def alive_nodes(self) -> int:
        return len([n for n in _ray().nodes() if n["Alive"]])

    def remove_node(self, i: int) -> None:
        """Take worker node ``i`` (1 ... nodes - 1) away at once, as a machine that fails:
        its ``ray start`` process group (raylet, object store, actors) is SIGKILLed."""
        import signal

        if not 1 <= i < len(self.procs):
            raise ValueError(f"node {i}: worker nodes are 1..{len(self.procs) - 1}")
        p = self.procs[i]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def __exit__(self, *exc) -> None:
        import signal
        import subprocess

        ray = _ray()
        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []


__all__ = ["LOCAL", "LocalCluster", "RayWorker", "RayWorkerPool", "RenderActor", "actor_class", "init_ray", "nodes_of"]
