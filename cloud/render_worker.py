"""A render worker process: loads the model once (the default MMDiT or a diffusers
checkpoint through ``dit.adapters``), runs monotask groups sent by the engine: whole
steps, gate probes (``dit.regional`` backends' ``probe``) and patch groups.

Protocol over two one-way pipes (pickled tuples; tensors travel as numpy arrays, never as
shared-memory handles, so a worker killed mid-send cannot leave the parent holding a
dangling handle):

* worker -> engine: ``("ready", wid, pid, device)`` once the model is loaded;
  ``("done", wid, payload)`` per group; ``("resync", wid, rid, step, keys)`` when its
  copy of a request's K/V store is not at the version the engine assumed;
  ``("error", wid, rid, step, keys, traceback)``.
* engine -> worker (a second pipe): ``("run", payload)``, ``("ahead", rid, step, writes)``
  (another worker's outputs of ``step``, before its boundary: ``cloud.render_replicas``),
  ``("close", rid)``, ``("stop",)``.

The worker keeps a *replica* of each request's K/V store (the stale context of patch
tasks) at a version = the step whose start it reflects, and a stash of the patch outputs
it computed itself. The engine either says nothing (the replica is current), sends a
*delta* ``(since, version, writes)`` (the outputs of step ``since`` computed elsewhere;
the worker adds its own stash of that step and the writes and moves to ``version``, which
may be several steps on, since a step where every patch was skipped writes nothing), or a
full *snapshot*. Writes are disjoint token sets,
so the result does not depend on the order they are applied in.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
from sakura.dit.adapters.inputs import Conditioning
from sakura.dit.adapters.regional import AdapterRegional
from sakura.dit.adapters.registry import load_adapter
from sakura.dit.regional import KVStore
from sakura.dit.regional_mmdit import generation_backend
from sakura.dit.weights import load_model


class ResyncNeeded(Exception):
    """The replica is not at the version the engine assumed."""


@dataclass
class Replica:
    k: torch.Tensor
    v: torch.Tensor
    version: int
    stash: dict[int, list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    # other workers' writes of a step, sent ahead of its boundary (patch parallelism)
    ahead: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = field(default_factory=dict)

    def write(self, idx, k, v) -> None:
        i = torch.as_tensor(np.asarray(idx), dtype=torch.long)
        self.k[:, :, :, i] = torch.as_tensor(k)
        self.v[:, :, :, i] = torch.as_tensor(v)


def pick_device(wid: int, device: str) -> str:
    if device == "auto":
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return f"cuda:{wid % torch.cuda.device_count()}"
        return "cpu"
    return device


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


class _Worker:
    def __init__(self, model):
        self.model = model  # an MMDiT or a dit.adapters ModelAdapter
        self.backends: dict[int, object] = {}
        self.replicas: dict[int, Replica] = {}
        self.ahead_s: dict[int, float] = {}  # request -> time taking writes sent ahead

    def make_backend(self, spec: dict):
        if spec["kind"] == "mmdit":
            txt = _t(spec["txt"])
            unc = _t(spec["txt_uncond"]) if spec["txt_uncond"] is not None else None
            return generation_backend(self.model, txt, unc, spec["size"], spec["guidance"])

        a = self.model

        def cond(c):
            return Conditioning(_t(c[0]), None if c[1] is None else _t(c[1]))

        conds = [spec["cond"]] + ([spec["uncond"]] if spec["uncond"] is not None else [])
        branches = [a.prepare_branch(cond(c)) for c in conds]
        g = spec["grid"]
        return AdapterRegional(a, branches, spec["guidance"], tuple(g),
                               torch.arange(g[0] * g[1]))

    def backend(self, rid: int, spec: dict | None):
        if spec is not None:
            self.backends[rid] = self.make_backend(spec)
        if rid not in self.backends:
            raise ResyncNeeded(f"request {rid} was never opened here")
        return self.backends[rid]

    def sync(self, rid: int, step: int, sync) -> Replica:
        if sync is not None and sync[0] == "snapshot":
            _, version, k, v = sync
            self.replicas[rid] = Replica(_t(k).clone(), _t(v).clone(), version)
        elif sync is not None and sync[0] == "delta":
            _, since, version, writes = sync[:4]
            expect = sync[4] if len(sync) > 4 else 0
            rep = self.replicas.get(rid)
            if rep is None or rep.version != since:
                raise ResyncNeeded(f"request {rid}: replica not at step {since}")
            ahead = rep.ahead.pop(since, [])
            if len(ahead) != expect:
                raise ResyncNeeded(f"request {rid}: {len(ahead)} writes sent ahead, not {expect}")
            for idx, k, v in rep.stash.pop(since, []) + ahead:
                rep.write(idx, k, v)
            for idx, k, v in writes:
                rep.write(idx, k, v)
            rep.version = version
        rep = self.replicas.get(rid)
        if rep is None or rep.version != step:
            raise ResyncNeeded(f"request {rid}: replica not at step {step}")
        return rep

    def run(self, p: dict) -> dict:
        rid, step = p["rid"], p["step"]
        be = self.backend(rid, p.get("spec"))
        x = _t(p["x"])
        t0 = time.perf_counter()
        if p["kind"] == "full":
            branch = p.get("branch")
            # one guidance branch: the default MMDiT only (cloud.render), so the argument
            # goes only where it is given
            res = be.run_full(step, p["t"], x, p["probe"], p["want_kv"],
                              **({} if branch is None else {"branch": branch}))
            out = {"velocity": _np(res.velocity), "img_keys": res.img_keys,
                   "text_attn": None if res.text_attn is None else _np(res.text_attn),
                   "probe_macs": res.probe_macs, "k": None, "v": None}
            if res.kv is not None:
                out["k"], out["v"] = _np(res.kv.k), _np(res.kv.v)
                if branch is None:
                    self.replicas[rid] = Replica(res.kv.k.clone(), res.kv.v.clone(), step + 1)
                else:  # half of the store: no replica (the engine sends a snapshot)
                    self.replicas.pop(rid, None)
            return {"rid": rid, "step": step, "kind": "full", "full": out, "branch": branch,
                    "seconds": time.perf_counter() - t0}
        if p["kind"] == "probe":
            idx = [_t(i).long() for i in p["patches"]]
            probes = {}
            for label, t, x_in, depth in p["probes"]:
                r = be.probe(step, t, _t(x_in), idx, depth)
                probes[label] = (_np(r.mass), r.img_keys, r.macs)
            return {"rid": rid, "step": step, "kind": "probe", "probes": probes,
                    "seconds": time.perf_counter() - t0}
        store = None
        sync_s = p.get("load_s", 0.0) if p.get("sync") is not None else 0.0
        sync_s += self.ahead_s.pop(rid, 0.0)
        apply_s = 0.0
        if p["context"]:
            t1 = time.perf_counter()
            rep = self.sync(rid, step, p.get("sync"))
            store = KVStore(rep.k, rep.v)
            if p.get("sync") is not None:
                apply_s = time.perf_counter() - t1
        idx = [_t(i).long() for _, i in p["patches"]]
        outs = be.run_patches(step, p["t"], x, idx, store, joint=p.get("joint", False),
                              measure=p.get("measure", True))
        if p["context"]:
            rep = self.replicas[rid]
            for s in [s for s in rep.stash if s < step]:
                del rep.stash[s]
            rep.stash.setdefault(step, []).extend(
                (i.numpy(), r.k, r.v) for i, r in zip(idx, outs))
        patches = [{"patch": pid, "velocity": _np(r.velocity), "k": _np(r.k), "v": _np(r.v),
                    "self_mass": r.self_mass, "img_keys": r.img_keys,
                    "probe_macs": r.probe_macs}
                   for (pid, _), r in zip(p["patches"], outs)]
        # "seconds" is compute; applying the sync counts as K/V exchange ("sync_s")
        return {"rid": rid, "step": step, "kind": "patches", "patches": patches,
                "seconds": time.perf_counter() - t0 - apply_s, "sync_s": sync_s + apply_s}

    def ahead(self, rid: int, step: int, writes: list) -> None:
        """Another worker's outputs of ``step``, sent before the step's boundary: kept for
        the delta that moves the replica past ``step`` (dropped if the replica is not at
        it: that delta then finds them missing and asks for a snapshot)."""
        rep = self.replicas.get(rid)
        if rep is not None and rep.version == step:
            for s in [s for s in rep.ahead if s < step]:
                del rep.ahead[s]
            rep.ahead.setdefault(step, []).extend(writes)

    def close(self, rid: int) -> None:
        self.ahead_s.pop(rid, None)
        self.backends.pop(rid, None)
        self.replicas.pop(rid, None)


def worker_main(wid: int, inbox, conn, weights: str | None, device: str, threads: int,
                model_name: str | None = None, model_path: str | None = None) -> None:
    """Entry point of a spawned worker process: messages come on ``inbox``, answers go
    out on ``conn``. The model is the default MMDiT (``weights``) or the diffusers
    checkpoint ``model_path`` as ``model_name``."""
    torch.set_num_threads(max(1, threads))
    dev = pick_device(wid, device)
    if model_name:
        model = load_adapter(model_name, model_path, device=dev)
    else:
        model = load_model(weights).to(dev)
    worker = _Worker(model)
    conn.send(("ready", wid, os.getpid(), dev))
    while True:
        try:
            buf = inbox.recv_bytes()
        except (EOFError, OSError):
            return
        t0 = time.perf_counter()
        msg = ForkingPickler.loads(buf)  # what Connection.recv does, timed (K/V exchange)
        if msg[0] == "run":
            msg[1]["load_s"] = time.perf_counter() - t0
        if msg[0] == "stop":
            return
        if msg[0] == "close":
            worker.close(msg[1])
            continue
        if msg[0] == "ahead":
            worker.ahead(*msg[1:])
            worker.ahead_s[msg[1]] = (worker.ahead_s.get(msg[1], 0.0)
                                      + time.perf_counter() - t0)
            continue
        payload = msg[1]
        keys = payload["keys"]
        try:
            out = worker.run(payload)
            out["keys"] = keys
            conn.send(("done", wid, out))
        except ResyncNeeded:
            worker.close(payload["rid"])  # the engine resends the spec and a snapshot
            conn.send(("resync", wid, payload["rid"], payload["step"], keys))
        except Exception:  # reported to the engine, which fails the request
            conn.send(("error", wid, payload["rid"], payload["step"], keys, traceback.format_exc()))


__all__ = ["Replica", "ResyncNeeded", "pick_device", "worker_main"]
