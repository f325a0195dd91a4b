"""``sakura bench edit``: every policy on one template and one trace window, in one run.

Regime-matched (``DESIGN.md``, "Measuring"): the compute floor ``T`` and ``exact`` come from
the edit with the whole FP16 cache resident, and the trace is scaled to the regime
(``edge/floor.py``). Every policy then runs the same edit through the same paced link (real
HTTP, the trace restarted at the same start point for each), and is compared with ``exact``.

Packs: ``--server URL`` uses a running server; ``--catalog DIR`` serves a published
catalog; otherwise the bench runs the provider's builder into ``<cache-dir>/packs``
(``edge/policy_packs.py``). The server runs as a separate ``sakura serve`` process, as a
real server would (``edge/server_process.py``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from sakura.dit.editing import EditRequest, Template
from sakura.dit.templates import load_catalog
from sakura.dit.weights import DEFAULT_WEIGHTS, load_model
from sakura.edge.allocator import POLICIES
from sakura.edge.errors import EdgeError
from sakura.edge.floor import Floor, regime_factor, resident_floor
from sakura.edge.netem import matched_rtt_ms, shaped
from sakura.edge.policy_packs import (
    build_packs,
    catalog_entry,
    catalog_usable,
    policy_packs,
    prefetch_manifests,
)
from sakura.edge.quality import psnr, ssim
from sakura.edge.runtime import EdgeRuntime, EditOptions, EditResult
from sakura.edge.server_process import ServerProcess
from sakura.edge.timeline import plot_timeline
from sakura.traces import Trace, load_trace, trace_set
from sakura.traces.impair import DEFAULT_RTT_MS
from sakura.traces.linkproc import pin, split_cpus

from sakura.atomic import write_atomic
from sakura.digest import file_sha256

DEFAULT_POLICIES = ("local", "fp16", "intq", "cachegen", "svd", "sakura",
                    "sakura-fixed-config", "sakura-fixed-bits")


@dataclass
class BenchSpec:
    """What ``sakura bench edit`` runs."""

    json_path: Path
    quick: bool = False
    template: str | None = None
    trace: str | None = None
    start_s: float | None = None
    policies: tuple[str, ...] = DEFAULT_POLICIES
    server: str | None = None
    catalog: str | None = None
    cache_dir: Path = Path("runs/edge-bench")
    weights: str | None = None
    regime_x: float = 10.0
    seed: int = 100
    runs: int | None = None
    plots: Path | None = None
    threads: int | None = None  # torch threads the command set (recorded)
    runtime: str = "native"     # the device runtime (edge.native_runtime or edge.pipeline)
    background_load: int = 0    # busy processes run beside the edits
    compare_python: bool = False  # also sakura and local on the Python runtime, same run
    reconstruct: str = "cpu"    # the native runtime's reconstruct stage (cpu or opencl)
    rtt_ms: float = DEFAULT_RTT_MS  # the network's round trip
    rtt_scale: str = "matched"  # matched: the link carries rtt_ms x T / T_phone; none: rtt_ms
    # where the native receive/reconstruct threads run: "network" (the server and link's
    # CPUs, the phone's modem and GPU) or "device" (beside execution, to measure the cost)
    pipeline_cpus: str = "network"
    log: Any = field(default=print)


def default_trace() -> Path:
    return trace_set("5g")[0]


def run_bench(spec: BenchSpec) -> dict[str, Any]:
    for p in spec.policies:
        if p not in POLICIES:
            raise EdgeError(f"unknown policy {p!r}; known: {', '.join(POLICIES)}")
    t_begin = time.monotonic()
    cpus = _pin_device()
    weights = Path(spec.weights) if spec.weights else DEFAULT_WEIGHTS
    model = load_model(weights)
    catalog = load_catalog()
    tid = spec.template or next(iter(catalog))
    if tid not in catalog:
        raise EdgeError(f"template {tid!r} is not in the device catalog ({', '.join(catalog)})")
    tspec = catalog[tid]
    runtime = EdgeRuntime(model, weights_sha256=file_sha256(weights), runtime=spec.runtime)
    template = tspec.to_template(runtime.encoder)
    prompt = tspec.evaluation_prompts[0]
    req = runtime.request(prompt, seed=spec.seed)
    log = spec.log

    server_proc = None
    server = spec.server
    if server is None:
        if spec.catalog:
            catalog_dir = Path(spec.catalog)
        else:
            catalog_dir = spec.cache_dir / "packs"
            stale = ((catalog_dir / "catalog.json").exists()
                     and not catalog_usable(catalog_dir, tid))
            if stale:
                log(f"packs of {tid} in {catalog_dir} no longer decode (codec changed)")
            log(f"sakura build {tid} into {catalog_dir} (skipped when up to date) ...")
            t0 = time.monotonic()
            build_packs(catalog_dir, tid, weights, force=stale, log=log)
            log(f"  packs ready in {time.monotonic() - t0:.1f} s")
        server_proc = ServerProcess(catalog_dir, cpus=cpus[1] if cpus else None).start()
        server = server_proc.url
    try:
        with BackgroundLoad(spec.background_load):
            return bench_edit(spec, runtime, tid, template, req, prompt, server, t_begin,
                              cpus=cpus)
    finally:
        if server_proc is not None:
            server_proc.stop()


def _pin_device() -> tuple[set[int], set[int]] | None:
    """Pin this process (the device runtime) to all CPUs but one and return ``(device,
    network)`` CPU sets, the network one for the server and the link; None with one CPU."""
    cpus = split_cpus()
    if cpus is not None:
        pin(0, cpus[0])
    return cpus


class BackgroundLoad:
    """``n`` busy processes (a CPU hog each, not pinned) for the duration of a block."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BackgroundLoad:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                               stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


@dataclass
class Regime:
    """The trace of a regime-matched bench: scaled so that the FP16 cache at its median rate
    takes ``regime_x`` times the compute floor, and the start points of the runs."""

    trace_path: Path
    raw: Trace
    median_bps: float
    factor: float
    trace: Trace
    scaled_median: float
    starts: list[float]


def _regime(spec: BenchSpec, fp16_bytes: int, floor_s: float) -> Regime:
    """Scale the bench's trace to the regime and pick its start points."""
    trace_path = Path(spec.trace) if spec.trace else default_trace()
    raw = load_trace(trace_path)
    median_bps = float(raw.stats()["median_mbps"]) * 1e6
    if not median_bps > 0:
        raise EdgeError(f"trace {trace_path} has a median rate of 0: cannot match the regime")
    factor = regime_factor(fp16_bytes, floor_s, median_bps, spec.regime_x)
    scaled_median = median_bps * factor
    runs = spec.runs or (1 if spec.quick else 3)
    span = max(30.0, 3 * fp16_bytes * 8.0 / scaled_median)
    starts = ([float(spec.start_s)] if spec.start_s is not None and runs == 1 else
              [float(s) for s in raw.sample_starts(runs, seed=spec.seed, span_s=span)])
    if spec.start_s is not None and runs > 1:
        starts = [float(spec.start_s) + 7.0 * i for i in range(runs)]
    return Regime(trace_path, raw, median_bps, factor, raw.scaled(factor), scaled_median, starts)


@dataclass
class _Session:
    """What every policy run of one bench shares: the edit, the shaped link, the packs."""

    spec: BenchSpec
    tid: str
    template: Template
    req: EditRequest
    server: str
    link_url: str
    link: Any
    regime: Regime
    packs: dict[str, str | None]
    cpus: tuple[set[int], set[int]] | None


def _run_policies(s: _Session, rt: EdgeRuntime, policies: tuple[str, ...],
                  reference: torch.Tensor) -> tuple[dict[str, list[EditResult]], float | None]:
    """A warm-up edit (the rate prior), then every policy at every start point."""
    spec, starts, log = s.spec, s.regime.starts, s.spec.log
    s.link.restart(starts[0])
    stage = spec.reconstruct if rt.runtime == "native" else "cpu"
    # the native pipeline's receive and reconstruct threads on the network's core
    # (the phone's modem and GPU), execution alone on the device's
    io_cpus = (tuple(sorted(s.cpus[1])) if s.cpus and rt.runtime == "native"
               and spec.pipeline_cpus == "network" else None)
    rt.edit(s.link_url, s.tid, s.template, s.req, "sakura",
            options=EditOptions(budget_rate_bps=s.regime.scaled_median, reconstruct=stage,
                                pipeline_cpus=io_cpus))
    prior = rt.remembered_rate(s.link_url)
    log(f"{rt.runtime} runtime: warm-up edit done; rate prior "
        f"{0 if prior is None else prior / 1e6:.2f} Mbit/s")
    options = EditOptions(budget_rate_bps=s.regime.scaled_median, initial_rate_bps=prior,
                          reconstruct=stage, pipeline_cpus=io_cpus)
    for policy in policies:  # every pack's manifest and shard table, as for sakura
        if policy != "local":
            rt.warm(s.link_url, s.tid, s.template, policy,
                    options=replace(options, pack=s.packs[policy]))
    out: dict[str, list[EditResult]] = {p: [] for p in policies}
    for start in starts:
        for policy in policies:
            if policy == "local":
                res = rt.edit(s.server, s.tid, s.template, s.req, "local")
            else:
                s.link.restart(start)
                res = rt.edit(s.link_url, s.tid, s.template, s.req, policy,
                              options=replace(options, pack=s.packs[policy]))
            res.compare(reference)
            out[policy].append(res)
            log(f"  {rt.runtime:6s} start {start:7.2f}  {policy:20s} "
                f"{res.latency_s:7.3f} s  {res.bytes / 1e6:7.3f} MB  stalls "
                f"{res.stalls:3d}  PSNR {res.psnr_db:6.2f} dB")
            if spec.plots is not None and res.timeline:
                plot_timeline(res.timeline,
                              spec.plots / f"{rt.runtime}-{policy}-{start:g}.png",
                              f"{policy} ({rt.runtime} runtime) on {s.tid}, "
                              f"{s.regime.trace_path.name} @ {start:g} s")
    return out, prior


def _python_side(s: _Session, runtime: EdgeRuntime, codecs: list[str]) -> dict[str, Any]:
    """The reference (Python) runtime on the same link, packs and start points, in this run:
    sakura and local, against its own ``exact``."""
    py = EdgeRuntime(runtime.model, encoder=runtime.encoder,
                     weights_sha256=runtime.weights_sha256, runtime="python")
    asyncio.run(prefetch_manifests(s.server, s.tid, codecs, py))
    py.profile(s.tid, py.prepared(s.tid, s.template), s.req)
    py_floor = resident_floor(py, s.server, s.tid, s.template, s.req, repeats=3)
    py_res, _ = _run_policies(s, py, tuple(p for p in ("sakura", "local")
                                           if p in s.spec.policies), py_floor.image)
    python_side = {
        "compute_bound_s": py_floor.seconds,
        "latency_s": {p: _median([r.latency_s for r in rs]) for p, rs in py_res.items()},
        "exec_s": {p: _median([r.exec_s for r in rs]) for p, rs in py_res.items()},
        "psnr_db_vs_its_exact": {p: _finite_or_inf(min(r.psnr_db for r in rs))
                                 for p, rs in py_res.items()}}
    if "sakura" in py_res:
        lat = python_side["latency_s"]
        python_side["exec_inflation"] = (python_side["exec_s"]["sakura"]
                                         / py_floor.shard_exec_s)
        python_side["e2e_over_floor"] = lat["sakura"] / py_floor.seconds
    return python_side


def bench_edit(spec: BenchSpec, runtime: EdgeRuntime, tid: str, template: Template,
               req: EditRequest, prompt: str, server: str, t_begin: float | None = None,
               cpus: tuple[set[int], set[int]] | None = None) -> dict[str, Any]:
    """Every policy of ``spec`` on one edit against ``server`` (which serves ``tid``)."""
    t_begin = time.monotonic() if t_begin is None else t_begin
    log = spec.log
    if runtime.runtime == "python":
        runtime.profile(tid, runtime.prepared(tid, template), req)  # calibration, warm-up
    floor = resident_floor(runtime, server, tid, template, req, repeats=3)
    exact, floor_s, fp16_manifest = floor.image, floor.seconds, floor.manifest
    fp16_bytes = int(fp16_manifest["fp16_bytes"])
    regime = _regime(spec, fp16_bytes, floor_s)
    log(f"regime-matched: T = {floor_s:.3f} s masked execution, FP16 cache {fp16_bytes / 1e6:.2f}"
        f" MB; trace {regime.trace_path.name} median {regime.median_bps / 1e6:.1f} Mbit/s x "
        f"{regime.factor:.4g} = {regime.scaled_median / 1e6:.2f} Mbit/s (FP16 at median = "
        f"{spec.regime_x:g} x T); starts {regime.starts}")

    # Device state as on a phone that has used the template before: manifests cached
    # (revalidated per edit), and a rate prior from a warm-up edit over the same link; every
    # policy starts from that same prior.
    entry = asyncio.run(catalog_entry(server, tid))
    packs = policy_packs(set(entry.get("codecs", {})), spec.policies, tid)
    codecs = sorted({c for c in packs.values() if c})
    asyncio.run(prefetch_manifests(server, tid, codecs, runtime))
    manifest_bytes = {c: runtime.manifests[(tid, c)].size for c in codecs}
    python_side: dict[str, Any] | None = None
    ratio = float(entry.get("token_mask_ratio") or 0.0)
    link_rtt = (matched_rtt_ms(spec.rtt_ms, floor_s, ratio) if spec.rtt_scale == "matched"
                else float(spec.rtt_ms))
    log(f"link round trip {link_rtt:.2f} ms ({spec.rtt_ms:g} ms, rtt_scale {spec.rtt_scale}: "
        f"{'x T / the phone profile masked execution' if spec.rtt_scale == 'matched' else 'as is'})")
    with shaped(server, regime.trace, regime.starts[0], rtt_ms=link_rtt,
                cpus=cpus[1] if cpus else None) as (link_url, link):
        session = _Session(spec, tid, template, req, server, link_url, link, regime, packs,
                           cpus)
        results, prior = _run_policies(session, runtime, spec.policies, exact)
        if spec.compare_python and runtime.runtime == "native":
            python_side = _python_side(session, runtime, codecs)

    # the machine's load may have changed during the runs: measure the floor again
    floor_after = resident_floor(runtime, server, tid, template, req, repeats=1).seconds
    drift = floor_after / floor_s
    if not 0.67 <= drift <= 1.5:
        log(f"WARNING: the compute floor moved from {floor_s:.2f} s to {floor_after:.2f} s "
            "during the runs (machine load): the regime factor and the ratios are unreliable")
    doc = _document(session, runtime, prompt, floor, floor_after, results, prior,
                    manifest_bytes, ratio, link_rtt)
    doc["elapsed_s"] = time.monotonic() - t_begin
    lat = doc["latency_s"]
    if "sakura" in lat:
        doc["speedup_of_sakura"] = {p: lat[p] / lat["sakura"] for p in lat if p != "sakura"}
        # streamed execution over the same shards' execution with the cache resident, and
        # end to end over the compute floor (issue 18's targets: <= 1.10 and <= 1.25)
        doc["exec_inflation"] = doc["exec_s"]["sakura"] / floor.shard_exec_s
        doc["e2e_over_floor"] = lat["sakura"] / floor_s
    if python_side is not None:
        doc["python_runtime"] = python_side
    return doc


def _document(s: _Session, runtime: EdgeRuntime, prompt: str, floor: Floor, floor_after: float,
              results: dict[str, list[EditResult]], prior: float | None,
              manifest_bytes: dict[str, int], ratio: float, link_rtt: float
              ) -> dict[str, Any]:
    """The bench's JSON: the setting, the regime, the floor, and per policy the medians."""
    spec, regime, cpus = s.spec, s.regime, s.cpus
    med, psnr_value = _median, _finite_or_inf
    fp16_bytes = int(floor.manifest["fp16_bytes"])
    return {
        "bench": "edit",
        "quick": spec.quick,
        "runtime": runtime.runtime,
        "reconstruct": spec.reconstruct if runtime.runtime == "native" else "cpu",
        "background_load": spec.background_load,
        "cpus": ({"device": sorted(cpus[0]), "server_and_link": sorted(cpus[1]),
                  "pipeline_threads": (sorted(cpus[1]) if runtime.runtime == "native"
                                       and spec.pipeline_cpus == "network"
                                       else sorted(cpus[0]))}
                 if cpus else None),
        "template": s.tid,
        "prompt": prompt,
        "seed": spec.seed,
        "steps": s.template.steps,
        "server": s.server,
        "torch_threads": torch.get_num_threads(),
        "gil_switch_interval_s": sys.getswitchinterval(),
        "trace": {"path": str(regime.trace_path), "name": regime.raw.name,
                  "starts_s": regime.starts, "raw": regime.raw.stats(),
                  "scaled_median_mbps": regime.scaled_median / 1e6},
        "regime": {
            "mode": "regime-matched",
            "factor": regime.factor,
            "target": f"FP16 cache at the trace median takes {spec.regime_x:g}x the masked "
                      "execution time",
            "regime_x": spec.regime_x,
            "raw_median_mbps": regime.median_bps / 1e6,
            "scaled_median_mbps": regime.scaled_median / 1e6,
            "fp16_bytes": fp16_bytes,
            "masked_exec_s": floor.seconds,
            "fp16_at_median_s": fp16_bytes * 8.0 / regime.scaled_median,
            "token_mask_ratio": ratio,
        },
        "rtt_ms": spec.rtt_ms,
        "rtt_scale": spec.rtt_scale,
        "link_rtt_ms": link_rtt,
        "compute_bound_s": floor.seconds,
        "compute_bound_shard_exec_s": floor.shard_exec_s,
        "compute_bound_after_s": floor_after,
        "load_drift": floor_after / floor.seconds,
        "exec_s": {p: med([r.exec_s for r in rs]) for p, rs in results.items()},
        "device_state": {"manifests": "cached before the runs, revalidated per edit (304)",
                         "manifest_bytes": manifest_bytes,
                         "rate_prior_mbps": None if prior is None else prior / 1e6},
        "policies": list(spec.policies),
        "packs": s.packs,
        "latency_s": {p: med([r.latency_s for r in rs]) for p, rs in results.items()},
        "bytes": {p: int(med([r.bytes for r in rs])) for p, rs in results.items()},
        "psnr_db": {p: psnr_value(min(r.psnr_db for r in rs)) for p, rs in results.items()},
        "ssim": {p: min(r.ssim for r in rs) for p, rs in results.items()},
        "vs_full": _vs_full(results),
        "stalls": {p: int(med([r.stalls for r in rs])) for p, rs in results.items()},
        "stall_s": {p: med([r.stall_s for r in rs]) for p, rs in results.items()},
        "startup_s": {p: med([r.startup_s for r in rs]) for p, rs in results.items()},
        "runs": {p: [r.summary() for r in rs] for p, rs in results.items()},
        "timelines": {p: rs[0].timeline for p, rs in results.items()},
    }


def _median(values: list[float]) -> float:
    return float(torch.tensor(values, dtype=torch.float64).median())


def _finite_or_inf(x: float | None) -> float | str | None:
    if x is None:
        return None
    return "inf" if x == float("inf") else x


def _vs_full(results: dict[str, list[EditResult]]) -> dict[str, Any] | None:
    """PSNR/SSIM of every system against ``full`` (the ``local`` edit: no cache reuse)."""
    if not results.get("local"):
        return None
    full = results["local"][0].image
    out: dict[str, Any] = {"psnr_db": {}, "ssim": {}}
    for p, rs in results.items():
        value = psnr(rs[0].image, full)
        out["psnr_db"][p] = "inf" if value == float("inf") else value
        out["ssim"][p] = ssim(rs[0].image, full)
    return out


def write(doc: dict[str, Any], path: Path) -> None:
    write_atomic(path, json.dumps(doc, indent=1))
