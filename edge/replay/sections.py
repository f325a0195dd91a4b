"""The Markdown of the replay report: the introduction, and per regime mode its headline
table, the reasons for each missed target, the equal-quality / equal-latency views, the
headline per network family (intervals over start points, the latency CDFs per network), the
per-workload tables, rate-quality, storage, sensitivity and ablations.

Every sentence generated here picks its wording from the numbers it cites (:func:`_why`,
:func:`_iso_text`); ``tests/edge/test_replay.py`` feeds contradicting data and checks the
wording follows. Cells: latency percentiles with their 95% bootstrap interval, PSNR of
identical images as ``inf (identical)`` (``sakura.edge.replay.stats``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from sakura.edge.replay.figures import (
    fig_bars,
    fig_latency,
    fig_latency_quality,
    fig_network_cdfs,
    fig_rate_quality,
)
from sakura.edge.replay.headline import TARGETS
from sakura.edge.replay.results import expand_timeline
from sakura.edge.replay.stats import (
    PSNR_CAP,
    group,
    is_main,
    is_point,
    mean,
    pct,
    policy_order,
    summarize,
)
from sakura.edge.timeline import plot_timeline

# Record times (``time``, Unix seconds) that date the q ablation's records: from
# Q_PER_SHARD_SINCE (97d9cdd) a build with the model chose q per shard, though records kept
# saying the codec's q (0.5) until 2026-12-07; from Q_PINNED_SINCE (cd93895) the replay's
# ``sakura-q*`` packs are pinned at their q (before, they chose per shard too: void rows).
Q_PER_SHARD_SINCE = 1796525221.0  # 2026-12-06 02:47 UTC
Q_PINNED_SINCE = 1796664105.0  # 2026-12-07 17:21 UTC


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
    for p in policy_order({r["policy"] for r in runs}):
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
                         f"{_f(s.get('stall_s'))} s")
                if s.get("mb", math.inf) < o.get("mb", -math.inf):
                    text += (f"; the lead is what sakura's smaller transfers "
                             f"({_f(s.get('mb'))} vs {_f(o.get('mb'))} MB) save.")
                else:  # (more bytes, fewer stalls: the lead is the deadline rules', not size)
                    text += (f", though sakura moves as many bytes or more ({_f(s.get('mb'))} "
                             f"vs {_f(o.get('mb'))} MB): the lead is in the stalls, not "
                             "the transfer size.")
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


def mode_section(mode: str, runs: list[dict[str, Any]], tmpl: dict[str, dict[str, Any]],
                 meta: dict[str, Any], figs: Path, rel: str, head: dict[str, Any]
                 ) -> list[str]:
    """The report's section of one regime mode (``matched`` or ``profile``)."""
    t_of = {t["template"]: t for t in tmpl.values()}
    main = [r for r in runs if is_main(r)]
    points = [r for r in runs if is_point(r)]
    md = [f"## Regime: {mode}\n"]
    md += _regime_text(mode, runs, t_of, meta.get("config", {}))
    md.append(_conditions_text(head["conditions"]) + " Allocation quality of sakura's "
              f"packs: `{head.get('allocation_quality')}` (`psnr_profile`: measured output "
              "PSNR per configuration; `kv_error`: the importance-weighted KV error proxy).\n")
    md += _headline_section(mode, main, t_of, head, figs, rel)
    md += _iso_section(mode, main, points, head, figs, rel)
    md += _networks_section(mode, main, head, figs, rel)
    md += _cells_section(mode, main, figs, rel)
    md += _rate_quality_section(mode, main, head["headline_networks"], figs, rel)
    md += _storage_section(t_of)
    md += _sensitivity(mode, runs, main, t_of, figs, rel, head["headline_networks"])
    md += _ablations(mode, runs, main, figs, rel)
    return md


def _regime_text(mode: str, runs: list[dict[str, Any]], t_of: dict[str, dict[str, Any]],
                 cfg: dict[str, Any]) -> list[str]:
    """How time was obtained: the regime-matched scaling per template, or the device
    profile (modelled)."""
    if mode == "matched":
        return ["Regime-matched replay: real compute on this host, real HTTP through the "
                f"{runs[0].get('link', 'paced')} link. Per template one factor scales every "
                f"network's traces so that the FP16 cache at the pooled median of "
                f"`{cfg.get('regime_network', '5g')}` takes {cfg.get('regime_x', 10):g}x "
                "the measured masked execution time T; other networks keep their rates "
                "relative to it. Figure titles name the factor: \"5g\" there means "
                "Lumos5G traces at that fraction of their rates.\n",
                _table(["template", "workload", "res", "token mask", "T (s)", "local (s)",
                        "FP16 MB", "factor", "scaled 5G median Mbit/s"],
                       [[t["template"], t["workload"], str(t["resolution"]),
                         f"{100 * t['token_mask_ratio']:.1f}%", _f(t["masked_exec_s"], 3),
                         _f(t["local_s"], 3), _f(t["fp16_bytes"] / 1e6),
                         f"{t['factor']:.4g}", _f(t["scaled_median_mbps"], 1)]
                        for t in t_of.values()]) + "\n"]
    p = cfg.get("profile", {})
    return [f"**Device profile `{p.get('name')}` (modelled, not measured):** local "
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
            "marked MODELLED.\n"]


def _headline_section(mode: str, main: list[dict[str, Any]], t_of: dict[str, dict[str, Any]],
                      head: dict[str, Any], figs: Path, rel: str) -> list[str]:
    """The headline table (value, target, verdict, per workload), then why each missed
    target is missed, per workload, with a timeline of the run nearest the percentile."""
    md = ["### Headline (" + ", ".join(head["headline_networks"]) + "; median over workloads)\n"]
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
            wr = [r for r in main if r["workload"] == w and r["network"] in head["headline_networks"]]
            md.append(f"- {w}: {_why(key, w, wr, [t_of[x] for x in d['templates'] if x in t_of])}")
            if key.startswith(("p90_", "p50_")):
                md += _miss_timeline(mode, key, w, wr, figs, rel)
        md.append("")
    return md


def _miss_timeline(mode: str, key: str, w: str, wr: list[dict[str, Any]], figs: Path,
                   rel: str) -> list[str]:
    """The timeline figure of sakura's run nearest the missed percentile (none without a
    recorded timeline)."""
    run = _nearest([r for r in wr if r["policy"] == "sakura"],
                   90 if key.startswith("p90") else 50)
    if run is None:
        return []
    name = f"{mode}-timeline-{key}-{w}.png"
    plot_timeline(expand_timeline(run["timeline"]), figs / name,
                  f"sakura on {run['template']}, {run['network']} "
                  f"{run['trace']} @ {run['start_s']:g} s "
                  f"({_scaling(mode, [run])}): {run['latency_s']:.2f} s",
                  note=_note(mode))
    return [f"  Timeline (receive / reconstruct / execute per shard): "
            f"![{name}]({rel}/{name})"]


def _networks_section(mode: str, main: list[dict[str, Any]], head: dict[str, Any],
                      figs: Path, rel: str) -> list[str]:
    """The headline per network family (the JSON's ``networks``): ratios with their 95%
    intervals over start points, what each name holds, and one CDF panel per network."""
    nets = head.get("networks") or {}
    if not nets:
        return []
    md = ["### Per network\n",
          "Each network family alone (median over workloads of the per-workload ratio; in "
          "brackets a 95% percentile bootstrap over start points, each start keeping every "
          "policy's run at it). `files`: the trace files the name holds.\n"]
    rows = []
    for net, e in nets.items():
        files = (e.get("files") or {}).get("count")
        if not e.get("replayed"):
            rows.append([net, "not replayed", "–", "–", "–", "–", "–", "–",
                         "?" if files is None else str(files)])
            continue
        ci = e.get("ci95") or {}
        cells = [_fci(e.get(k), tuple(ci[k]) if ci.get(k) else (math.nan, math.nan))
                 for k in ("p90_speedup_vs_cachegen", "p90_speedup_vs_intq",
                           "p50_speedup_vs_local")]
        iso = (e.get("iso_quality") or {}).get("latency_ratio_vs_cachegen_p90")
        rows.append([net, str(e.get("runs")), str(e.get("starts_per_cell")), *cells, _f(iso),
                     _f(e.get("psnr_gain_db_vs_cachegen"), 1),
                     "?" if files is None else str(files)])
    md.append(_table(["network", "runs", "starts per cell", "p90 vs CacheGen",
                      "p90 vs INTQ", "p50 vs local", "iso-quality p90 vs CacheGen",
                      "PSNR gain vs CacheGen (dB)", "files"], rows) + "\n")
    name = f"{mode}-latency-by-network.png"
    fig_network_cdfs(main, nets, f"latency CDF per network ({mode}; all workloads pooled)",
                     figs / name, note=_note(mode))
    md.append(f"![{name}]({rel}/{name})\n")
    return md


def _cells_section(mode: str, main: list[dict[str, Any]], figs: Path, rel: str) -> list[str]:
    """Per workload and network: the policy table and the latency figure."""
    md = ["### Latency, bytes and quality per workload and network\n",
          "Percentiles with 95% percentile-bootstrap intervals (1000 resamples, seeded); "
          "CDFs with a 95% DKW band. With n runs per system, p99 is an interpolation "
          "between the largest samples when n < 100.\n"]
    for (w, net), rs in sorted(group(main, "workload", "network").items()):
        name = f"{mode}-latency-{w}-{net}.png"
        fig_latency(rs, f"{w} on {net} ({rs[0]['network_type']}, {_scaling(mode, rs)}; "
                        f"{mode})", figs / name, note=_note(mode))
        md.append(f"#### {w} on {net} ({rs[0]['network_type']}, {_scaling(mode, rs)})\n")
        md.append(_policy_table(rs) + "\n")
        md.append(f"![{name}]({rel}/{name})\n")
    return md


def _rate_quality_section(mode: str, main: list[dict[str, Any]], networks: list[str],
                          figs: Path, rel: str) -> list[str]:
    """Bytes vs quality of every run on the headline networks (nothing when none)."""
    head_runs = [r for r in main if r["network"] in networks]
    if not head_runs:
        return []
    name = f"{mode}-rate-quality.png"
    fig_rate_quality(head_runs, f"bytes vs quality, {', '.join(networks)} "
                                f"({_scaling(mode, head_runs)})", figs / name, note=_note(mode))
    return ["### Rate-quality (every run on the headline networks)\n",
            f"![{name}]({rel}/{name})\n"]


def _storage_section(t_of: dict[str, dict[str, Any]]) -> list[str]:
    """Stored pack bytes per template and codec, and each one's ratio to FP16."""
    codecs = sorted({c for t in t_of.values() for c in t["storage_bytes"]})
    return ["### Storage per codec (stored pack bytes, relative to FP16)\n",
            _table(["template"] + codecs,
                   [[t["template"]] + [f"{t['storage_bytes'][c] / 1e6:.2f} MB "
                                       f"({t['storage_bytes']['fp16'] / t['storage_bytes'][c]:.2f}x)"
                                       if c in t["storage_bytes"] else "–" for c in codecs]
                    for t in t_of.values()]) + "\n"]


def intro(name: str, runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The report's first paragraph: the runs, the machine and its load, the networks and
    start points, and how identical images are counted."""
    cfg = meta.get("config", {})
    return (f"Generated by `sakura report` from `{name}/runs.jsonl`: {len(runs)} runs "
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
            f"infinite: reported as `inf (identical)`; a mean over some identical images "
            f"counts them as {PSNR_CAP:g} dB and says how many.\n")


def _iso_section(mode: str, main: list[dict[str, Any]], points: list[dict[str, Any]],
                 head: dict[str, Any], figs: Path, rel: str) -> list[str]:
    md = ["### Equal quality and equal latency\n"]
    hp = [r for r in points if r["network"] in head["headline_networks"]]
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
        rs = [r for r in main if r["workload"] == w and r["network"] in head["headline_networks"]]
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
    pols = policy_order({r["policy"] for r in hr})
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
        def per_shard(rs: list[dict[str, Any]]) -> bool:
            return rs[0]["q"] is None or (rs[0]["policy"] == "sakura" and all(
                r.get("time", 0.0) >= Q_PER_SHARD_SINCE for r in rs))

        def q_of(rs: list[dict[str, Any]]) -> str:
            return "per shard" if per_shard(rs) else f"{rs[0]['q']:g}"

        for (p,), rs in sorted(group(pool, "policy").items(),
                               key=lambda kv: (per_shard(kv[1]), kv[1][0]["q"] or 0.0)):
            s = summarize(rs)
            rows.append([q_of(rs), p, str(s["n"]), _f(s["p50"]), _f(s["p90"]),
                         _f(s["mb"]), _fp(s["psnr_exact"]), _fp(s["psnr_exact_p10"]),
                         _f(s["ssim_exact"], 3)])
        old = any(r.get("time", 0.0) < Q_PINNED_SINCE for r in qruns)
        md.append(f"**Importance exponent q** ({', '.join(sorted(nets))}; q = 0 is `svd`; "
                  + ("some `sakura-q*` records predate pinned packs (2026-12-07): where "
                     "their packs were built from 2026-12-06 on, they chose q per shard "
                     "and those rows measured the default codec" if old else
                     "the default `sakura` chooses q per shard among 0, 0.25, 0.5 and 1 "
                     "(its records before 2026-12-07 say 0.5); the `sakura-q*` packs are "
                     "pinned at their q") + "):\n")
        md.append(_table(["q", "policy", "runs", "p50 s", "p90 s", "MB", "PSNR exact",
                          "p10", "SSIM exact"], rows) + "\n")
    abl = [r for r in main if r["policy"] in ("sakura", "sakura-fixed-config",
                                               "sakura-fixed-bits")]
    if abl:
        md.append("**No shard adaptation (`sakura-fixed-config`) and fixed bitwidth "
                  "(`sakura-fixed-bits`)**, all main runs:\n")
        md.append(_policy_table(abl) + "\n")
    return md


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
