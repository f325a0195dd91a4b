"""One replay run and its record: ``matched`` runs the real edit through the link set to
the start point's trace (scaled by the template's factor), ``profile`` models the device
(:mod:`edge.replay.profile`) and runs the real edit with the configurations the model
chose; either records latency, bytes, stalls and quality against ``exact`` and ``full``.

The device state is a phone's that has used the template: manifests cached (revalidated
per edit), and a rate prior = the median rate of the 30 s before the start point.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from sakura.edge.allocator import options_from_manifest
from sakura.edge.replay.config import ReplayConfig
from sakura.edge.replay.links import Links, link_rtt_ms
from sakura.edge.replay.networks import load_start_trace, network_type, past_median_bps
from sakura.edge.replay.plan import PlannedRun, deadline_multiple
from sakura.edge.replay.profile import DeviceProfile, simulate
from sakura.edge.replay.results import compact_timeline, finite
from sakura.edge.replay.template_setup import TemplateState


def _quality(image: Any, st: TemplateState) -> dict[str, Any]:
    from sakura.edge.quality import psnr, ssim  # lazy: torch

    return {"psnr_exact": finite(psnr(image, st.exact)), "ssim_exact": ssim(image, st.exact),
            "psnr_full": finite(psnr(image, st.full)), "ssim_full": ssim(image, st.full)}


def _base_record(r: PlannedRun, st: TemplateState, cfg: ReplayConfig, links: Links
                 ) -> dict[str, Any]:
    t = st.record
    # main's sakura chooses q per shard (None; records before 2026-12-07 say 0.5, which it
    # was until 2026-12-06); a q<q> pack is pinned at q
    q = {"svd": 0.0}.get(r.policy) if r.variant == "main" else float(r.variant[1:])
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
        with links.watched(r.variant), links.client(r.variant):
            url = links.shaped(r.variant, trace, r.start.start_s)
            res = rt.edit(url, r.template, st.template, st.req, r.policy, options=options)
    rec.update({
        "latency_s": res.latency_s, "bytes": res.bytes, "manifest_bytes": res.manifest_bytes,
        "stalls": res.stalls, "stall_s": res.stall_s, "startup_s": res.startup_s,
        "exec_s": res.exec_s, "requests": res.requests, "configs": res.configs,
        "truncations": res.truncations, "hedges": res.hedges,
        "local_fallbacks": res.local_fallbacks,
        "outage_fallbacks": res.outage_fallbacks, "stale_steps": res.stale_steps,
        "planned_stale": res.planned_stale, "planned_local": res.planned_local,
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
    from sakura.codec.pack import Manifest  # lazy: torch

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
    layout = Manifest.from_dict(manifest).layout()
    sim = simulate(r.policy, tables, exec_s, trace, r.start.start_s, prior, prof, k,
                   startup_fraction=cfg.startup_fraction, deadline_s=rec["deadline_s"],
                   shard_blocks=[layout.blocks_of(i) for i in range(layout.num_shards)],
                   recompute=_recomputes(rt, r.template, st.template))
    image = _configured_edit(rt, links.direct(r.variant), r.template, pack, manifest,
                             sim.configs, st)
    rec.update({
        "latency_s": sim.latency_s, "bytes": sim.bytes, "real_bytes": sim.real_bytes,
        "stalls": sim.stalls, "stall_s": sim.stall_s, "startup_s": sim.startup_s,
        "exec_s": sim.exec_s, "configs": sim.configs, "prior_mbps": prior / 1e6,
        "planned_stale": sim.planned_stale, "planned_local": sim.planned_local,
        "byte_scale": k, **_quality(image, st), "time": time.time(),
    })
    if cfg.timelines == "all" or r.start.index == 0:
        rec["timeline"] = compact_timeline(sim.timeline)
    return rec


def _configured_edit(rt: Any, server: str, tid: str, pack: str, manifest_d: dict[str, Any],
                     configs: list[int | None], st: TemplateState) -> Any:
    """The real edit with exactly these configurations (fetched, decoded, resident; None:
    not fetched)."""
    from sakura.codec.pack import Manifest, decode_config  # lazy: torch
    from sakura.edge.client import PackClient  # lazy: aiohttp
    from sakura.edge.floor import ResidentCache, native_resident  # lazy: torch

    async def fetch() -> list[bytes | None]:
        async with PackClient(server) as client:
            return [None if c is None else
                    (await client.fetch_config(tid, pack, j, c, manifest=manifest_d)).data
                    for j, c in enumerate(configs)]

    bodies = asyncio.run(fetch())
    manifest = Manifest.from_dict(manifest_d)
    codec = manifest.make_codec()
    # a shard the stale plan did not fetch (None) runs stale or its step locally, as streamed
    shards = [None if c is None else decode_config(manifest, j, c, b, codec)
              for j, (c, b) in enumerate(zip(configs, bodies))]
    if getattr(rt, "runtime", None) == "native" and all(s is not None for s in shards):
        # on the graphs that made ``exact`` (FP16's image equals it to the bit)
        geometry = rt.prepared(tid, st.template).geometry
        bps, cache = native_resident(rt, st.template, geometry, st.req, manifest_d, shards)
        return rt.native.resident_edit(st.template, geometry, st.req, bps, cache)[0]
    return _resident_edit(rt, tid, st.template, ResidentCache(manifest, shards), st.req)


def _recomputes(runtime: Any, tid: str, template: Any) -> bool:
    """Whether a step the stale plan leaves local is a recompute step on this runtime (the
    streamed runtime's ``plan_local`` condition, ``edge.runner``)."""
    if hasattr(runtime, "prepared"):
        return bool(runtime.engine.recomputes_late_steps(runtime.prepared(tid, template)))
    from sakura.dit.editing import RecomputedKV  # lazy: torch

    return RecomputedKV.possible(template)


def _resident_edit(runtime: Any, tid: str, template: Any, provider: Any, req: Any) -> Any:
    """An edit whose cache is fully in memory (``provider``), untimed."""
    if hasattr(runtime, "prepared"):
        return runtime.engine.edit(runtime.prepared(tid, template), provider, req)
    from sakura.dit.editing import Geometry, cached_edit  # lazy: torch

    return cached_edit(runtime.model, template, Geometry.of(runtime.model, template),
                       provider, req)
