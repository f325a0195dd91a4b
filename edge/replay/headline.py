"""The headline ratios of a replay and sakura's equal-quality / equal-latency views.

Headline ratios (:func:`headline`), on the ``headline_networks`` (default ``5g``,
Lumos5G, the network that defines the regime): per workload, every run of its templates
is pooled; the ratio is taken per workload and the median over workloads is reported.
``p90_speedup_vs_X = p90(X) / p90(sakura)``, ``p50_speedup_vs_local = p50(local) /
p50(sakura)``, ``storage_ratio_vs_fp16 = stored FP16 pack / stored sakura pack`` (mean over
the workload's templates), ``psnr_gain_db_vs_X = mean PSNR(sakura) - mean PSNR(X)`` vs
``exact``.

Operating points: ``sakura-d<m>`` runs (sakura given a deadline of m x T) are not systems
of their own; with ``sakura`` they form sakura's latency-quality curve on the headline
networks, from which the **iso-quality** view (per baseline: the lowest p90 latency of a
sakura point whose mean PSNR vs ``exact`` is at least the baseline's; ratio = baseline p90
/ that) and the **iso-latency** view (the best mean PSNR of a sakura point whose p90 is at
most the baseline's, minus the baseline's) are read (:func:`iso_views`). :func:`conditions`
states the link (RTT, loss, emulator, CPUs), the start points per cell and the trace
scaling; :func:`allocation_quality` says whether sakura's packs carried output-PSNR profiles
(``psnr_profile``) or only the KV-error proxy (``kv_error``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
from sakura.edge.replay.stats import boot_ratio_ci, group, is_main, is_point, mean, pct, psnr_mean

TARGETS: dict[str, tuple[str, float]] = {
    "p90_speedup_vs_cachegen": (">=", 1.82),
    "p90_speedup_vs_intq": (">=", 1.79),
    "p50_speedup_vs_local": (">=", 3.27),
    "storage_ratio_vs_fp16": (">=", 3.06),
    "psnr_gain_db_vs_intq": (">", 0.0),
    "psnr_gain_db_vs_cachegen": (">", 0.0),
}
ISO_BASELINES = ("cachegen", "intq")
ISO_TARGETS: dict[str, tuple[str, float]] = {
    "iso_quality.latency_ratio_vs_cachegen_p90": (">=", 1.82),
    "iso_quality.latency_ratio_vs_intq_p90": (">=", 1.79),
    "iso_latency.psnr_gain_db_vs_cachegen": (">", 0.0),
    "iso_latency.psnr_gain_db_vs_intq": (">", 0.0),
}


def _ratio(lat: dict[str, list[float]], a: str, b: str, q: float) -> float:
    """The ``q``-th percentile latency of ``a`` over that of ``b`` (NaN if one is missing)."""
    if a in lat and b in lat:
        return pct(lat[a], q) / pct(lat[b], q)
    return math.nan


def headline(runs: list[dict[str, Any]], templates: dict[str, dict[str, Any]],
             networks: Iterable[str] = ("5g",)) -> dict[str, Any]:
    """The headline ratios of one mode's runs (see the module docstring)."""
    nets = set(networks)
    main = [r for r in runs if is_main(r) and r["network"] in nets]
    points = [r for r in runs if is_point(r) and r["network"] in nets]
    per: dict[str, dict[str, Any]] = {}
    iso_per: dict[str, dict[str, Any]] = {}
    for (w,), rs in sorted(group(main, "workload").items()):
        by = group(rs, "policy")
        lat = {p: [r["latency_s"] for r in v] for (p,), v in by.items()}
        psn = {p: psnr_mean(r.get("psnr_exact") for r in v)[0] for (p,), v in by.items()}
        d: dict[str, Any] = {}
        ci: dict[str, list[float]] = {}
        for key, (a, b, q) in {"p90_speedup_vs_cachegen": ("cachegen", "sakura", 90),
                               "p90_speedup_vs_intq": ("intq", "sakura", 90),
                               "p50_speedup_vs_local": ("local", "sakura", 50)}.items():
            d[key] = _ratio(lat, a, b, q)
            if a in lat and b in lat:
                ci[key] = list(boot_ratio_ci(lat[a], lat[b], q))
        tids = sorted({r["template"] for r in rs})
        ratios = []
        for t in tids:
            st = next((v.get("storage_bytes") for v in templates.values()
                       if v["template"] == t), None) or {}
            if st.get("fp16") and st.get("sakura"):
                ratios.append(st["fp16"] / st["sakura"])
        d["storage_ratio_vs_fp16"] = mean(ratios)
        for other in ("intq", "cachegen"):
            d[f"psnr_gain_db_vs_{other}"] = (psn["sakura"] - psn[other]
                                             if "sakura" in psn and other in psn else math.nan)
        d["templates"] = tids
        d["runs"] = len(rs)
        d["n_per_policy"] = {p: len(v) for p, v in lat.items()}
        d["ci95"] = ci
        per[w] = d
        wp = [r for r in points if r["workload"] == w]
        iso_per[w] = iso_views(rs, wp)
    out: dict[str, Any] = {"headline_networks": sorted(nets), "per_workload": per}
    for key, (op, target) in TARGETS.items():
        vals = [d[key] for d in per.values() if not math.isnan(d[key])]
        value = float(np.median(vals)) if vals else None
        ok = None if value is None else (value >= target if op == ">=" else value > target)
        out[key] = value
        out.setdefault("targets", {})[key] = {"target": f"{op} {target:g}", "value": value,
                                              "pass": ok}
    iso_q: dict[str, Any] = {"per_workload": {}}
    iso_l: dict[str, Any] = {"per_workload": {}}
    for w, views in iso_per.items():
        iso_q["per_workload"][w] = {b: v["iso_quality"] for b, v in views.items()}
        iso_l["per_workload"][w] = {b: v["iso_latency"] for b, v in views.items()}
    for b in ISO_BASELINES:
        qk, lk = f"latency_ratio_vs_{b}_p90", f"psnr_gain_db_vs_{b}"
        qv = [v[b]["iso_quality"]["ratio"] for v in iso_per.values() if b in v]
        lv = [v[b]["iso_latency"]["gain_db"] for v in iso_per.values() if b in v]
        iso_q[qk] = _median_or_none(qv)
        iso_l[lk] = _median_or_none(lv)
        iso_q[f"workloads_without_a_point_vs_{b}"] = sorted(
            w for w, v in iso_per.items() if b in v and v[b]["iso_quality"]["ratio"] is None)
        iso_l[f"workloads_without_a_point_vs_{b}"] = sorted(
            w for w, v in iso_per.items() if b in v and v[b]["iso_latency"]["gain_db"] is None)
    out["iso_quality"] = iso_q
    out["iso_latency"] = iso_l
    for key, (op, target) in ISO_TARGETS.items():
        section, name = key.split(".")
        value = out[section][name]
        missing = out[section].get(f"workloads_without_a_point_vs_{name.split('_vs_')[1].split('_')[0]}")
        ok = None if value is None else (value >= target if op == ">=" else value > target)
        if ok and missing:
            ok = False  # a workload where no sakura point qualifies is a miss
        out["targets"][key] = {"target": f"{op} {target:g}", "value": value, "pass": ok}
    out["conditions"] = conditions(runs, templates, nets)
    out["allocation_quality"] = allocation_quality(templates)
    return out


def _median_or_none(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.median(vals)) if vals else None


def operating_points(runs: list[dict[str, Any]], points: list[dict[str, Any]]
                     ) -> dict[str, dict[str, Any]]:
    """sakura's operating points of one workload: ``sakura`` and every ``sakura-d<m>``,
    each with its latencies, p90 and mean PSNR vs exact."""
    out: dict[str, dict[str, Any]] = {}
    for (p,), rs in group([r for r in runs if r["policy"] == "sakura"] + points,
                          "policy").items():
        lat = [r["latency_s"] for r in rs]
        out[p] = {"policy": p, "n": len(rs), "latencies": lat, "p50": pct(lat, 50),
                  "p90": pct(lat, 90), "psnr_exact": psnr_mean(r.get("psnr_exact")
                                                               for r in rs)[0],
                  "mb": mean(r["bytes"] / 1e6 for r in rs),
                  "deadline_s": mean(r.get("deadline_s") for r in rs)}
    return out


def iso_views(runs: list[dict[str, Any]], points: list[dict[str, Any]]
              ) -> dict[str, dict[str, Any]]:
    """Per baseline: the iso-quality and iso-latency comparisons (module docstring)."""
    pts = operating_points(runs, points)
    out: dict[str, dict[str, Any]] = {}
    for b in ISO_BASELINES:
        br = [r for r in runs if r["policy"] == b]
        if not br or not pts:
            continue
        blat = [r["latency_s"] for r in br]
        bp90 = pct(blat, 90)
        bpsnr = psnr_mean(r.get("psnr_exact") for r in br)[0]
        base = {"baseline": b, "baseline_p90_s": bp90, "baseline_psnr_db": bpsnr,
                "baseline_n": len(br)}
        reach = [v for v in pts.values() if v["psnr_exact"] >= bpsnr]
        if reach:
            best = min(reach, key=lambda v: v["p90"])
            iq = {**base, "ratio": bp90 / best["p90"], "point": best["policy"],
                  "point_p90_s": best["p90"], "point_psnr_db": best["psnr_exact"],
                  "point_n": best["n"],
                  "ci95": list(boot_ratio_ci(blat, best["latencies"], 90))}
        else:
            top = max(pts.values(), key=lambda v: v["psnr_exact"])
            iq = {**base, "ratio": None, "point": None, "best_point": top["policy"],
                  "best_point_psnr_db": top["psnr_exact"]}
        within = [v for v in pts.values() if v["p90"] <= bp90]
        if within:
            best = max(within, key=lambda v: (v["psnr_exact"], -v["p90"]))
            il = {**base, "gain_db": best["psnr_exact"] - bpsnr, "point": best["policy"],
                  "point_p90_s": best["p90"], "point_psnr_db": best["psnr_exact"],
                  "point_n": best["n"]}
        else:
            fast = min(pts.values(), key=lambda v: v["p90"])
            il = {**base, "gain_db": None, "point": None, "fastest_point": fast["policy"],
                  "fastest_point_p90_s": fast["p90"]}
        out[b] = {"iso_quality": iq, "iso_latency": il,
                  "points": {p: {k: v for k, v in d.items() if k != "latencies"}
                             for p, d in pts.items()}}
    return out


def conditions(runs: list[dict[str, Any]], templates: dict[str, dict[str, Any]],
               nets: set[str]) -> dict[str, Any]:
    """What the numbers were measured under: link, RTT, loss, CPUs, start points per cell
    (distinct start points of each (template, network, policy) of the main runs on the
    headline networks: the smallest is reported), the trace scaling per template."""
    main = [r for r in runs if is_main(r)]
    cells = group(main, "template", "network", "policy")
    per_net: dict[str, int] = {}
    for (_t, n, _p), rs in cells.items():
        k = len({r["start_index"] for r in rs})
        per_net[n] = min(per_net.get(n, k), k)
    head = [v for n, v in per_net.items() if n in nets]
    rtts = sorted({float(r["rtt_ms"]) for r in runs if r.get("rtt_ms") is not None})
    link_rtts = {r["template"]: float(r["link_rtt_ms"]) for r in runs
                 if r.get("link_rtt_ms") is not None}
    scales = sorted({str(r["rtt_scale"]) for r in runs if r.get("rtt_scale")})
    losses = sorted({float(r.get("loss") or 0.0) for r in runs if "rtt_ms" in r})
    links = sorted({str(r.get("link")) for r in runs if r.get("link")})
    cpus = next((r["cpus"] for r in runs if r.get("cpus")), None)
    return {
        "rtt_ms": (rtts[0] if len(rtts) == 1 else rtts) if rtts else 0.0,
        "rtt_scale": scales[0] if len(scales) == 1 else scales,
        "link_rtt_ms": link_rtts,
        "loss": (losses[0] if len(losses) == 1 else losses) if losses else 0.0,
        "link": links[0] if len(links) == 1 else links,
        "cpus": cpus,
        "starts_per_cell": min(head) if head else 0,
        "starts_per_cell_by_network": per_net,
        "trace_scaling": {t["template"]: t.get("factor") for t in templates.values()},
    }


def allocation_quality(templates: dict[str, dict[str, Any]]) -> str | None:
    """``psnr_profile`` when every template's sakura pack carried output-PSNR profiles,
    ``kv_error`` when any did not (None when the records do not say)."""
    kinds = {(t.get("allocation_quality") or {}).get("sakura") for t in templates.values()}
    kinds.discard(None)
    if not kinds:
        return None
    return "psnr_profile" if kinds == {"psnr_profile"} else "kv_error"

