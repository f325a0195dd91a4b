"""``sakura replay``: every policy over real traces and many start points, resumable.

For each template (one setup, then its runs):

1. packs: the provider's builder (``cloud.build``) into ``<packs>/main`` (every codec,
   the second-resolution variants too) and ``<packs>/q<q>`` (sakura packs at other q);
   up-to-date templates are skipped, so a rerun builds nothing;
2. one ``sakura serve`` child process per packs folder, a paced link in front of each;
3. setup (recorded once; a resumed replay reuses it): the masked execution time ``T``
   with the whole FP16 cache resident (``edge.floor.exact_and_floor``, which also gives
   ``exact``), ``full`` (the whole model, no cache), the regime factor, storage per codec;
4. runs, strictly one at a time (concurrent timed edits on this 2-core host would distort
   each other's timings): for each network, start point and policy, the link is set to
   the start point's trace (scaled by the factor) and the real edit runs through it.

Regime ``matched``: one factor per template scales every network's traces so that the
FP16 cache at the pooled median of ``regime_network`` (Lumos5G) takes ``regime_x`` x T;
the other networks keep their rates relative to it (LTE stays ~14x slower than 5G).
Regime ``profile``: see :mod:`edge.replay.profile`.

The device state is a phone's that has used the template: manifests cached (revalidated
per edit), and a rate prior = the median rate of the 30 s before the start point.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sakura.cloud.build import BuildConfig, build
from sakura.edge.allocator import options_from_manifest
from sakura.edge.errors import EdgeError
from sakura.edge.netem import matched_rtt_ms
from sakura.edge.replay.config import ReplayConfig, ReplayConfigError
from sakura.edge.replay.networks import (
    StartPoint,
    load_start_trace,
    network_type,
    past_median_bps,
    pooled_median_bps,
    start_points,
)
from sakura.edge.replay.profile import DeviceProfile, simulate
from sakura.edge.replay.results import (
    META_FILE,
    ResultsFile,
    RunKey,
    compact_timeline,
    finite,
    template_key,
)
from sakura.edge.server_process import ServerProcess
from sakura.traces import Trace, require_trace_dir
from sakura.traces.errors import LinkError
from sakura.traces.impair import Impairment
from sakura.traces.linkproc import PacedLinkProcess, pin, split_cpus
from sakura.traces.namespaces import (
    kernel_shaping_unavailable_reason,
    scaled_rto_min_ms,
    socket_in_namespace,
)
from sakura.traces.netns import KernelShapedLink

from sakura.atomic import write_atomic
from sakura.errors import SakuraError

Log = Callable[[str], None]
MAX_FAILURES = 5  # consecutive failed runs that end a replay (something systematic)


@dataclass(frozen=True)
class PlannedRun:
    key: RunKey
    template: str      # served template id (a resolution variant carries -<res>)
    base: str          # catalog template it comes from
    variant: str       # packs folder: main | q<q>
    policy: str        # runtime policy
    start: StartPoint


def q_variant(q: float) -> str:
    return f"q{q:g}"


def deadline_policy(multiple: float) -> str:
    """The name of sakura's operating point with a deadline of ``multiple`` x T."""
    return f"sakura-d{multiple:g}"


def deadline_multiple(policy: str) -> float | None:
    """``m`` of ``sakura-d<m>`` (None for any other policy)."""
    if not policy.startswith("sakura-d"):
        return None
    try:
        return float(policy[len("sakura-d"):])
    except ValueError:
        return None


def plan(cfg: ReplayConfig, root: str | None = None) -> list[PlannedRun]:
    """Every run of the replay in execution order (template, network, start, policy)."""
    mode = cfg.regime
    nets = list(dict.fromkeys(list(cfg.networks) + list(cfg.ablation.networks)))
    # the ablations use the first start points of the network's (same seed, same order)
    starts = {n: start_points(n, max(cfg.starts_of(n), cfg.ablation.starts), cfg.seed,
                              cfg.span_s, root) for n in nets}
    out: list[PlannedRun] = []

    def add(tid: str, base: str, networks: tuple[str, ...], policies: list[tuple[str, str, str]],
            ablation: bool = False) -> None:
        for net in networks:
            k = (cfg.ablation.starts or cfg.starts_of(net)) if ablation else cfg.starts_of(net)
            for sp in starts[net][:k]:
                for name, variant, policy in policies:
                    key = RunKey(mode, tid, net, sp.trace, sp.start_s, sp.index, name)
                    out.append(PlannedRun(key, tid, base, variant, policy, sp))

    main = [(p, "main", p) for p in cfg.policies]
    qs = [(f"sakura-q{q:g}", q_variant(q), "sakura") for q in cfg.ablation.q
          if q not in (0.0, 0.5)] if "sakura" in cfg.policies else []
    points = [(deadline_policy(m), "main", "sakura") for m in cfg.deadlines
              ] if "sakura" in cfg.policies else []
    heads = tuple(n for n in cfg.networks if n in cfg.headline_networks)
    for tid in cfg.templates:
        add(tid, tid, cfg.networks, main)
        if points and heads:
            add(tid, tid, heads, points)
        if qs:
            add(tid, tid, cfg.ablation.networks, qs, ablation=True)
    for base in cfg.ablation.resolution_templates:
        for res in cfg.ablation.resolutions:
            add(f"{base}-{res}", base, cfg.ablation.networks, main, ablation=True)
    return out


# ---------------------------------------------------------------------------- packs


@dataclass(frozen=True)
class BuildJob:
    out_dir: str
    templates: tuple[str, ...]
    weights: str
    catalog: str | None = None
    resolution: int | None = None
    codecs: tuple[str, ...] | None = None
    q: float | None = None


def _run_build(job: BuildJob) -> str:
    import torch

    torch.set_num_threads(1)
    kw: dict[str, Any] = {}
    if job.codecs is not None:
        kw["codecs"] = job.codecs
    if job.q is not None:
        kw["codec_options"] = {"sakura": {"q": job.q}}
    build(BuildConfig(catalog=job.catalog, out_dir=job.out_dir, templates=job.templates,
                      weights=job.weights,
                      resolution=job.resolution, **kw), log=lambda m: None)
    return job.out_dir


def build_jobs(cfg: ReplayConfig, packs: Path, weights: Path, runs: list[PlannedRun]
               ) -> list[BuildJob]:
    need: dict[tuple[str, int | None], set[str]] = {}
    for r in runs:
        res = None if r.template == r.base else int(r.template.rsplit("-", 1)[1])
        need.setdefault((r.variant, res), set()).add(r.base)
    jobs = []
    for (variant, res), bases in sorted(need.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        tids = tuple(sorted(bases))
        if variant == "main":
            jobs.append(BuildJob(str(packs / "main"), tids, str(weights), cfg.catalog, res))
        else:
            q = float(variant[1:])
            jobs.append(BuildJob(str(packs / variant), tids, str(weights), cfg.catalog, res,
                                 codecs=("sakura",), q=q))
    return jobs


def build_all(jobs: list[BuildJob], workers: int, log: Log) -> None:
    """Build (or find up to date) every packs folder; ``workers`` > 1: in parallel
    processes (builds are not timed, so parallelism cannot distort results)."""
    log(f"packs: {len(jobs)} build job(s) (up-to-date templates are skipped) ...")
    t0 = time.monotonic()
    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(workers, len(jobs)),
                                 mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_run_build, jobs))
    else:
        for job in jobs:
            try:
                _run_build(job)
            except SakuraError:
                raise
            except Exception as exc:  # noqa: BLE001 - a build failure is the user's to see
                raise EdgeError(f"building packs into {job.out_dir} failed: {exc}") from exc
    log(f"packs ready in {time.monotonic() - t0:.1f} s")


# ---------------------------------------------------------------------------- links


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the body with this thread in network namespace ``name`` (threads it starts,
    such as the runtime's network loop, are created there too); then switch back."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise LinkError(f"cannot enter network namespace {name}: {os.strerror(err)}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(own, _CLONE_NEWNET) != 0:  # pragma: no cover - kernel refused
                raise LinkError("cannot return to the original network namespace")
    finally:
        os.close(own)


_CLONE_NEWNET = 0x40000000
KERNEL_PORT = 8000


def _healthy_in(ns: str, host: str, port: int) -> bool:
    """GET /healthz from inside namespace ``ns``."""
    import socket

    try:
        sock = socket_in_namespace(ns, socket.AF_INET, socket.SOCK_STREAM)
    except Exception:  # noqa: BLE001 - not up yet
        return False
    try:
        sock.settimeout(1.0)
        sock.connect((host, port))
        sock.sendall(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
        return b" 200 " in sock.recv(64)
    except OSError:
        return False
    finally:
        sock.close()


class Links:
    """Per packs folder: a ``sakura serve`` process on 127.0.0.1 (direct, untimed use) and
    an emulated link for the timed runs: the paced proxy in its own process in front of it,
    or (``kernel``) a second server inside the server namespace of a
    :class:`KernelShapedLink`, reached from its client namespace through a delay stage.
    Both links carry the config's round trip (``rtt_ms``) and ``loss``. With ``pin_cpus``
    on a machine with 2+ cores, the device (this process) runs on all cores but the last
    and every server and link process on the last (:func:`traces.linkproc.split_cpus`)."""

    def __init__(self, cfg: ReplayConfig, packs: Path, variants: list[str], log: Log) -> None:
        self.cfg, self.packs, self.variants, self.log = cfg, packs, variants, log
        self.kind = cfg.link
        self.impairment = Impairment(rtt_ms=cfg.rtt_ms, loss=cfg.loss, seed=cfg.seed)
        split = split_cpus() if cfg.pin_cpus else None
        self.device_cpus, self.network_cpus = split if split else (None, None)
        self._own_affinity: set[int] | None = None
        self._rtt_applied: float | None = self.impairment.rtt_ms
        self.servers: dict[str, Any] = {}
        self.links: dict[str, Any] = {}
        self.urls: dict[str, str] = {}
        self.note = ""

    def __enter__(self) -> Links:
        if self.kind == "kernel":
            reason = kernel_shaping_unavailable_reason()
            if reason is not None:
                self.note = f"kernel shaping unavailable: {reason}"
                self.log(f"WARNING: --link kernel: {self.note}; falling back to the paced link")
                self.kind = "paced"
        try:
            if self.device_cpus:
                self._own_affinity = set(os.sched_getaffinity(0))
                pin(0, self.device_cpus)
            for v in self.variants:
                self.servers[v] = ServerProcess(self.packs / v).start()
                if self.network_cpus and self.servers[v].proc is not None:
                    pin(self.servers[v].proc.pid, self.network_cpus)
                if self.kind == "kernel":
                    self._kernel(v)
                else:
                    self._paced(v)
        except BaseException:
            self.__exit__()
            raise
        return self

    def conditions(self) -> dict[str, Any]:
        """What every record states about the network path and the CPUs (``rtt_ms``: the
        network's round trip; the link's, after ``rtt_scale``, is ``link_rtt_ms``)."""
        return {"link": self.kind, "rtt_ms": self.impairment.rtt_ms,
                "rtt_scale": self.cfg.rtt_scale, "loss": self.impairment.loss,
                "cpus": {"device": sorted(self.device_cpus or []),
                         "network": sorted(self.network_cpus or [])}}

    def set_rtt(self, rtt_ms: float) -> None:
        """Every link carries this round trip from now on (new connections); a kernel link's
        minimum RTO is scaled by the same factor (``traces.namespaces.scaled_rto_min_ms``),
        unless the configuration keeps the kernel's (``rto_min: kernel``)."""
        from dataclasses import replace

        if self._rtt_applied == rtt_ms:
            return
        imp = replace(self.impairment, rtt_ms=float(rtt_ms))
        scale = rtt_ms / self.impairment.rtt_ms if self.impairment.rtt_ms > 0 else 1.0
        for link in self.links.values():
            if hasattr(link, "set_impairment"):
                link.set_impairment(imp)
            if hasattr(link, "set_rto_min_ms"):
                link.set_rto_min_ms(None if scale == 1.0 or rtt_ms <= 0
                                    or self.cfg.rto_min == "kernel"
                                    else scaled_rto_min_ms(scale))
        self._rtt_applied = rtt_ms

    def link_conditions(self, variant: str) -> dict[str, Any]:
        """How the variant's link realises loss (``loss_mechanism``) and, on the kernel link,
        its routes' ``rto_min_ms`` (None: the kernel's 200 ms)."""
        c = self.links[variant].conditions()
        return {k: c[k] for k in ("loss_mechanism", "rto_min_ms") if k in c}

    def _paced(self, v: str) -> None:
        link = PacedLinkProcess(Trace.constant(1e9, 1.0),
                                upstream=("127.0.0.1", self.servers[v].port),
                                impairment=self.impairment, cpus=self.network_cpus)
        link.start()
        self.links[v] = link
        self.urls[v] = f"http://127.0.0.1:{link.port}"

    def _kernel(self, v: str) -> None:
        import subprocess

        link = KernelShapedLink(Trace.constant(1e9, 1.0), impairment=self.impairment).start()
        self.links[v] = link
        staged = self.impairment.active
        # with a delay stage the server listens on loopback inside the namespace and the
        # relay (in front of tbf) on the namespace's address
        host, port = ("127.0.0.1", KERNEL_PORT + 1) if staged else (link.server_addr,
                                                                    KERNEL_PORT)
        proc = link.popen_in("server", [
            sys.executable, "-m", "sakura.cli", "serve", str(self.packs / v), "--host",
            host, "--port", str(port), "--log-level", "warning",
            "--no-access-log"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.network_cpus:
            pin(proc.pid, self.network_cpus)
        if staged:
            link.delay_stage(port, KERNEL_PORT, cpus=self.network_cpus)
        deadline = time.monotonic() + 60
        while not _healthy_in(link.client_ns, link.server_addr, KERNEL_PORT):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise EdgeError("sakura serve did not come up inside the server namespace")
            time.sleep(0.2)
        self.urls[v] = f"http://{link.server_addr}:{KERNEL_PORT}"

    def __exit__(self, *exc: object) -> None:
        for link in self.links.values():
            link.stop()
        for server in self.servers.values():
            server.stop()
        self.links.clear()
        self.servers.clear()
        if self._own_affinity is not None:
            pin(0, self._own_affinity)
            self._own_affinity = None

    def direct(self, variant: str) -> str:
        return self.servers[variant].url

    def shaped(self, variant: str, trace: Any, start_s: float) -> str:
        """Point the variant's link at ``trace`` from ``start_s`` now; its URL."""
        link = self.links[variant]
        link.set_trace(trace, start_s)
        link.restart(start_s)
        return self.urls[variant]

    def client(self, variant: str) -> contextlib.AbstractContextManager[None]:
        """Where the device's sockets must be created for the shaped URL."""
        if self.kind == "kernel":
            return in_netns(self.links[variant].client_ns)
        return contextlib.nullcontext()


# ---------------------------------------------------------------------------- setup


@dataclass
class TemplateState:
    """What one template's runs share (images live only in memory)."""

    tid: str
    record: dict[str, Any]
    template: Any
    req: Any
    exact: Any
    full: Any
    runtimes: dict[str, Any]
    packs: dict[str, str]


def allocation_quality_of(manifest: dict[str, Any]) -> str:
    """``psnr_profile`` when every configuration of the pack carries a measured output
    PSNR (the allocator ranks by it), else ``kv_error`` (the KV-error proxy)."""
    configs = [c for s in manifest.get("shards", []) for c in s.get("configs", [])]
    ok = configs and all((c.get("quality") or {}).get("psnr_db") is not None for c in configs)
    return "psnr_profile" if ok else "kv_error"


def _storage(packs: Path, variant: str, tid: str) -> dict[str, int]:
    doc = json.loads((packs / variant / "catalog.json").read_text())
    entry = doc["templates"][tid]
    return {c: int(e.get("stored_bytes") or e["pack_bytes"]) for c, e in entry["codecs"].items()}


def _resident_edit(runtime: Any, tid: str, template: Any, provider: Any, req: Any) -> Any:
    """An edit whose cache is fully in memory (``provider``), untimed."""
    if hasattr(runtime, "prepared"):
        return runtime.engine.edit(runtime.prepared(tid, template), provider, req)
    from sakura.dit.editing import Geometry, cached_edit  # lazy: torch

    return cached_edit(runtime.model, template, Geometry.of(runtime.model, template),
                       provider, req)


def setup_template(cfg: ReplayConfig, tid: str, base: str, variants: list[str],
                   links: Links, model: Any, weights_sha: str, catalog: dict[str, Any],
                   results: ResultsFile, packs: Path, regime_median_bps: float, log: Log
                   ) -> TemplateState:
    from sakura.edge.floor import exact_and_floor, regime_factor  # lazy: torch
    from sakura.edge.policy_packs import (  # lazy: torch
        catalog_codecs,
        policy_packs,
        prefetch_manifests,
    )
    from sakura.edge.runtime import EdgeRuntime  # lazy: torch

    runtimes = {}
    main = EdgeRuntime(model, weights_sha256=weights_sha, runtime=cfg.runtime)
    for v in variants:
        rt = main if v == "main" else EdgeRuntime(model, encoder=main.encoder,
                                                  weights_sha256=weights_sha,
                                                  runtime=cfg.runtime)
        rt.profiles = main.profiles  # one calibration per template (same model)
        runtimes[v] = rt
    direct = links.direct("main")
    template = main.fetch_template(direct, tid)
    spec = catalog[base]
    prompt = spec.evaluation_prompts[cfg.prompt]
    req = main.request(prompt, seed=cfg.edit_seed)
    packs_of = policy_packs(asyncio.run(catalog_codecs(direct, tid)), cfg.policies, tid)
    # device state: manifests cached, calibrated (a direct, untimed edit calibrates too)
    for v, rt in runtimes.items():
        codecs = sorted({c for c in packs_of.values() if c}) if v == "main" else ["sakura"]
        asyncio.run(prefetch_manifests(links.direct(v), tid, codecs, rt))
    calib = main.edit(direct, tid, template, req, "sakura")
    exact, floor_s, fp16_manifest = exact_and_floor(main, direct, tid, template, req,
                                                    repeats=3)
    full_res = main.edit(direct, tid, template, req, "local")
    key = template_key(cfg.regime, tid)
    stored = results.templates().get(key)
    if stored is None:
        fp16_bytes = int(fp16_manifest["fp16_bytes"])
        storage = _storage(packs, "main", tid)
        for v in variants:
            if v != "main":
                storage[f"sakura-{v}"] = _storage(packs, v, tid)["sakura"]
        entry = json.loads((packs / "main" / "catalog.json").read_text())["templates"][tid]
        factor = (regime_factor(fp16_bytes, floor_s, regime_median_bps, cfg.regime_x)
                  if cfg.regime == "matched" else 1.0)
        stored = {
            "kind": "template", "key": key, "mode": cfg.regime, "template": tid,
            "base_template": base, "workload": spec.workload,
            "resolution": int(entry.get("resolution", spec.resolution)),
            "token_mask_ratio": float(entry.get("token_mask_ratio", 0.0)),
            "mask_ratio": entry.get("mask_ratio"), "prompt": prompt, "seed": cfg.edit_seed,
            "steps": template.steps, "masked_exec_s": floor_s, "local_s": full_res.latency_s,
            "fp16_bytes": fp16_bytes, "factor": factor, "regime_x": cfg.regime_x,
            "regime_network": cfg.regime_network,
            "regime_median_mbps": regime_median_bps / 1e6,
            "scaled_median_mbps": regime_median_bps * factor / 1e6,
            "storage_bytes": storage, "shard_exec_s": list(calib.predicted_exec_s),
            "rtt_ms": cfg.rtt_ms, "rtt_scale": cfg.rtt_scale,
            "packs": packs_of, "allocation_quality": {
                c: allocation_quality_of(main.manifests[(tid, c)].data)
                for c in sorted({c for c in packs_of.values() if c})
                if (tid, c) in main.manifests},
            "load1": os.getloadavg()[0], "time": time.time(),
        }
        stored["link_rtt_ms"] = link_rtt_ms(cfg, stored)
        results.append(stored)
        if cfg.regime == "matched":
            log(f"{tid}: T = {floor_s:.3f} s masked, local {full_res.latency_s:.3f} s, FP16 "
                f"{fp16_bytes / 1e6:.2f} MB; {cfg.regime_network} pooled median "
                f"{regime_median_bps / 1e6:.1f} Mbit/s x {factor:.4g} (FP16 at the median = "
                f"{cfg.regime_x:g} x T); link RTT {stored['link_rtt_ms']:.1f} ms "
                f"({cfg.rtt_ms:g} ms, rtt_scale {cfg.rtt_scale})")
    return TemplateState(tid, stored, template, req, exact, full_res.image, runtimes, packs_of)


# ---------------------------------------------------------------------------- runs


def _quality(image: Any, st: TemplateState) -> dict[str, Any]:
    from sakura.edge.quality import psnr, ssim  # lazy: torch

    return {"psnr_exact": finite(psnr(image, st.exact)), "ssim_exact": ssim(image, st.exact),
            "psnr_full": finite(psnr(image, st.full)), "ssim_full": ssim(image, st.full)}


def _base_record(r: PlannedRun, st: TemplateState, cfg: ReplayConfig, links: Links
                 ) -> dict[str, Any]:
    t = st.record
    q = {"sakura": 0.5, "svd": 0.0}.get(r.policy) if r.variant == "main" else float(r.variant[1:])
    return {
        "kind": "run", "key": str(r.key), "mode": cfg.regime, "template": r.template,
        "base_template": r.base, "workload": t["workload"], "resolution": t["resolution"],
        "token_mask_ratio": t["token_mask_ratio"], "network": r.key.network,
        "network_type": network_type(r.key.network), "trace": r.start.trace,
        "start_index": r.start.index, "start_s": r.start.start_s, "policy": r.key.policy,
        "runtime_policy": r.policy, "variant": r.variant, "q": q,
        "pack": None if r.policy == "local" else (
            "sakura" if r.variant != "main" else st.packs[r.policy]),
        "factor": t["factor"], "startup_fraction": cfg.startup_fraction,
        "deadline_s": _deadline(r, t, cfg), **links.conditions(),
        "link_rtt_ms": link_rtt_ms(cfg, t),
    }


def link_rtt_ms(cfg: ReplayConfig, t: dict[str, Any]) -> float:
    """The round trip the link carries for template record ``t``: ``rtt_ms``, or with
    ``rtt_scale: matched`` in the matched regime ``rtt_ms x T / T_phone``
    (``edge.netem.matched_rtt_ms``)."""
    if cfg.regime != "matched" or cfg.rtt_scale == "none" or not t.get("masked_exec_s"):
        return float(cfg.rtt_ms)

    return matched_rtt_ms(cfg.rtt_ms, float(t["masked_exec_s"]),
                          float(t["token_mask_ratio"]), cfg.profile)


def _deadline(r: PlannedRun, t: dict[str, Any], cfg: ReplayConfig) -> float | None:
    """``sakura-d<m>``: m x the template's masked execution time (matched: measured T;
    profile: the modelled masked execution)."""
    m = deadline_multiple(r.key.policy)
    if m is None:
        return None
    if cfg.regime == "profile":
        prof = DeviceProfile(**{k: v for k, v in vars(cfg.profile).items()})
        return m * prof.masked_total_s(float(t["token_mask_ratio"]))
    return m * float(t["masked_exec_s"])


def run_matched(r: PlannedRun, st: TemplateState, cfg: ReplayConfig, links: Links,
                root: str | None) -> dict[str, Any]:
    from sakura.edge.runtime import EditOptions  # lazy: torch

    rec = _base_record(r, st, cfg, links)
    rt = st.runtimes[r.variant]
    if r.policy == "local":
        res = rt.edit(links.direct("main"), r.template, st.template, st.req, "local")
        prior = None
    else:
        trace = load_start_trace(r.start, root).scaled(float(st.record["factor"]))
        prior = past_median_bps(trace, r.start.start_s)
        # the native pipeline's receive and reconstruct threads beside the server and link
        # (the phone's modem and GPU), execution alone on the device CPUs
        io_cpus = (tuple(sorted(links.network_cpus))
                   if links.network_cpus and cfg.runtime == "native" else None)
        options = EditOptions(budget_rate_bps=prior, initial_rate_bps=prior,
                              pack=rec["pack"], startup_fraction=cfg.startup_fraction,
                              deadline_s=rec["deadline_s"], pipeline_cpus=io_cpus)
        links.set_rtt(rec["link_rtt_ms"])
        rec.update(links.link_conditions(r.variant))
        with links.client(r.variant):
            url = links.shaped(r.variant, trace, r.start.start_s)
            res = rt.edit(url, r.template, st.template, st.req, r.policy, options=options)
    rec.update({
        "latency_s": res.latency_s, "bytes": res.bytes, "manifest_bytes": res.manifest_bytes,
        "stalls": res.stalls, "stall_s": res.stall_s, "startup_s": res.startup_s,
        "exec_s": res.exec_s, "requests": res.requests, "configs": res.configs,
        "truncations": res.truncations, "hedges": res.hedges,
        "local_fallbacks": res.local_fallbacks,
        "outage_fallbacks": res.outage_fallbacks, "stale_steps": res.stale_steps,
        "refinements": res.refinements,
        # the set-up before the shard loop (open, manifest, plan: edge/timeline.py), so a
        # late start can be told apart from a slow stream
        "phases": res.phases,
        # what the device told the user it got (edge/quality.py), beside the measured PSNR
        "psnr_estimate_db": res.psnr_estimate_db,
        "full_quality_byte_fraction": res.full_quality_byte_fraction,
        "prior_mbps": None if prior is None else prior / 1e6,
        "warnings": res.warnings, **_quality(res.image, st),
        "load1": os.getloadavg()[0], "time": time.time(),
    })
    if cfg.timelines == "all" or r.start.index == 0:
        rec["timeline"] = compact_timeline(res.timeline)
    return rec


def run_profile(r: PlannedRun, st: TemplateState, cfg: ReplayConfig, links: Links,
                root: str | None) -> dict[str, Any]:
    prof = DeviceProfile(**{k: v for k, v in vars(cfg.profile).items()})
    rec = _base_record(r, st, cfg, links)
    rec["profile"] = prof.name
    # the link is modelled: one request latency before the first body, no loss
    rec.update(link="modelled", rtt_ms=prof.request_latency_s * 1000.0,
               link_rtt_ms=prof.request_latency_s * 1000.0, rtt_scale="none", loss=0.0)
    if r.policy == "local":
        rec.update({"latency_s": prof.local_s, "bytes": 0, "real_bytes": 0, "stalls": 0,
                    "stall_s": 0.0, "startup_s": 0.0, "exec_s": prof.local_s,
                    "configs": [], **_quality(st.full, st), "time": time.time()})
        return rec
    rt = st.runtimes[r.variant]
    pack = rec["pack"]
    manifest = rt.manifests[(r.template, pack)].data
    tables = options_from_manifest(manifest)  # what the runtime's allocator sees
    trace = load_start_trace(r.start, root)
    prior = past_median_bps(trace, r.start.start_s)
    exec_s = prof.shard_exec_s(st.record["shard_exec_s"], st.record["token_mask_ratio"])
    k = prof.byte_scale(int(st.record["fp16_bytes"]))
    sim = simulate(r.policy, tables, exec_s, trace, r.start.start_s, prior, prof, k,
                   startup_fraction=cfg.startup_fraction, deadline_s=rec["deadline_s"])
    image = _configured_edit(rt, links.direct(r.variant), r.template, pack, manifest,
                             sim.configs, st)
    rec.update({
        "latency_s": sim.latency_s, "bytes": sim.bytes, "real_bytes": sim.real_bytes,
        "stalls": sim.stalls, "stall_s": sim.stall_s, "startup_s": sim.startup_s,
        "exec_s": sim.exec_s, "configs": sim.configs, "prior_mbps": prior / 1e6,
        "byte_scale": k, **_quality(image, st), "time": time.time(),
    })
    if cfg.timelines == "all" or r.start.index == 0:
        rec["timeline"] = compact_timeline(sim.timeline)
    return rec


def _configured_edit(rt: Any, server: str, tid: str, pack: str, manifest_d: dict[str, Any],
                     configs: list[int], st: TemplateState) -> Any:
    """The real edit with exactly these configurations (fetched, decoded, resident)."""
    from sakura.codec.pack import Manifest, decode_config  # lazy: torch
    from sakura.edge.client import PackClient  # lazy: aiohttp
    from sakura.edge.floor import ResidentCache  # lazy: torch

    async def fetch() -> list[bytes]:
        async with PackClient(server) as client:
            return [(await client.fetch_config(tid, pack, j, c, manifest=manifest_d)).data
                    for j, c in enumerate(configs)]

    bodies = asyncio.run(fetch())
    manifest = Manifest.from_dict(manifest_d)
    codec = manifest.make_codec()
    shards = [decode_config(manifest, j, c, b, codec)
              for j, (c, b) in enumerate(zip(configs, bodies))]
    return _resident_edit(rt, tid, st.template, ResidentCache(manifest, shards), st.req)


# ---------------------------------------------------------------------------- replay


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc="replay", unit="run", disable=not enabled, file=sys.stderr,
               dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def _check_meta(out: Path, cfg: ReplayConfig, weights_sha: str) -> None:
    meta_path = out / META_FILE
    meta = {"config": cfg.to_dict(), "weights_sha256": weights_sha,
            "host": {"cpus": os.cpu_count(), "load1_at_start": os.getloadavg()[0]},
            "timed_runs": "sequential, one at a time", "started": time.time()}
    if meta_path.exists():
        try:
            old = json.loads(meta_path.read_text())
        except ValueError:
            old = {}
        if old.get("weights_sha256") not in (None, weights_sha):
            raise ReplayConfigError(
                f"{out} holds results made with other model weights "
                f"({str(old.get('weights_sha256'))[:12]}); use another --out")
        old_cfg = old.get("config", {})
        # results from before the startup allowance existed were made without one
        # ... and on the Python runtime, before the native one existed
        old_cfg = {"startup_fraction": 0.0, "runtime": "python", **old_cfg} if old_cfg else old_cfg
        for k in ("regime_x", "regime_network", "edit_seed", "prompt", "seed", "span_s",
                  "startup_fraction", "runtime", "rtt_ms", "rtt_scale", "rto_min", "loss"):
            if k in old_cfg and old_cfg[k] != meta["config"][k]:
                raise ReplayConfigError(
                    f"{out} holds results made with {k} = {old_cfg[k]!r}, this config has "
                    f"{meta['config'][k]!r}: resuming would mix them; use another --out")
        meta["resumed"] = old.get("resumed", 0) + 1
        meta["started_first"] = old.get("started_first", old.get("started"))
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(meta_path, json.dumps(meta, indent=1))


def run_replay(cfg: ReplayConfig, out: str | Path, log: Log = print,
               progress: bool = True, model: Any = None) -> dict[str, Any]:
    """Run (or resume) the replay into ``out``; returns a summary."""
    from sakura.dit.templates import load_catalog  # lazy: torch
    from sakura.dit.weights import DEFAULT_WEIGHTS, load_model  # lazy: torch
    from sakura.edge.bench import file_sha256  # lazy: torch

    out = Path(out)
    root = cfg.trace_dir or str(require_trace_dir())
    if not Path(root).is_dir():
        raise ReplayConfigError(f"trace_dir {root} is not a folder")
    catalog = load_catalog(cfg.catalog)
    cfg.validate(catalog)
    weights = Path(cfg.weights) if cfg.weights else DEFAULT_WEIGHTS
    if not weights.exists():
        raise ReplayConfigError(f"model weights {weights} do not exist")
    weights_sha = file_sha256(weights)
    runs = plan(cfg, root)  # bad or missing traces fail here, before anything is written
    _check_meta(out, cfg, weights_sha)
    results = ResultsFile(out)
    done = results.done()
    todo = [r for r in runs if str(r.key) not in done]
    log(f"replay: {len(runs)} runs planned, {len(runs) - len(todo)} already done, "
        f"{len(todo)} to run ({cfg.regime} regime, {cfg.link} link, timed runs sequential)")
    summary: dict[str, Any] = {"planned": len(runs), "skipped": len(runs) - len(todo),
                               "ran": 0}
    failed: list[str] = []
    in_a_row = 0
    if not todo:
        return summary
    packs = Path(cfg.packs_dir) if cfg.packs_dir else out / "packs"
    build_all(build_jobs(cfg, packs, weights, runs), cfg.build_workers, log)
    variants = sorted({r.variant for r in runs}, key=lambda v: (v != "main", v))
    median = pooled_median_bps(cfg.regime_network, root)
    if model is None:
        model = load_model(weights)
    runner = run_matched if cfg.regime == "matched" else run_profile
    with Links(cfg, packs, variants, log) as links, _progress(len(todo), progress) as bar:
        state: TemplateState | None = None
        for r in todo:
            if state is None or state.tid != r.template:
                state = None  # free the previous template's images first
                needed = sorted({x.variant for x in runs if x.template == r.template},
                                key=lambda v: (v != "main", v))
                state = setup_template(cfg, r.template, r.base, needed, links, model,
                                       weights_sha, catalog, results, packs, median, log)
            try:
                rec = runner(r, state, cfg, links, root)
            except SakuraError as exc:
                # one bad run (e.g. a transfer that exhausted its retries) must not end a
                # long unattended replay; it is not recorded, so a rerun retries it
                failed.append(str(r.key))
                in_a_row += 1
                log(f"run {r.key} failed: {exc} (not recorded; rerun to retry)")
                if in_a_row >= MAX_FAILURES:
                    raise EdgeError(f"{in_a_row} runs failed in a row, the last: {exc}") from exc
                bar.update(1)
                continue
            in_a_row = 0
            results.append(rec)
            summary["ran"] += 1
            bar.set_postfix_str(f"{r.template} {r.key.network} {r.key.policy} "
                                f"{rec['latency_s']:.2f}s", refresh=False)
            bar.update(1)
    if failed:
        summary["failed"] = failed
    return summary

