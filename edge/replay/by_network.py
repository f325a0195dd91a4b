"""The report read per network (issue 33 item 4): the headline of each network family the
replay names, with bootstrap intervals over start points, and which trace files each name
holds.

``networks`` (a key of ``sakura report``'s JSON) has one entry per name of
:data:`REPORT_NETWORKS`: ``5g`` (Lumos5G 5G), ``ucc5g``, ``lte`` (Lumos5G 4G), ``wifi`` (the
Wi-Fi traces only) and ``mixed`` (alternating 4G / 5G pieces). Each entry says
``replayed`` and ``files`` (the trace set's patterns under the trace folder and how many
files they match: the names stay in ``../shared/traces``, never in a report); a replayed one
holds the headline keys of :func:`sakura.edge.replay.headline.headline` on that network
alone, ``starts_per_cell``, and ``ci95``: for each latency ratio, a 95% percentile
bootstrap over **start points** (:func:`start_point_ci`: start points drawn with
replacement, each keeping every policy's run at it, so the systems stay paired on the same
network conditions; the ratio recomputed per workload, then the median over workloads, as
the headline takes it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from sakura.edge.replay.headline import headline
from sakura.edge.replay.networks import NETWORKS, network_files
from sakura.edge.replay.stats import BOOTSTRAP, group, is_main, pct
from sakura.traces.catalog import TRACE_SETS
from sakura.traces.errors import TraceError

#: the network families the report reads, in its order (the replay's own names)
REPORT_NETWORKS = ("5g", "ucc5g", "lte", "wifi", "mixed")
#: headline latency ratios with a start-point interval: key -> (numerator, denominator, q)
RATIOS = {"p90_speedup_vs_cachegen": ("cachegen", "sakura", 90),
          "p90_speedup_vs_intq": ("intq", "sakura", 90),
          "p50_speedup_vs_local": ("local", "sakura", 50)}
HEADLINE_KEYS = ("p90_speedup_vs_cachegen", "p90_speedup_vs_intq", "p50_speedup_vs_local",
                 "storage_ratio_vs_fp16", "psnr_gain_db_vs_intq", "psnr_gain_db_vs_cachegen",
                 "iso_quality", "iso_latency", "per_workload", "targets", "conditions")


def trace_files(name: str, root: str | None = None) -> dict[str, Any]:
    """What a network name holds: its trace set's pattern(s) in the trace folder and how
    many files they match (``count`` None when the trace folder is not there). The file
    names are not copied out: the patterns say which they are."""
    tset = NETWORKS[name][0]
    sets = ("lte", "5g") if tset is None else (tset,)
    try:
        count: int | None = len(network_files(name, root))
    except TraceError:
        count = None
    return {"trace_sets": list(sets), "patterns": [TRACE_SETS[s] for s in sets],
            "count": count, "type": NETWORKS[name][1]}


def _median_ratio(by_w: dict[str, dict[str, dict[int, list[float]]]], starts: list[int],
                  a: str, b: str, q: float) -> float:
    vals = []
    for pol in by_w.values():
        if a not in pol or b not in pol:
            continue
        num = [x for s in starts for x in pol[a].get(s, ())]
        den = [x for s in starts for x in pol[b].get(s, ())]
        if num and den:
            vals.append(pct(num, q) / pct(den, q))
    return float(np.median(vals)) if vals else math.nan


def start_point_ci(runs: list[dict[str, Any]], *, seed: int = 0, b: int = BOOTSTRAP
                   ) -> dict[str, list[float]]:
    """95% percentile-bootstrap intervals of :data:`RATIOS` over start points (module
    docstring). Runs without a ``start_index`` are left out; a ratio whose policies are
    missing, or with fewer than 2 start points, gets no interval."""
    main = [r for r in runs if is_main(r) and r.get("start_index") is not None]
    by_w: dict[str, dict[str, dict[int, list[float]]]] = {}
    for (w, p, s), rs in group(main, "workload", "policy", "start_index").items():
        by_w.setdefault(w, {}).setdefault(p, {})[int(s)] = [r["latency_s"] for r in rs]
    starts = sorted({int(r["start_index"]) for r in main})
    out: dict[str, list[float]] = {}
    if len(starts) < 2:
        return out
    rng = np.random.default_rng(seed)
    draws = [list(rng.choice(starts, size=len(starts), replace=True)) for _ in range(b)]
    for key, (num, den, q) in RATIOS.items():
        if math.isnan(_median_ratio(by_w, starts, num, den, q)):
            continue
        vals = np.asarray([_median_ratio(by_w, d, num, den, q) for d in draws])
        vals = vals[~np.isnan(vals)]
        if vals.size:
            out[key] = [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))]
    return out


def by_network(runs: list[dict[str, Any]], templates: dict[str, dict[str, Any]],
               root: str | None = None) -> dict[str, dict[str, Any]]:
    """The ``networks`` key (module docstring) of one mode's runs."""
    out: dict[str, dict[str, Any]] = {}
    for net in REPORT_NETWORKS:
        rs = [r for r in runs if r.get("network") == net]
        entry: dict[str, Any] = {"replayed": bool(rs), "runs": len(rs),
                                 "files": trace_files(net, root)}
        if rs:
            h = headline(rs, templates, (net,))
            entry.update({k: h[k] for k in HEADLINE_KEYS if k in h})
            entry["starts_per_cell"] = h["conditions"]["starts_per_cell"]
            entry["ci95"] = start_point_ci(rs)
        out[net] = entry
    return out


__all__ = ["HEADLINE_KEYS", "RATIOS", "REPORT_NETWORKS", "by_network", "start_point_ci",
           "trace_files"]
