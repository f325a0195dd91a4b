"""The replay report's figures (PNG, matplotlib on the Agg backend, imported when drawn).

Latency CDFs per policy with ``n`` and a 95% Dvoretzky-Kiefer-Wolfowitz band (per cell, and
one panel per network family with its run and start counts), percentile bars with their 95%
bootstrap intervals, bytes vs quality, latency vs quality with sakura's
operating-point curve, grouped bars; a figure from modelled time carries its provenance
(MODELLED) in the image.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from sakura.edge.replay.results import number
from sakura.edge.replay.stats import (
    PSNR_CAP,
    boot_ci,
    dkw_eps,
    group,
    pct,
    policy_order,
    psnr_mean,
    psnr_value,
)

COLORS = {"sakura": "#C44E52", "svd": "#DD8452", "intq": "#4C72B0", "cachegen": "#8172B3",
          "fp16": "#937860", "local": "#55A868", "sakura-fixed-config": "#DA8BC3",
          "sakura-fixed-bits": "#8C8C8C"}


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


def _save(plt: Any, fig: Any, path: Path, note: str, top: float = 0.96) -> Path:
    """Mark, lay out (the top ``1 - top`` left to the title), write and close a figure."""
    _mark(fig, note)
    fig.tight_layout(rect=(0, 0, 1, top))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cdf(ax: Any, latencies: list[float], label: str, color: Any) -> tuple[np.ndarray, np.ndarray]:
    """One empirical latency CDF (a step per run), labelled with its ``n``."""
    lat = np.sort(latencies)
    y = np.arange(1, len(lat) + 1) / len(lat)
    ax.step(lat, y, where="post", label=f"{label} (n={len(lat)})", color=color)
    return lat, y


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
    pols = policy_order(p for (p,) in by)
    for p in pols:
        lat, y = _cdf(a, [r["latency_s"] for r in by[(p,)]], p, COLORS.get(p))
        eps = dkw_eps(len(lat))
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
    return _save(plt, fig, path, note, top=0.95)


def fig_network_cdfs(runs: list[dict[str, Any]], networks: dict[str, dict[str, Any]],
                     title: str, path: Path, note: str = "") -> Path:
    """One latency-CDF panel per network family of ``networks`` (``by_network``'s entries,
    in their order): every policy's runs on that network, all workloads pooled, each curve
    with its ``n``; the panel's title gives the start points per cell, and a network that
    was not replayed gets an empty panel saying so and how many trace files it holds."""
    plt = _plt()
    names = list(networks)
    cols = min(3, len(names)) or 1
    rows = -(-len(names) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.4 * rows), squeeze=False)
    for ax, net in zip(axes.flat, names):
        entry = networks[net]
        rs = [r for r in runs if r.get("network") == net]
        if not rs:
            count = (entry.get("files") or {}).get("count")
            ax.text(0.5, 0.5, f"not replayed\n({count if count is not None else '?'} trace "
                              "files)", ha="center", va="center", transform=ax.transAxes,
                    fontsize=9, color="#666")
            ax.set_title(net, fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        by = group(rs, "policy")
        for pol in policy_order(q for (q,) in by):
            _cdf(ax, [r["latency_s"] for r in by[(pol,)]], pol, COLORS.get(pol))
        _log_x(ax)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
        ax.set_xlabel("end-to-end latency (s, log)", fontsize=8)
        ax.set_ylabel("fraction of runs", fontsize=8)
        ax.set_title(f"{net} ({rs[0].get('network_type', '?')}): {len(rs)} main runs, "
                     f"{entry.get('starts_per_cell', '?')} starts per cell", fontsize=9)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path, note, top=0.95)


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
    return _save(plt, fig, path, note)


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
    return _save(plt, fig, path, note)


def fig_bars(rows: dict[str, dict[str, float]], ylabel: str, title: str, path: Path,
             log: bool = False, note: str = "") -> Path:
    """Grouped bars: rows (x groups) x series (policies)."""
    plt = _plt()
    groups = list(rows)
    series = policy_order({s for r in rows.values() for s in r})
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
    return _save(plt, fig, path, note)

