"""``sakura bench tail --json PATH``: the tail under real TCP, real loss and repeated use.

What it runs (issue 28, "What it must show"):

* **the kernel-shaped replay at each loss rate** of :data:`LOSSES`: ``sakura replay`` with
  ``configs/tail.yaml`` (one template per workload; the Lumos5G network at 12 start points
  and the mixed network's two starts where ``docs/replay-kernel`` saw sakura take more than
  twice its median), ``link: kernel`` and ``loss`` dropped for real by nftables in the
  link's namespaces (``traces/nft_loss.py``), the minimum RTO scaled like the round trip. Every
  policy of the config streams through the same receive stage; ``local`` runs once per
  (template, start), at loss 0, since it does not touch the network. Each loss rate is its
  own resumable results folder (``OUT/loss-<p>/runs.jsonl``), the packs are shared;
* **repeated edits** (:func:`repeat_edits`): pairs of ``EdgeRuntime`` edits 30 s apart with
  the device state kept and no rate prior, on three windows of one Lumos5G trace, beside the
  same edits given the trace's rate as the prior (the replay runs pass that prior).

Aggregates (:func:`summarize`), loss rates as string keys ``"0"``, ``"0.01"``, ``"0.03"``:
latency ratios are per template (the p90 over its starts, linear-interpolated), then the
median over templates, as the replay report does; PSNR is against ``exact``, pooled over
every run of a policy at that loss; ``max_stall_s`` is the largest total stall of one edit;
``max_latency_over_local`` the largest ratio of sakura's latency to ``local``'s at the same
(template, start). ``local_fallbacks`` counts steps computed on the device, ``stale_steps``
late steps run on their blocks' last K/V (``dit.stale``), ``planned_stale`` the shards
the stale plan never requested (``edge.stale_plan``), ``planned_local`` those it had
recomputed on the device instead,
``refinements`` the received configurations extended by one more range before their shard
ran (prefix refinement). ``psnr_p10_gain_db_vs_fixed_bits_cached`` is the p10 gain over the
starts where neither policy computed a step locally (:func:`_p10_gain_cached`).
``p90_bound_vs_cachegen`` is the most any streaming policy could
reach on the same runs (:func:`p90_bound_vs_cachegen`): with trace outages among the starts,
it sits below the 1.82 the issue asks for. ``p90_starved_estimate_vs_cachegen`` is the
tighter estimate at the starts where the link starved both systems
(:func:`p90_starved_estimate_vs_cachegen`).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sakura.edge.netem import matched_rtt_ms, shaped
from sakura.edge.replay.config import CONFIG_DIR, load_config
from sakura.edge.replay.results import ResultsFile
from sakura.edge.replay.runner import run_replay
from sakura.edge.replay.stats import pct
from sakura.edge.server_process import ServerProcess
from sakura.traces import load_trace, trace_set

from sakura.digest import file_sha256
from sakura.errors import SakuraError

TAIL_CONFIG = CONFIG_DIR / "tail.yaml"
LOSSES = (0.0, 0.01, 0.03)
BASELINES = ("cachegen", "intq")
QUICK_STARTS = 3
REPEAT_TEMPLATE = "face-technologist"
REPEAT_TRACE = "5g_trace_100_walking.txt"
REPEAT_WINDOWS = (20.0, 110.0, 200.0)
REPEAT_GAP_S = 30.0
#: events the runtime counts per edit (``EditResult``)
COUNTED_EVENTS = ("truncations", "hedges", "refinements", "local_fallbacks",
                  "outage_fallbacks", "stale_steps", "planned_stale", "planned_local")
EVENTS = ("truncations", "hedges", "refinements", "local_fallbacks", "outage_fallbacks",
          "stale_steps", "planned_stale", "planned_local")
#: a start where CacheGen computed at least this share of its steps locally is an outage
#: start for :func:`p90_bound_vs_cachegen` (docs/replay-kernel: of CacheGen's 42 runs, 28
#: computed 0-6 of their 20 steps locally, 5 computed 11-14, and 10 computed 15-20)
OUTAGE_STEP_SHARE = 0.75
#: a start where neither sakura nor CacheGen received this share of the FP16 cache is
#: *starved* (:func:`p90_starved_estimate_vs_cachegen`; the tail bench of 2026-12-06: such
#: starts got 0-47 KB of a 19-28 MB cache, every other start megabytes)
STARVED_FP16_SHARE = 0.01

Log = Callable[[str], None]


class TailBenchError(SakuraError):
    """The tail bench cannot run here (e.g. no root for the kernel link)."""


def loss_key(loss: float) -> str:
    return f"{loss:g}"


def tail_configs(quick: bool = False, starts: int | None = None,
                 packs_dir: str | None = None, rto_min: str = "scaled") -> dict[str, Any]:
    """The replay configuration of each loss rate (string key); ``rto_min``: ``scaled``
    (the targets are read so) or ``kernel`` (the kernel's 200 ms, for the comparison)."""
    out = {}
    for loss in LOSSES:
        n = starts if starts is not None else (QUICK_STARTS if quick else None)
        cfg = load_config(TAIL_CONFIG, loss=loss, starts=n, packs_dir=packs_dir)
        cfg = cfg.replace(rto_min=rto_min)
        if quick:
            cfg = cfg.replace(quick=True, network_starts={"mixed": 1})
        if loss > 0:
            cfg = cfg.replace(policies=tuple(p for p in cfg.policies if p != "local"))
        out[loss_key(loss)] = cfg.validate()
    return out


def read_runs(folder: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """One loss folder's runs (the latest record of each key) and template records by
    template id."""
    results = ResultsFile(folder)
    return results.runs(), {r["template"]: r for r in results.templates().values()}


def _start(rec: dict[str, Any]) -> tuple:
    return (rec["template"], rec["network"], rec["trace"], rec["start_s"])


def p90_bound_vs_cachegen(runs: list[dict[str, Any]], local: dict[tuple, float],
                          templates: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The largest ``p90_ratio_vs_cachegen`` any streaming policy could reach on these runs.

    A policy's latency at a start is at least the template's masked execution time (every
    byte there at once), and at an *outage start* at least ``local``'s: there no byte arrives
    while the edit runs, so each step is computed with every token, as ``local`` does. An
    outage start is one where CacheGen computed at least :data:`OUTAGE_STEP_SHARE` of its
    steps locally (its requests were out and its chunks did not come). Taking those lower
    bounds as the latencies and CacheGen's as measured, the ratio of the p90s (per template,
    then the median) bounds what the target asks for from above: with two of the ten
    Lumos5G starts of ``docs/replay-kernel`` in outages, CacheGen's p90 is an outage start,
    about local plus its fallback waits, and no policy can beat local there."""
    lat: dict[str, dict[tuple, float]] = defaultdict(dict)
    outage: set[tuple] = set()
    for r in runs:
        if r["policy"] != "cachegen":
            continue
        t = templates.get(r["template"], {})
        lat[r["template"]][_start(r)] = float(r["latency_s"])
        steps = int(t.get("steps") or 0)
        if steps and int(r.get("local_fallbacks") or 0) >= OUTAGE_STEP_SHARE * steps:
            outage.add(_start(r))
    ratios, shares = [], []
    for tpl, cg in lat.items():
        floor = templates.get(tpl, {}).get("masked_exec_s")
        if floor is None or not cg:
            continue
        best = [local.get(k, float(floor)) if k in outage else float(floor) for k in cg]
        ratios.append(pct(list(cg.values()), 90) / pct(best, 90))
        shares.append(sum(k in outage for k in cg) / len(cg))
    return {"ratio": round(statistics.median(ratios), 4) if ratios else None,
            "outage_start_share": round(statistics.median(shares), 4) if shares else None}


def p90_starved_estimate_vs_cachegen(runs: list[dict[str, Any]],
                                      templates: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``p90_ratio_vs_cachegen`` at the no-byte schedule where the link starved both systems:
    an estimate of what the stale rule leaves reachable, not a bound.

    A *starved start* is one where neither sakura nor CacheGen received
    :data:`STARVED_FP16_SHARE` of the template's FP16 cache (on the tail bench such starts
    got 0-47 KB of 19-28 MB: the trace was in an outage or at ~1 Mbit/s for the whole edit;
    every other start got megabytes). With no bytes, a step either runs on K/V at most
    ``STALE_MAX_AGE`` steps old or is computed on the device, so the fastest edit computes
    every (``STALE_MAX_AGE`` + 1)-th step locally (``local_s / steps`` each) and runs the
    rest masked (``masked_exec_s / steps``). Taking that at starved starts and the masked
    execution elsewhere, the ratio of the p90s (per template, then the median) estimates the
    most the p90 target can give under the stale rule. It is not a strict bound: a few KB
    can buy a smallest configuration for a step that would otherwise be computed locally
    (sakura sometimes beats it), and a policy that allowed older K/V could go faster at a
    cost in quality."""
    from sakura.dit.stale import STALE_MAX_AGE  # lazy: torch, for this estimate only

    by: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in runs:
        if r["policy"] in ("sakura", "cachegen"):
            by[_start(r)][r["policy"]] = r
    ratios, shares = [], []
    for tpl, t in templates.items():
        steps, masked, local = (t.get(k) for k in ("steps", "masked_exec_s", "local_s"))
        fp16 = (t.get("storage_bytes") or {}).get("fp16") or t.get("fp16_bytes")
        pairs = [p for k, p in by.items() if k[0] == tpl and len(p) == 2]
        if not (steps and masked and local and fp16 and pairs):
            continue
        n_local = math.ceil(int(steps) / (STALE_MAX_AGE + 1))
        no_bytes = (n_local * float(local) + (int(steps) - n_local) * float(masked)) / int(steps)
        starved = [max(int(p["sakura"].get("bytes") or 0), int(p["cachegen"].get("bytes") or 0))
                   < STARVED_FP16_SHARE * float(fp16) for p in pairs]
        cg = [float(p["cachegen"]["latency_s"]) for p in pairs]
        best = [no_bytes if s else float(masked) for s in starved]
        ratios.append(pct(cg, 90) / pct(best, 90))
        shares.append(sum(starved) / len(starved))
    return {"ratio": round(statistics.median(ratios), 4) if ratios else None,
            "starved_start_share": round(statistics.median(shares), 4) if shares else None}


def _p10_gain_cached(runs: list[dict[str, Any]]) -> float | None:
    """sakura's p10 PSNR minus sakura-fixed-bits', over the starts where neither computed a
    step locally: the allocation's effect where every step ran on streamed K/V (the
    paper's setting). A local step follows the full-token trajectory, not the cached one
    (``local`` itself is 26.5 / 31.8 / 39.7 dB from ``exact`` for try-on / face swap /
    instruction), so at outage starts both policies land near local's PSNR, and those starts
    set the pooled p10 whatever the allocation does."""
    by: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in runs:
        if r["policy"] in ("sakura", "sakura-fixed-bits") and r.get("psnr_exact") is not None:
            by[_start(r)][r["policy"]] = r
    pairs = [(float(p["sakura"]["psnr_exact"]), float(p["sakura-fixed-bits"]["psnr_exact"]))
             for p in by.values() if len(p) == 2
             and not any(int(x.get("local_fallbacks") or 0) for x in p.values())]
    if not pairs:
        return None
    return round(pct([a for a, _ in pairs], 10) - pct([b for _, b in pairs], 10), 3)


def summarize(by_loss: dict[str, list[dict[str, Any]]],
              templates: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The bench's keys from the replay records of each loss rate (``local`` may appear at
    any of them; it is read wherever it is); ``templates`` (the replay's template records)
    adds ``p90_bound_vs_cachegen``."""
    local = {_start(r): r["latency_s"] for runs in by_loss.values() for r in runs
             if r["policy"] == "local"}
    policies = sorted({r["policy"] for runs in by_loss.values() for r in runs})
    doc: dict[str, Any] = {f"p90_ratio_vs_{b}": {} for b in BASELINES}
    doc.update({"p90_s": {}, "psnr_mean_db": {}, "max_stall_s": {}, "psnr_p10_db": {},
                "psnr_p10_gain_db_vs_fixed_bits": {}, "max_latency_over_local": {},
                "events": {}, "runs": {}, "per_template": {}})
    for p in policies:
        for key in ("p90_s", "psnr_mean_db", "max_stall_s", "psnr_p10_db"):
            doc[key][p] = {}
    for lk, runs in by_loss.items():
        lat: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in runs:
            lat[r["policy"]][r["template"]].append(float(r["latency_s"]))
        p90 = {p: {t: pct(v, 90) for t, v in ts.items()} for p, ts in lat.items()}
        doc["per_template"][lk] = {p: {t: round(v, 4) for t, v in ts.items()}
                                   for p, ts in p90.items()}
        for b in BASELINES:
            ratios = [p90[b][t] / p90["sakura"][t] for t in p90.get("sakura", {})
                      if t in p90.get(b, {}) and p90["sakura"][t] > 0]
            doc[f"p90_ratio_vs_{b}"][lk] = (round(statistics.median(ratios), 4)
                                            if ratios else None)
        for p in policies:
            mine = [r for r in runs if r["policy"] == p]
            if not mine:
                continue
            psnr = [float(r["psnr_exact"]) for r in mine if r.get("psnr_exact") is not None]
            doc["p90_s"][p][lk] = round(statistics.median(p90[p].values()), 4)
            doc["psnr_mean_db"][p][lk] = round(statistics.fmean(psnr), 3) if psnr else None
            doc["psnr_p10_db"][p][lk] = round(pct(psnr, 10), 3) if psnr else None
            doc["max_stall_s"][p][lk] = round(max(float(r.get("stall_s") or 0.0)
                                                  for r in mine), 4)
        s10, f10 = (doc["psnr_p10_db"].get(p, {}).get(lk)
                    for p in ("sakura", "sakura-fixed-bits"))
        doc["psnr_p10_gain_db_vs_fixed_bits"][lk] = (
            round(s10 - f10, 3) if s10 is not None and f10 is not None else None)
        doc.setdefault("psnr_p10_gain_db_vs_fixed_bits_cached", {})[lk] = _p10_gain_cached(runs)
        over = [float(r["latency_s"]) / local[_start(r)] for r in runs
                if r["policy"] == "sakura" and _start(r) in local and local[_start(r)] > 0]
        doc["max_latency_over_local"][lk] = round(max(over), 4) if over else None
        sak = [r for r in runs if r["policy"] == "sakura"]
        doc["events"][lk] = {e: (sum(int(r.get(e) or 0) for r in sak)
                                 if e in COUNTED_EVENTS else None) for e in EVENTS}
        doc["runs"][lk] = len(runs)
        if templates:
            doc.setdefault("p90_bound_vs_cachegen", {})[lk] = p90_bound_vs_cachegen(
                runs, local, templates)
            doc.setdefault("p90_starved_estimate_vs_cachegen", {})[lk] = (
                p90_starved_estimate_vs_cachegen(runs, templates))
    return doc


def targets(doc: dict[str, Any]) -> dict[str, bool | None]:
    """Each target of the issue, True/False (None: not measured)."""
    def at_least(v: Any, x: float) -> bool | None:
        return None if v is None else v >= x

    def at_most(v: Any, x: float) -> bool | None:
        return None if v is None else v <= x

    out: dict[str, bool | None] = {}
    for lk in map(loss_key, LOSSES):
        out[f"p90_ratio_vs_cachegen[{lk}]"] = at_least(doc["p90_ratio_vs_cachegen"].get(lk),
                                                      1.82 if lk == "0" else 1.5)
        out[f"p90_ratio_vs_intq[{lk}]"] = at_least(doc["p90_ratio_vs_intq"].get(lk), 1.79)
        s, c = (doc["psnr_mean_db"].get(p, {}).get(lk) for p in ("sakura", "cachegen"))
        out[f"psnr_mean_db[sakura>=cachegen][{lk}]"] = None if None in (s, c) else s >= c
        out[f"max_stall_s[sakura][{lk}]"] = at_most(doc["max_stall_s"].get("sakura", {}).get(lk),
                                                    0.5 if lk == "0.03" else 0.2)
        out[f"psnr_p10_gain_db_vs_fixed_bits[{lk}]"] = at_least(
            doc["psnr_p10_gain_db_vs_fixed_bits"].get(lk), 2.5)
        out[f"max_latency_over_local[{lk}]"] = at_most(doc["max_latency_over_local"].get(lk),
                                                       1.15)
    rep = doc.get("repeat_edit") or {}
    if rep:
        out["repeat_edit.gap_db"] = rep["gap_db"] >= -1.0
        out["repeat_edit.first"] = rep["first_psnr_db"] >= rep["prior_psnr_db"] - 1.5
        out["repeat_edit.second"] = rep["second_psnr_db"] >= rep["prior_psnr_db"] - 1.5
    return out


def repeat_edits(packs: Path, model: Any, log: Log, windows: tuple[float, ...] = REPEAT_WINDOWS,
                 gap_s: float = REPEAT_GAP_S) -> dict[str, Any]:
    """An app's repeated edits: per window, a device new to the origin edits twice,
    ``gap_s`` apart, with no prior (state kept: the second revalidates the manifest with a
    304 and starts from the rate memory), and a fresh device edits once given the trace's
    rate at the window as its prior. The paced link (``edge.netem.shaped``), regime-matched
    like the replay: the demo's scale rule, the 30 ms round trip time-scaled."""
    from sakura.dit.templates import load_catalog  # lazy: torch
    from sakura.dit.weights import DEFAULT_WEIGHTS  # lazy: torch
    from sakura.edge.floor import regime_factor, resident_floor  # lazy: torch
    from sakura.edge.policy_packs import catalog_entry  # lazy: torch
    from sakura.edge.runtime import EdgeRuntime, EditOptions  # lazy: torch
    from sakura.edge.templates import template_from_entry  # lazy: torch

    spec = load_catalog(None)[REPEAT_TEMPLATE]
    # the weights named by their file's sha256, as `sakura edit` and `sakura build` name them
    # (a runtime without it hashes the state dict, and refuses the packs' device bundles)
    weights = file_sha256(DEFAULT_WEIGHTS)
    with ServerProcess(packs) as server:
        probe = EdgeRuntime(model, runtime="native", weights_sha256=weights)
        entry = asyncio.run(catalog_entry(server.url, REPEAT_TEMPLATE))
        template = template_from_entry(REPEAT_TEMPLATE, entry)
        req = probe.request(spec.evaluation_prompts[0], 100)
        floor = resident_floor(probe, server.url, REPEAT_TEMPLATE, template, req, repeats=3)
        path = next(p for p in trace_set("5g") if p.name == REPEAT_TRACE)
        raw = load_trace(path)
        factor = regime_factor(int(floor.manifest["fp16_bytes"]), floor.seconds,
                               float(raw.stats()["median_mbps"]) * 1e6)
        trace = raw.scaled(factor)
        rtt = matched_rtt_ms(30.0, floor.seconds, float(entry.get("token_mask_ratio") or 0))

        def one(rt: Any, start: float, prior: float | None) -> dict[str, Any]:
            with shaped(server.url, trace, start, rtt_ms=rtt) as (url, _link):
                res = rt.edit(url, REPEAT_TEMPLATE, template, req, "sakura",
                              options=EditOptions(initial_rate_bps=prior,
                                                  rate_origin=server.url))
            res.compare(floor.image)
            return {"start_s": start, "prior_bps": prior, "psnr_db": res.psnr_db,
                    "latency_s": res.latency_s, "bytes": res.bytes, "stall_s": res.stall_s,
                    "truncations": res.truncations, "hedges": res.hedges,
                    "first_configs": res.configs[:11]}

        pairs = []
        for w in windows:
            rt = EdgeRuntime(model, runtime="native", weights_sha256=weights)  # a new device
            first = one(rt, w, None)
            time.sleep(gap_s)
            second = one(rt, w, None)
            prior = one(EdgeRuntime(model, runtime="native", weights_sha256=weights), w,
                        float(trace.rate_at(w)))
            pairs.append({"window_s": w, "first": first, "second": second, "prior": prior})
            log(f"repeat edit at {w:g} s: first {first['psnr_db']:.1f} dB, second "
                f"{second['psnr_db']:.1f} dB, with the prior {prior['psnr_db']:.1f} dB")
    med = statistics.median
    return {
        "first_psnr_db": round(med(p["first"]["psnr_db"] for p in pairs), 3),
        "second_psnr_db": round(med(p["second"]["psnr_db"] for p in pairs), 3),
        "prior_psnr_db": round(med(p["prior"]["psnr_db"] for p in pairs), 3),
        "gap_db": round(med(p["second"]["psnr_db"] - p["first"]["psnr_db"] for p in pairs), 3),
        "first_minus_prior_db": round(med(p["first"]["psnr_db"] - p["prior"]["psnr_db"]
                                          for p in pairs), 3),
        "second_minus_prior_db": round(med(p["second"]["psnr_db"] - p["prior"]["psnr_db"]
                                           for p in pairs), 3),
        "second_first_configs": [p["second"]["first_configs"] for p in pairs],
        "conditions": {"link": "paced", "trace": REPEAT_TRACE, "scale": factor,
                       "link_rtt_ms": rtt, "loss": 0.0, "gap_s": gap_s, "runtime": "native"},
        "pairs": pairs,
    }


def run_tail(out: Path, quick: bool = False, starts: int | None = None, log: Log = print,
             progress: bool = True, repeat: bool = True, rto_min: str = "scaled"
             ) -> dict[str, Any]:
    """Run (or resume) every loss rate's replay into ``out``, then the repeated edits;
    returns the bench document."""
    from sakura.dit.weights import DEFAULT_WEIGHTS, load_model  # lazy: torch
    from sakura.edge.runtime import EditOptions  # lazy: torch

    if os.geteuid() != 0:
        raise TailBenchError("sakura bench tail runs the kernel-shaped link (network "
                             "namespaces, tc, nftables): run it as root")
    out = Path(out)
    packs = out / "packs"
    cfgs = tail_configs(quick, starts, str(packs), rto_min)
    model = load_model(DEFAULT_WEIGHTS)
    failed: list[str] = []
    t0 = time.monotonic()
    loads = []
    for lk, cfg in cfgs.items():
        log(f"tail: loss {lk} ({cfg.link} link, {len(cfg.policies)} policies)")
        summary = run_replay(cfg, out / f"loss-{lk}", log=log, progress=progress, model=model)
        failed += summary.get("failed", [])
        loads.append(os.getloadavg()[0])
    by_loss, templates = {}, {}
    for lk in cfgs:
        runs, tmpl = read_runs(out / f"loss-{lk}")
        by_loss[lk] = runs
        templates.update(tmpl)
    doc = summarize(by_loss, templates)
    doc["repeat_edit"] = repeat_edits(packs / "main", model, log) if repeat else None
    any_cfg = next(iter(cfgs.values()))
    sample = next((r for runs in by_loss.values() for r in runs if r["policy"] != "local"), {})
    doc["conditions"] = {
        "link": any_cfg.link, "rtt_ms": any_cfg.rtt_ms, "rtt_scale": any_cfg.rtt_scale,
        "link_rtt_ms": {t: round(float(r.get("link_rtt_ms") or 0.0), 3)
                        for t, r in templates.items()},
        "rto_min": any_cfg.rto_min,
        "rto_min_ms": sample.get("rto_min_ms"),
        "loss_mechanism": {lk: next((r.get("loss_mechanism") for r in runs
                                     if r["policy"] != "local"), None)
                           for lk, runs in by_loss.items()},
        "connections": EditOptions().max_inflight, "http_version": "1.1", "runtime": any_cfg.runtime,
        "templates": sorted(templates), "starts": {n: any_cfg.starts_of(n)
                                                   for n in any_cfg.networks},
        "quick": quick, "load_avg": loads, "seconds": round(time.monotonic() - t0, 1),
        "prior": "the trace's past median (as sakura replay); repeat_edit: none",
    }
    doc["targets"] = targets(doc)
    doc["failed_runs"] = failed
    return doc
