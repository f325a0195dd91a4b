"""``sakura report``: a self-contained Markdown report (PNG figures) and headline ratios.

Everything is computed from ``runs.jsonl`` of one replay (one machine, one run), per
regime mode present. "Main" runs are the workload templates at their catalog resolution
with their own packs; the q ablation (``sakura-q*``) and the second-resolution variants
(``<id>-<res>``) are reported in their own sections only.

Aggregates: latency percentiles are linear-interpolated (numpy) and come with their
sample count and a 95% bootstrap confidence interval (``scipy.stats.bootstrap``, percentile method, seeded);
latency CDFs show ``n`` and a 95% Dvoretzky-Kiefer-Wolfowitz band. PSNR of identical images
(``fp16`` vs ``exact``) is infinite: a group whose every image is identical is reported as
``inf`` (``identical``); a group with some identical images averages them as ``PSNR_CAP``
dB and says how many.

Operating points: ``sakura-d<m>`` runs (sakura given a deadline of m x T) are not systems
of their own; with ``sakura`` they form sakura's latency-quality curve on the headline
networks, from which the **iso-quality** view (per baseline: the lowest p90 latency of a
sakura point whose mean PSNR vs ``exact`` is at least the baseline's; ratio = baseline p90
/ that) and the **iso-latency** view (the best mean PSNR of a sakura point whose p90 is at
most the baseline's, minus the baseline's) are read. ``conditions`` states the link (RTT,
loss, emulator, CPUs), the start points per cell and the trace scaling;
``allocation_quality`` says whether sakura's packs carried output-PSNR profiles
(``psnr_profile``) or only the KV-error proxy (``kv_error``).

Every sentence the report generates picks its wording from the numbers it cites
(:func:`_why`, :func:`_iso_text`); ``tests/edge/test_replay.py`` feeds contradicting data
and checks the wording follows.

Headline ratios (:func:`headline`), on the ``headline_networks`` (default ``5g``,
Lumos5G, the network that defines the regime): per workload, every run of its templates
is pooled; the ratio is taken per workload and the median over workloads is reported.
``p90_speedup_vs_X = p90(X) / p90(sakura)``, ``p50_speedup_vs_local = p50(local) /
p50(sakura)``, ``storage_ratio_vs_fp16 = stored FP16 pack / stored sakura pack`` (mean over
the workload's templates), ``psnr_gain_db_vs_X = mean PSNR(sakura) - mean PSNR(X)`` vs
``exact``.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from sakura.edge.errors import EdgeError
from sakura.edge.replay.results import META_FILE, ResultsFile, expand_timeline, number
from sakura.edge.timeline import plot_timeline
from scipy import stats

from sakura.atomic import write_atomic

PSNR_CAP = 100.0
POLICY_ORDER = ("sakura", "svd", "intq", "cachegen", "fp16", "local", "sakura-fixed-config",
                "sakura-fixed-bits")
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
BOOTSTRAP = 1000
COLORS = {"sakura": "#C44E52", "svd": "#DD8452", "intq": "#4C72B0", "cachegen": "#8172B3",
          "fp16": "#937860", "local": "#55A868", "sakura-fixed-config": "#DA8BC3",
          "sakura-fixed-bits": "#8C8C8C"}


# ---------------------------------------------------------------------------- numbers


def psnr_value(x: Any) -> float | None:
    v = number(x)
    return None if v is None else min(v, PSNR_CAP)


def pct(values: Iterable[float], q: float) -> float:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else math.nan


def mean(values: Iterable[float]) -> float:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return float(arr.mean()) if arr.size else math.nan


def psnr_mean(values: Iterable[Any]) -> tuple[float, int, int]:
    """(mean PSNR in dB, identical images, images): ``inf`` when every image is identical,
    else identical ones count as ``PSNR_CAP`` (the report says how many)."""
    vals = [number(v) for v in values]
    vals = [v for v in vals if v is not None]
    if not vals:
        return math.nan, 0, 0
    n_inf = sum(1 for v in vals if math.isinf(v))
    if n_inf == len(vals):
        return math.inf, n_inf, len(vals)
    return float(np.mean([min(v, PSNR_CAP) for v in vals])), n_inf, len(vals)


def boot_ci(values: Iterable[float], q: float, *, seed: int = 0, b: int = BOOTSTRAP
            ) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the ``q``-th percentile (NaNs when n < 2)."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size < 2:
        return math.nan, math.nan
    res = stats.bootstrap((arr,), lambda x, axis: np.percentile(x, q, axis=axis),
                          n_resamples=b, method="percentile", vectorized=True,
                          rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def boot_ratio_ci(num: Iterable[float], den: Iterable[float], q: float, *, seed: int = 0,
                  b: int = BOOTSTRAP) -> tuple[float, float]:
    """95% bootstrap interval of ``pct(num, q) / pct(den, q)`` (both resampled)."""
    a = np.asarray(list(num), dtype=np.float64)
    d = np.asarray(list(den), dtype=np.float64)
    if a.size < 2 or d.size < 2:
        return math.nan, math.nan
    res = stats.bootstrap(
        (a, d), lambda x, y, axis: (np.percentile(x, q, axis=axis)
                                    / np.percentile(y, q, axis=axis)),
        n_resamples=b, method="percentile", vectorized=True, paired=False,
        rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def dkw_eps(n: int, alpha: float = 0.05) -> float:
    """Half-width of the (1 - alpha) Dvoretzky-Kiefer-Wolfowitz band of an empirical CDF."""
    return math.sqrt(math.log(2.0 / alpha) / (2.0 * n)) if n else 1.0


def _order(policies: Iterable[str]) -> list[str]:
    ps = set(policies)
    known = [p for p in POLICY_ORDER if p in ps]
    return known + sorted(ps - set(known))


def is_point(rec: dict[str, Any]) -> bool:
    """A ``sakura-d<m>`` run: an operating point of sakura, not a system of its own."""
    return rec.get("deadline_s") is not None or rec["policy"].startswith("sakura-d")


def is_main(rec: dict[str, Any]) -> bool:
    return (rec["template"] == rec["base_template"] and rec.get("variant", "main") == "main"
            and not is_point(rec))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [r["latency_s"] for r in runs]
    pe = [psnr_value(r.get("psnr_exact")) for r in runs]
    pf = [psnr_value(r.get("psnr_full")) for r in runs]
    pe_mean, pe_inf, _ = psnr_mean(r.get("psnr_exact") for r in runs)
    pf_mean, pf_inf, _ = psnr_mean(r.get("psnr_full") for r in runs)
    return {
        "n": len(runs), "p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99),
        "p50_ci": boot_ci(lat, 50), "p90_ci": boot_ci(lat, 90), "p99_ci": boot_ci(lat, 99),
        "mb": mean(r["bytes"] / 1e6 for r in runs),
        "stalls": mean(r["stalls"] for r in runs),
        "stall_s": mean(r["stall_s"] for r in runs),
        "startup_s": mean(r.get("startup_s") for r in runs),
        "exec_s": mean(r.get("exec_s") for r in runs),
        "psnr_exact": pe_mean, "psnr_exact_identical": pe_inf,
        "psnr_full_identical": pf_inf,
        "psnr_exact_p10": pct(pe, 10),
        "ssim_exact": mean(r.get("ssim_exact") for r in runs),
        "ssim_exact_p10": pct([r.get("ssim_exact") for r in runs], 10),
        "psnr_full": pf_mean, "psnr_full_p10": pct(pf, 10),
        "ssim_full": mean(r.get("ssim_full") for r in runs),
    }


def group(runs: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        out[tuple(r[k] for k in keys)].append(r)
    return dict(out)


# ---------------------------------------------------------------------------- headline


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
    out: dict[str, Any] = {"networks": sorted(nets), "per_workload": per}
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


# ---------------------------------------------------------------------------- figures


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mark(fig: Any, note: str) -> None:
    """Print a figure's provenance (e.g. MODELLED) in the image, top left."""
    if note:
        fig.text(0.005, 0.995, note, ha="left", va="top", fontsize=8, color="#C44E52",
                 weight="bold")


def _log_x(ax: Any) -> None:
    """A log x axis whose labels never overlap: 1-2-5 major labels only."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    fmt = ScalarFormatter()
    fmt.set_scientific(False)
    ax.xaxis.set_major_formatter(fmt)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", labelsize=8)


def fig_latency(runs: list[dict[str, Any]], title: str, path: Path, note: str = "") -> Path:
    """(a) latency CDF per policy with n and a 95% DKW band; (b) p50/p90/p99 bars with 95%
    bootstrap intervals."""
    plt = _plt()
    by = group(runs, "policy")
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    pols = _order(p for (p,) in by)
    for p in pols:
        lat = np.sort([r["latency_s"] for r in by[(p,)]])
        n = len(lat)
        y = np.arange(1, n + 1) / n
        eps = dkw_eps(n)
        a.step(lat, y, where="post", label=f"{p} (n={n})", color=COLORS.get(p))
        a.fill_between(lat, np.clip(y - eps, 0, 1), np.clip(y + eps, 0, 1), step="post",
                       color=COLORS.get(p), alpha=0.08, linewidth=0)
    _log_x(a)
    a.set_xlabel("end-to-end latency (s, log)")
    a.set_ylabel("fraction of runs")
    a.set_ylim(0, 1.02)
    a.grid(alpha=0.3)
    a.legend(fontsize=7, loc="lower right")
    a.set_title("(a) latency CDF (shaded: 95% DKW band)", fontsize=9)
    x = np.arange(len(pols))
    for i, (q, alpha) in enumerate(((50, 1.0), (90, 0.7), (99, 0.4))):
        lats = [[r["latency_s"] for r in by[(p,)]] for p in pols]
        vals = [pct(v, q) for v in lats]
        cis = [boot_ci(v, q) for v in lats]
        err = np.array([[max(0.0, v - lo) if not math.isnan(lo) else 0.0 for v, (lo, _) in
                         zip(vals, cis)],
                        [max(0.0, hi - v) if not math.isnan(hi) else 0.0 for v, (_, hi) in
                         zip(vals, cis)]])
        b.bar(x + (i - 1) * 0.27, vals, 0.27, alpha=alpha, label=f"p{q}",
              color=[COLORS.get(p, "#333") for p in pols], yerr=err,
              error_kw={"elinewidth": 0.8, "capsize": 2})
    b.set_xticks(x, [f"{p}\nn={len(by[(p,)])}" for p in pols], rotation=30, ha="right",
                 fontsize=7)
    b.set_ylabel("latency (s, log)")
    b.set_yscale("log")
    b.legend(fontsize=7)
    b.grid(axis="y", alpha=0.3)
    b.set_title("(b) p50 / p90 / p99 with 95% bootstrap intervals", fontsize=9)
    fig.suptitle(title, fontsize=10)
    _mark(fig, note)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fig_rate_quality(runs: list[dict[str, Any]], title: str, path: Path,
                     note: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    n_inf = 0
    for (p,), rs in sorted(group(runs, "policy").items()):
        if p == "local":
            continue
        ys = [number(r.get("psnr_exact")) for r in rs]
        n_inf += sum(1 for y in ys if y is not None and math.isinf(y))
        ax.scatter([r["bytes"] / 1e6 for r in rs], [psnr_value(y) for y in ys],
                   s=12, label=f"{p} (n={len(rs)})", color=COLORS.get(p), alpha=0.7)
    _log_x(ax)
    ax.set_xlabel("MB moved (log)")
    ax.set_ylabel("PSNR vs exact (dB)")
    if n_inf:
        ax.axhline(PSNR_CAP, color="#999", lw=0.6, ls=":")
        ax.text(ax.get_xlim()[0], PSNR_CAP, f" identical images (inf dB) drawn at "
                f"{PSNR_CAP:g}", fontsize=7, va="bottom", color="#555")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    _mark(fig, note)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fig_latency_quality(runs: list[dict[str, Any]], points: list[dict[str, Any]],
                        title: str, path: Path, note: str = "") -> Path:
    """Every run (faint) and every system's (p90 latency, mean PSNR) (large); sakura's
    operating points joined into its latency-quality curve."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.5, 4.6))

    def finite_psnr(r: dict[str, Any]) -> bool:
        v = number(r.get("psnr_exact"))
        return v is not None and not math.isinf(v)

    every = [r for r in runs if r["policy"] != "local"] + points
    identical = sorted({r["policy"] for r in every if not finite_psnr(r)})
    every = [r for r in every if finite_psnr(r)]
    for (p,), rs in sorted(group(every, "policy").items()):
        color = COLORS.get(p, COLORS["sakura"] if p.startswith("sakura-d") else "#333")
        ax.scatter([r["latency_s"] for r in rs], [number(r["psnr_exact"]) for r in rs], s=8,
                   color=color, alpha=0.25)
    curve = []
    for (p,), rs in sorted(group(every, "policy").items()):
        x = pct([r["latency_s"] for r in rs], 90)
        y = psnr_mean(r.get("psnr_exact") for r in rs)[0]
        is_curve = p == "sakura" or p.startswith("sakura-d")
        color = COLORS.get(p, COLORS["sakura"] if is_curve else "#333")
        ax.scatter([x], [y], s=60, color=color, edgecolor="black", zorder=3,
                   marker="o" if not p.startswith("sakura-d") else "D",
                   label=f"{p} (p90, mean; n={len(rs)})")
        if is_curve:
            curve.append((x, y))
    if identical:
        ax.text(0.01, 0.98, "not drawn (images identical to exact, PSNR inf): "
                + ", ".join(identical), transform=ax.transAxes, fontsize=7, va="top",
                color="#555")
    if len(curve) > 1:
        curve.sort()
        ax.plot([c[0] for c in curve], [c[1] for c in curve], color=COLORS["sakura"],
                lw=1, zorder=2)
    _log_x(ax)
    ax.set_xlabel("latency (s, log): small dots every run, large markers the p90")
    ax.set_ylabel("PSNR vs exact (dB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title, fontsize=10)
    _mark(fig, note)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fig_bars(rows: dict[str, dict[str, float]], ylabel: str, title: str, path: Path,
             log: bool = False, note: str = "") -> Path:
    """Grouped bars: rows (x groups) x series (policies)."""
    plt = _plt()
    groups = list(rows)
    series = _order({s for r in rows.values() for s in r})
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups) + 3), 3.6))
    w = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        ax.bar(np.arange(len(groups)) + i * w - 0.4 + w / 2,
               [rows[g].get(s, math.nan) for g in groups], w, label=s, color=COLORS.get(s))
    ax.set_xticks(np.arange(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=10)
    _mark(fig, note)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- markdown


def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _fp(x: Any) -> str:
    """A PSNR cell: ``inf (identical)`` when every image is identical."""
    if isinstance(x, float) and math.isinf(x):
        return "inf (identical)"
    return _f(x, 1)


def _fpn(x: Any, identical: int, n: int) -> str:
    """A mean-PSNR cell that says how many identical images it counted as ``PSNR_CAP``."""
    cell = _fp(x)
    if 0 < identical < n:
        cell += f" ({identical}/{n} identical, as {PSNR_CAP:g} dB)"
    return cell


def _fci(x: Any, ci: tuple[float, float]) -> str:
    """A percentile cell with its 95% bootstrap interval."""
    if any(math.isnan(v) for v in ci):
        return _f(x)
    return f"{_f(x)} [{_f(ci[0])}, {_f(ci[1])}]"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _policy_table(runs: list[dict[str, Any]]) -> str:
    rows = []
    for p in _order({r["policy"] for r in runs}):
        s = summarize([r for r in runs if r["policy"] == p])
        rows.append([p, str(s["n"]), _fci(s["p50"], s["p50_ci"]), _fci(s["p90"], s["p90_ci"]),
                     _fci(s["p99"], s["p99_ci"]), _f(s["mb"]),
                     _f(s["stalls"], 1), _fpn(s["psnr_exact"], s["psnr_exact_identical"], s["n"]),
                     _fp(s["psnr_exact_p10"]),
                     _f(s["ssim_exact"], 3), _f(s["ssim_exact_p10"], 3),
                     _fpn(s["psnr_full"], s["psnr_full_identical"], s["n"]),
                     _fp(s["psnr_full_p10"]), _f(s["ssim_full"], 3)])
    return _table(["policy", "runs", "p50 s [95% CI]", "p90 s [95% CI]", "p99 s [95% CI]",
                   "MB moved", "stalls",
                   "PSNR exact", "p10", "SSIM exact", "p10", "PSNR full", "p10",
                   "SSIM full"], rows)


def _why(key: str, w: str, runs: list[dict[str, Any]], tmpl: list[dict[str, Any]]) -> str:
    """A data-driven explanation of a missed target for workload ``w``: every clause is
    chosen by comparing the numbers it cites (tested with contradicting data)."""
    by = {p: summarize(v) for (p,), v in group(runs, "policy").items()}
    s = by.get("sakura", {})
    if key == "p50_speedup_vs_local":
        bounds = [t["local_s"] / t["masked_exec_s"] for t in tmpl if t.get("masked_exec_s")]
        bound = mean(bounds)
        local = by.get("local", {}).get("p50", math.nan)
        text = (f"`local` takes {_f(local)} s at p50; sakura {_f(s.get('p50'))} s with "
                f"{_f(s.get('stall_s'))} s of stalls and {_f(s.get('startup_s'))} s before its "
                f"first shard executed (means). ")
        if bound < TARGETS[key][1]:
            text += (f"Even with no transfer at all, the cached edit cannot beat local by more "
                     f"than local / masked execution = {_f(bound)}x on this model and host, "
                     f"below the {TARGETS[key][1]:g}x target (the paper's phone: 13 / 2.3 = "
                     "5.65x).")
        else:
            text += (f"Local / masked execution is {_f(bound)}x here, so the bound allows the "
                     "target: the rest is lost to start-up, stalls and execution slowed while "
                     "streaming.")
        return text
    if key.startswith("p90_speedup_vs_"):
        other = key.rsplit("_", 1)[1]
        o = by.get(other, {})
        sp, op_ = s.get("p90", math.nan), o.get("p90", math.nan)
        text = (f"p90: sakura {_f(sp)} s ({_f(s.get('mb'))} MB, {_f(s.get('stalls'), 1)} "
                f"stalls, {_f(s.get('stall_s'))} s stalled on mean) vs {other} {_f(op_)} s "
                f"({_f(o.get('mb'))} MB, {_f(o.get('stalls'), 1)} stalls, "
                f"{_f(o.get('stall_s'))} s). ")
        if sp > op_:
            # "worse" = more than 5% (stalls: more than 5% of sakura's p90) beyond the other
            worse = {
                "stalls": s.get("stall_s", 0) > o.get("stall_s", 0) + 0.05 * sp,
                "bytes": s.get("mb", 0) > 1.05 * o.get("mb", 0),
                "start-up": s.get("startup_s", 0) > 1.05 * o.get("startup_s", 0) + 1e-3,
                "execution": s.get("exec_s", 0) > 1.05 * o.get("exec_s", 0),
            }
            reasons = []
            if worse["stalls"]:
                reasons.append(f"it stalled longer ({_f(s['stall_s'])} vs "
                               f"{_f(o.get('stall_s'))} s on mean): windows where the link "
                               "delivered less than the rate estimate promised")
            if worse["bytes"]:
                reasons.append(f"it moved more bytes ({_f(s['mb'])} vs {_f(o.get('mb'))} MB)")
            if worse["start-up"]:
                reasons.append(f"its first shard executed later ({_f(s['startup_s'])} vs "
                               f"{_f(o.get('startup_s'))} s on mean)")
            if worse["execution"]:
                reasons.append(f"its execution took longer ({_f(s['exec_s'])} vs "
                               f"{_f(o.get('exec_s'))} s on mean)")
            if reasons:
                text += "sakura is slower at p90: " + "; ".join(reasons) + "."
            else:
                text += (f"sakura is slower at p90, though none of its means is worse by more "
                         f"than 5%: stalls {_f(s.get('stall_s'))} vs {_f(o.get('stall_s'))} s, "
                         f"{_f(s.get('mb'))} vs {_f(o.get('mb'))} MB, start-up "
                         f"{_f(s.get('startup_s'))} vs {_f(o.get('startup_s'))} s, execution "
                         f"{_f(s.get('exec_s'))} vs {_f(o.get('exec_s'))} s: the difference is "
                         "in the tail runs (see the CDF).")
        else:
            ratio = op_ / sp if sp else math.nan
            text += f"sakura is faster at p90 ({_f(ratio)}x), short of {TARGETS[key][1]:g}x: "
            s_frac = s.get("stall_s", 0) / s.get("p50", 1) if s.get("p50") else math.nan
            o_frac = o.get("stall_s", 0) / o.get("p50", 1) if o.get("p50") else math.nan
            if s_frac < 0.2 and o_frac < 0.2:
                text += (f"both are execution-bound (stalls {100 * s_frac:.0f}% and "
                         f"{100 * o_frac:.0f}% of the p50 latency): the link hides most of both "
                         "transfers behind the same model's execution.")
            else:
                text += (f"{other} stalls {_f(o.get('stall_s'))} s on mean and sakura "
                         f"{_f(s.get('stall_s'))} s; the lead is what sakura's smaller "
                         f"transfers ({_f(s.get('mb'))} vs {_f(o.get('mb'))} MB) save.")
        return text + " The timeline below is sakura's run at its p90."
    if key == "storage_ratio_vs_fp16":
        return ("the stored sakura pack holds every (rank, bits) prefix up to r_max; its size "
                "relative to FP16 depends on the cache's shape (tokens x channels) of this "
                "small model.")
    other = key.rsplit("_", 1)[1]
    o = by.get(other, {})
    text = (f"mean PSNR vs exact: sakura {_fp(s.get('psnr_exact'))} dB, {other} "
            f"{_fp(o.get('psnr_exact'))} dB; sakura moved {_f(s.get('mb'))} MB in "
            f"{_f(s.get('p90'))} s at p90, {other} {_f(o.get('mb'))} MB in "
            f"{_f(o.get('p90'))} s. ")
    if o.get("mb", 0) > s.get("mb", 0):
        text += (f"{other} streamed more bytes" + (" and took longer" if o.get("p90", 0) >
                                                   s.get("p90", 0) else "")
                 + ": sakura's operating point spends less; the iso-quality and iso-latency "
                 "views below compare at equal quality and equal latency.")
    else:
        text += ("sakura moved as many bytes or more and still scored lower: its "
                 "configurations lose more quality per byte here (see the rate-quality "
                 "figure).")
    return text


def _iso_text(b: str, view: dict[str, Any]) -> list[str]:
    """The iso-quality and iso-latency sentences for baseline ``b`` (numbers cited are the
    ones compared)."""
    q, lat = view["iso_quality"], view["iso_latency"]
    out = []
    if q["ratio"] is not None:
        ci = q.get("ci95") or [math.nan, math.nan]
        faster = "faster" if q["ratio"] > 1 else "slower" if q["ratio"] < 1 else "as fast"
        out.append(f"At equal or better quality than {b} (mean PSNR {_fp(q['baseline_psnr_db'])}"
                   f" dB vs exact, n={q['baseline_n']}), sakura's fastest qualifying point is "
                   f"`{q['point']}` ({_fp(q['point_psnr_db'])} dB, p90 "
                   f"{_f(q['point_p90_s'])} s, n={q['point_n']}): {b}'s p90 "
                   f"{_f(q['baseline_p90_s'])} s / {_f(q['point_p90_s'])} s = "
                   f"**{_f(q['ratio'])}x** (95% CI {_f(ci[0])}-{_f(ci[1])}); sakura is "
                   f"{faster} at equal quality.")
    else:
        out.append(f"No sakura operating point reaches {b}'s mean PSNR "
                   f"({_fp(q['baseline_psnr_db'])} dB); the best, `{q['best_point']}`, reaches "
                   f"{_fp(q['best_point_psnr_db'])} dB: no iso-quality ratio (a miss).")
    if lat["gain_db"] is not None:
        sign = "better" if lat["gain_db"] > 0 else "worse" if lat["gain_db"] < 0 else "equal"
        out.append(f"At {b}'s p90 latency ({_f(lat['baseline_p90_s'])} s) or less, sakura's best "
                   f"point `{lat['point']}` (p90 {_f(lat['point_p90_s'])} s) has mean PSNR "
                   f"{_fp(lat['point_psnr_db'])} dB: **{lat['gain_db']:+.2f} dB** vs {b} "
                   f"({sign}).")
    else:
        out.append(f"No sakura operating point is as fast as {b} at p90 "
                   f"({_f(lat['baseline_p90_s'])} s); the fastest, `{lat['fastest_point']}`, "
                   f"takes {_f(lat['fastest_point_p90_s'])} s: no iso-latency gain (a miss).")
    return out


def _nearest(runs: list[dict[str, Any]], q: float) -> dict[str, Any] | None:
    with_tl = [r for r in runs if r.get("timeline")]
    if not with_tl:
        return None
    target = pct([r["latency_s"] for r in runs], q)
    return min(with_tl, key=lambda r: abs(r["latency_s"] - target))


def _scaling(mode: str, rs: list[dict[str, Any]]) -> str:
    """How the traces of these runs were scaled, for figure titles."""
    if mode != "matched":
        return "traces at their real rates"
    factors = sorted({float(r["factor"]) for r in rs if r.get("factor") is not None})
    if not factors:
        return ""
    if len(factors) == 1:
        return f"traces scaled x{factors[0]:.3g}"
    return f"traces scaled x{factors[0]:.3g}-{factors[-1]:.3g} (per template)"


def _note(mode: str) -> str:
    return "MODELLED: device-profile time, real quality" if mode == "profile" else ""


def _conditions_text(c: dict[str, Any]) -> str:
    rtt = c.get("rtt_ms")
    rtt_s = (f"{rtt:g} ms" if isinstance(rtt, (int, float)) else
             ", ".join(f"{x:g}" for x in rtt) + " ms")
    loss = c.get("loss")
    loss_s = (f"{100 * loss:g}%" if isinstance(loss, (int, float)) else str(loss))
    cpus = c.get("cpus") or {}
    pin = (f"device on CPU(s) {cpus.get('device')}, server and link on {cpus.get('network')}"
           if cpus.get("device") else "not pinned")
    lr = c.get("link_rtt_ms") or {}
    scaled = ""
    if c.get("rtt_scale") == "matched" and lr:
        scaled = (" (time-scaled like the rates, `rtt_scale: matched`: the link carried "
                  + ", ".join(f"{t} {v:.1f} ms" for t, v in sorted(lr.items())) + ")")
    return (f"Link: `{c.get('link')}`, round trip {rtt_s}{scaled}, loss {loss_s}; CPUs: {pin}; "
            f"start points per (template, network) cell: at least "
            f"{c.get('starts_per_cell')} on the headline networks "
            f"({', '.join(f'{n} {k}' for n, k in sorted(c.get('starts_per_cell_by_network', {}).items()))}).")


def _mode_section(mode: str, runs: list[dict[str, Any]], tmpl: dict[str, dict[str, Any]],
                  meta: dict[str, Any], figs: Path, rel: str, head: dict[str, Any]
                  ) -> list[str]:
    md: list[str] = []
    t_of = {t["template"]: t for t in tmpl.values()}
    main = [r for r in runs if is_main(r)]
    points = [r for r in runs if is_point(r)]
    cfg = meta.get("config", {})
    note = _note(mode)
    md.append(f"## Regime: {mode}\n")
    if mode == "matched":
        md.append("Regime-matched replay: real compute on this host, real HTTP through the "
                  f"{runs[0].get('link', 'paced')} link. Per template one factor scales every "
                  f"network's traces so that the FP16 cache at the pooled median of "
                  f"`{cfg.get('regime_network', '5g')}` takes {cfg.get('regime_x', 10):g}x "
                  "the measured masked execution time T; other networks keep their rates "
                  "relative to it. Figure titles name the factor: \"5g\" there means "
                  "Lumos5G traces at that fraction of their rates.\n")
        md.append(_table(["template", "workload", "res", "token mask", "T (s)", "local (s)",
                          "FP16 MB", "factor", "scaled 5G median Mbit/s"],
                         [[t["template"], t["workload"], str(t["resolution"]),
                           f"{100 * t['token_mask_ratio']:.1f}%", _f(t["masked_exec_s"], 3),
                           _f(t["local_s"], 3), _f(t["fp16_bytes"] / 1e6),
                           f"{t['factor']:.4g}", _f(t["scaled_median_mbps"], 1)]
                          for t in t_of.values()]) + "\n")
    else:
        p = cfg.get("profile", {})
        md.append(f"**Device profile `{p.get('name')}` (modelled, not measured):** local "
                  f"{p.get('local_s')} s, masked execution {p.get('masked_s')} s at "
                  f"{100 * float(p.get('masked_ratio', 0.1)):.0f}% of the tokens (on the line "
                  f"from there to the local time at 100%, by the template's token mask "
                  f"ratio), FP16 cache {p.get('fp16_gib')} GiB per "
                  "template (every configuration's real size x the same factor), traces at "
                  "their real rates (factor 1), one request latency of "
                  f"{p.get('request_latency_s')} s before the first body. Latency is "
                  "simulated with the runtime's allocator; quality is measured on the real "
                  "edit with the chosen configurations (see `edge/replay/profile.py`). MB "
                  "moved are the modelled (scaled) bytes. Every figure of this section is "
                  "marked MODELLED.\n")
    md.append(_conditions_text(head["conditions"]) + " Allocation quality of sakura's "
              f"packs: `{head.get('allocation_quality')}` (`psnr_profile`: measured output "
              "PSNR per configuration; `kv_error`: the importance-weighted KV error proxy).\n")
    # headline
    md.append("### Headline (" + ", ".join(head["networks"]) + "; median over workloads)\n")
    rows = []
    for key, t in head["targets"].items():
        if "." in key:
            section, name = key.split(".")
            per = ", ".join(
                f"{w} {_f(v.get(name.split('_vs_')[1].split('_')[0], {}).get('ratio' if section == 'iso_quality' else 'gain_db'))}"
                for w, v in head[section]["per_workload"].items())
        else:
            per = ", ".join(f"{w} {_f(d[key])}" for w, d in head["per_workload"].items())
        verdict = "–" if t["pass"] is None else ("pass" if t["pass"] else "**miss**")
        rows.append([f"`{key}`", _f(t["value"]), t["target"], verdict, per])
    md.append(_table(["ratio", "value", "target", "", "per workload"], rows) + "\n")
    for key, t in head["targets"].items():
        if t["pass"] is not False or key not in TARGETS:
            continue
        md.append(f"**Why `{key}` is missed.**")
        for w, d in head["per_workload"].items():
            ok = (d[key] >= TARGETS[key][1]) if TARGETS[key][0] == ">=" else d[key] > TARGETS[key][1]
            if math.isnan(d[key]) or ok:
                continue
            wr = [r for r in main if r["workload"] == w and r["network"] in head["networks"]]
            md.append(f"- {w}: {_why(key, w, wr, [t_of[x] for x in d['templates'] if x in t_of])}")
            if key.startswith(("p90_", "p50_")):
                run = _nearest([r for r in wr if r["policy"] == "sakura"],
                               90 if key.startswith("p90") else 50)
                if run is not None:
                    name = f"{mode}-timeline-{key}-{w}.png"
                    plot_timeline(expand_timeline(run["timeline"]), figs / name,
                                  f"sakura on {run['template']}, {run['network']} "
                                  f"{run['trace']} @ {run['start_s']:g} s "
                                  f"({_scaling(mode, [run])}): {run['latency_s']:.2f} s",
                                  note=note)
                    md.append(f"  Timeline (receive / reconstruct / execute per shard): "
                              f"![{name}]({rel}/{name})")
        md.append("")
    # iso-quality / iso-latency
    md += _iso_section(mode, main, points, head, figs, rel)
    # per workload x network
    md.append("### Latency, bytes and quality per workload and network\n")
    md.append("Percentiles with 95% percentile-bootstrap intervals (1000 resamples, seeded); "
              "CDFs with a 95% DKW band. With n runs per system, p99 is an interpolation "
              "between the largest samples when n < 100.\n")
    for (w, net), rs in sorted(group(main, "workload", "network").items()):
        name = f"{mode}-latency-{w}-{net}.png"
        fig_latency(rs, f"{w} on {net} ({rs[0]['network_type']}, {_scaling(mode, rs)}; "
                        f"{mode})", figs / name, note=note)
        md.append(f"#### {w} on {net} ({rs[0]['network_type']}, {_scaling(mode, rs)})\n")
        md.append(_policy_table(rs) + "\n")
        md.append(f"![{name}]({rel}/{name})\n")
    # rate-quality
    head_runs = [r for r in main if r["network"] in head["networks"]]
    if head_runs:
        name = f"{mode}-rate-quality.png"
        fig_rate_quality(head_runs, f"bytes vs quality, {', '.join(head['networks'])} "
                                    f"({_scaling(mode, head_runs)})", figs / name, note=note)
        md.append("### Rate-quality (every run on the headline networks)\n")
        md.append(f"![{name}]({rel}/{name})\n")
    # storage
    md.append("### Storage per codec (stored pack bytes, relative to FP16)\n")
    codecs = sorted({c for t in t_of.values() for c in t["storage_bytes"]})
    md.append(_table(["template"] + codecs,
                     [[t["template"]] + [f"{t['storage_bytes'][c] / 1e6:.2f} MB "
                                         f"({t['storage_bytes']['fp16'] / t['storage_bytes'][c]:.2f}x)"
                                         if c in t["storage_bytes"] else "–" for c in codecs]
                      for t in t_of.values()]) + "\n")
    md += _sensitivity(mode, runs, main, t_of, figs, rel, head["networks"])
    md += _ablations(mode, runs, main, figs, rel)
    return md


def _iso_section(mode: str, main: list[dict[str, Any]], points: list[dict[str, Any]],
                 head: dict[str, Any], figs: Path, rel: str) -> list[str]:
    md = ["### Equal quality and equal latency\n"]
    hp = [r for r in points if r["network"] in head["networks"]]
    if not hp:
        md.append("No `sakura-d<m>` operating points in these runs (config `deadlines`): "
                  "sakura's own operating point is the only one, and the views below use it "
                  "alone.\n")
    else:
        ms = sorted({r["policy"] for r in hp})
        md.append("sakura's operating points: `sakura` and " + ", ".join(f"`{p}`" for p in ms)
                  + " (sakura given a deadline of m x T, which becomes its startup "
                  "allowance: wider windows, larger configurations). Iso-quality: the lowest "
                  "p90 of a point whose mean PSNR vs exact is at least the baseline's; "
                  "iso-latency: the best mean PSNR of a point whose p90 is at most the "
                  "baseline's.\n")
    for w, views in head["iso_quality"]["per_workload"].items():
        md.append(f"**{w}**\n")
        full = {b: {"iso_quality": views[b],
                    "iso_latency": head["iso_latency"]["per_workload"][w][b]} for b in views}
        for b, view in full.items():
            md += [f"- {t}" for t in _iso_text(b, view)]
        rs = [r for r in main if r["workload"] == w and r["network"] in head["networks"]]
        wp = [r for r in hp if r["workload"] == w]
        if rs:
            name = f"{mode}-latency-quality-{w}.png"
            fig_latency_quality(rs, wp, f"{w}: latency vs quality, "
                                        f"{', '.join(head['networks'])} "
                                        f"({_scaling(mode, rs)}; {mode})", figs / name,
                                note=_note(mode))
            md.append(f"\n![{name}]({rel}/{name})\n")
    return md


def _sensitivity(mode: str, runs: list[dict[str, Any]], main: list[dict[str, Any]],
                 t_of: dict[str, dict[str, Any]], figs: Path, rel: str,
                 head_nets: list[str]) -> list[str]:
    md = ["### Sensitivity\n", "**Mask ratio** (headline networks, per template, p50 "
          "latency in s and mean PSNR vs exact):\n"]
    hr = [r for r in main if r["network"] in head_nets]
    pols = _order({r["policy"] for r in hr})
    rows, bars = [], {}
    for (tid,), rs in sorted(group(hr, "template").items(),
                             key=lambda kv: t_of.get(kv[0][0], {}).get("token_mask_ratio", 0)):
        m = t_of[tid]["token_mask_ratio"] if tid in t_of else rs[0]["token_mask_ratio"]
        by = {p: summarize([r for r in rs if r["policy"] == p]) for p in pols}
        rows.append([f"{100 * m:.1f}% ({tid})"] + [f"{_f(by[p]['p50'])} / {_fp(by[p]['psnr_exact'])}"
                                                  if by[p]["n"] else "–" for p in pols])
        bars[f"{100 * m:.0f}%"] = {p: by[p]["p50"] for p in pols if by[p]["n"]}
    if rows:
        md.append(_table(["token mask (template)"] + pols, rows) + "\n")
        name = f"{mode}-sensitivity-mask.png"
        fig_bars(bars, "p50 latency (s)", f"p50 latency vs token mask ratio ({mode}; "
                 f"{_scaling(mode, hr)})", figs / name, log=True, note=_note(mode))
        md.append(f"![{name}]({rel}/{name})\n")
    md.append("**Network type** (main templates, p50 / p90 latency in s):\n")
    nets = group(main, "network")
    rows, bars = [], {}
    for (net,), rs in nets.items():
        by = {p: summarize([r for r in rs if r["policy"] == p]) for p in pols}
        rows.append([f"{net} ({rs[0]['network_type']})"] +
                    [f"{_f(by[p]['p50'])} / {_f(by[p]['p90'])}" if by[p]["n"] else "–"
                     for p in pols])
        bars[net] = {p: by[p]["p50"] for p in pols if by[p]["n"]}
    md.append(_table(["network"] + pols, rows) + "\n")
    name = f"{mode}-sensitivity-network.png"
    fig_bars(bars, "p50 latency (s)", f"p50 latency per network ({mode}; "
             f"{_scaling(mode, main)})", figs / name, log=True, note=_note(mode))
    md.append(f"![{name}]({rel}/{name})\n")
    # resolution: base template at its resolution vs its variants, same networks
    variants = [r for r in runs if r["template"] != r["base_template"]]
    if variants:
        md.append("**Resolution** (p50 latency s / mean PSNR vs exact dB, same networks):\n")
        nets_v = {r["network"] for r in variants}
        rows = []
        for (tid,), rs in sorted(group(variants + [r for r in main if r["network"] in nets_v
                                                   and r["template"] in
                                                   {v["base_template"] for v in variants}],
                                        "template").items()):
            res = rs[0]["resolution"]
            by = {p: summarize([r for r in rs if r["policy"] == p]) for p in pols}
            rows.append([f"{tid} ({res} px)"] + [f"{_f(by[p]['p50'])} / "
                                                 f"{_fp(by[p]['psnr_exact'])}"
                                                 if by[p]["n"] else "–" for p in pols])
        md.append(_table(["template"] + pols, rows) + "\n")
    return md


def _ablations(mode: str, runs: list[dict[str, Any]], main: list[dict[str, Any]],
               figs: Path, rel: str) -> list[str]:
    md = ["### Ablations\n"]
    qruns = [r for r in runs if r["policy"].startswith("sakura-q")]
    if qruns:
        nets = {r["network"] for r in qruns}
        tids = {r["template"] for r in qruns}
        pool = qruns + [r for r in main if r["network"] in nets and r["template"] in tids
                        and r["policy"] in ("sakura", "svd")]
        rows = []
        for (p,), rs in sorted(group(pool, "policy").items(), key=lambda kv: kv[1][0]["q"]):
            s = summarize(rs)
            rows.append([f"{rs[0]['q']:g}", p, str(s["n"]), _f(s["p50"]), _f(s["p90"]),
                         _f(s["mb"]), _fp(s["psnr_exact"]), _fp(s["psnr_exact_p10"]),
                         _f(s["ssim_exact"], 3)])
        md.append(f"**Importance exponent q** ({', '.join(sorted(nets))}; q = 0 is `svd`, "
                  "0.5 the default `sakura`):\n")
        md.append(_table(["q", "policy", "runs", "p50 s", "p90 s", "MB", "PSNR exact",
                          "p10", "SSIM exact"], rows) + "\n")
    abl = [r for r in main if r["policy"] in ("sakura", "sakura-fixed-config",
                                               "sakura-fixed-bits")]
    if abl:
        md.append("**No shard adaptation (`sakura-fixed-config`) and fixed bitwidth "
                  "(`sakura-fixed-bits`)**, all main runs:\n")
        md.append(_policy_table(abl) + "\n")
    return md


def load(dir_: str | Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]],
                                    dict[str, Any]]:
    d = Path(dir_)
    if not d.is_dir():
        raise EdgeError(f"{d} is not a replay results folder")
    results = ResultsFile(d)
    if not results.path.exists():
        raise EdgeError(f"{d} has no {results.path.name}: run `sakura replay ... --out {d}`")
    meta = {}
    if (d / META_FILE).exists():
        try:
            meta = json.loads((d / META_FILE).read_text())
        except ValueError:
            meta = {}
    runs = results.runs()
    if not runs:
        raise EdgeError(f"{results.path} holds no finished runs yet")
    return runs, results.templates(), meta


def headlines(runs: list[dict[str, Any]], tmpl: dict[str, dict[str, Any]],
              meta: dict[str, Any]) -> dict[str, Any]:
    """Headline of every mode present; the top level is ``matched`` when present."""
    nets = tuple(meta.get("config", {}).get("headline_networks") or ("5g",))
    modes = sorted({r["mode"] for r in runs}, key=lambda m: (m != "matched", m))
    out: dict[str, Any] = {}
    for mode in modes:
        mr = [r for r in runs if r["mode"] == mode]
        mt = {k: v for k, v in tmpl.items() if v["mode"] == mode}
        h = headline(mr, mt, nets)
        h["mode"] = mode
        h["runs"] = len(mr)
        h["regime"] = ({"mode": "regime-matched",
                        "regime_x": meta.get("config", {}).get("regime_x"),
                        "regime_network": meta.get("config", {}).get("regime_network"),
                        "factors": {v["template"]: v["factor"] for v in mt.values()}}
                       if mode == "matched" else
                       {"mode": "device profile (modelled time)",
                        "profile": meta.get("config", {}).get("profile")})
        out[mode] = h
    top = dict(out[modes[0]])
    top["modes"] = out
    return top


def write_report(dir_: str | Path, json_path: str | Path | None = None,
                 out_dir: str | Path | None = None) -> Path:
    """Write ``report.md`` and ``figures/`` (and the headline JSON); returns the report."""
    runs, tmpl, meta = load(dir_)
    out = Path(out_dir) if out_dir else Path(dir_)
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    heads = headlines(runs, tmpl, meta)
    cfg = meta.get("config", {})
    md = ["# SAKURA replay report\n",
          f"Generated by `sakura report` from `{Path(dir_).name}/runs.jsonl`: {len(runs)} runs "
          f"({sum(r['mode'] == 'matched' for r in runs)} timed, "
          f"{sum(r['mode'] == 'profile' for r in runs)} on the profile's simulated clock) "
          f"on one machine ({(meta.get('host') or {}).get('cpus', '?')} CPUs, load "
          f"average at start {_f((meta.get('host') or {}).get('load1_at_start'))})"
          + _load_text(runs) + "; timed runs were sequential. Networks: "
          + ", ".join(sorted({f"{r['network']} ({r['network_type']})" for r in runs}))
          + f"; {cfg.get('starts', '?')} start points per template and network"
          + (f" ({', '.join(f'{n}: {k}' for n, k in cfg['network_starts'].items())})"
             if cfg.get("network_starts") else "")
          + (" (`--quick`)" if cfg.get("quick") else "") + ". PSNR of identical images is "
          f"infinite: reported as `inf (identical)`; a mean over some identical images counts "
          f"them as {PSNR_CAP:g} dB and says how many.\n"]
    for mode, head in heads["modes"].items():
        mr = [r for r in runs if r["mode"] == mode]
        mt = {k: v for k, v in tmpl.items() if v["mode"] == mode}
        md += _mode_section(mode, mr, mt, meta, figs, "figures", head)
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    if json_path:
        jp = Path(json_path)
        write_atomic(jp, json.dumps(_clean(heads), indent=1, allow_nan=False))
    return path


def _load_text(runs: list[dict[str, Any]]) -> str:
    """The machine's load while the timed runs ran (1-min load average per run)."""
    loads = [r["load1"] for r in runs if r.get("load1") is not None]
    if not loads:
        return ""
    cpus = os.cpu_count() or 1
    busy = float(np.median(loads)) > 0.75 * cpus
    return (f", load average during the timed runs {np.median(loads):.1f} (median; "
            f"{min(loads):.1f}-{max(loads):.1f})" + (
                ": the host was busy, absolute times are inflated" if busy
                else ": the host was otherwise idle"))


def _clean(o: Any) -> Any:
    """JSON-safe: NaN (a ratio with a policy missing) -> null."""
    if isinstance(o, float):
        return None if math.isnan(o) or math.isinf(o) else o
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o
