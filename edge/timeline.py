"""The per-shard timeline of an edit: JSON file and plot of the three pipeline stages.

The plot's x axis is seconds since the edit started, from 0. Above the shards, one row
shows the set-up phases as recorded (``phases``: the manifest request, planning, the
startup allowance; :func:`setup_phases`). Then one row per shard (execution order top to
bottom) with three bars: receive (request sent to last byte), reconstruct (decode) and
execute (the DiT blocks of the shard); a stall (execution waiting for the shard) is drawn
in red just before its execute bar, and the configuration the shard ran at (rank and bits,
as its manifest entry names them) is written at the end of its row. A panel above the
shards plots the rate estimate each shard's request was planned with. A dashed line and
the title give the total latency. The legend sits under the axes, so it never covers the
last shards; ``note`` (e.g. "MODELLED: device profile") is printed in the figure, top left.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STAGES = (("recv_start", "recv_end", "receive", "#4C72B0", -0.27),
          ("recon_start", "recon_end", "reconstruct", "#DD8452", 0.0),
          ("exec_start", "exec_end", "execute", "#55A868", 0.27))
PHASE_COLORS = {"open": "#BBBBBB", "manifest": "#8172B3", "plan": "#937860",
                "startup allowance": "#CCB974"}


def setup_phases(origin: float, manifest: Any, loop_start: list[float], first_byte_s: float,
                 allowance_s: float, latency_s: float | None = None) -> list[dict[str, Any]]:
    """The set-up of a streamed edit, in seconds from its start (``origin``, monotonic):
    ``open`` (client set-up before the manifest request), ``manifest`` (its request, sent
    to last byte; ``cached``: a 304 revalidated the device's copy), ``plan`` (manifest
    parsed, allocator and backend ready, until the shard loop starts: ``loop_start``, empty
    when it never did) and ``startup allowance`` (from one request latency after the loop
    starts: execution may start up to this late, so the first shards fit better
    configurations). The allowance is a permission, placed from the manifest's request
    latency: an edit whose shard 0 came sooner can end before it does, so with
    ``latency_s`` it is cut at the edit's end (and left out if it begins after it)."""

    def rel(t: float) -> float:
        return round(max(0.0, t - origin), 6)

    out: list[dict[str, Any]] = []
    if rel(manifest.start) > 0:
        out.append({"phase": "open", "start": 0.0, "end": rel(manifest.start)})
    out.append({"phase": "manifest", "start": rel(manifest.start), "end": rel(manifest.end),
                "cached": bool(manifest.cached)})
    if loop_start:
        out.append({"phase": "plan", "start": rel(manifest.end), "end": rel(loop_start[0])})
        if allowance_s > 0:
            begin = rel(loop_start[0]) + max(0.0, first_byte_s)
            end = begin + allowance_s
            if latency_s is not None:
                end = min(end, latency_s)
            if end > begin:
                out.append({"phase": "startup allowance", "start": round(begin, 6),
                            "end": round(end, 6)})
    return out


def config_label(row: dict[str, Any]) -> str:
    """What a shard ran at, for the plot: ``r16 8b`` (rank, bits), ``4b``, or the
    configuration id; ``truncated`` / ``fallback`` when it was not what it asked for;
    ``local`` when its step was computed on the device (local fallback), ``stale (step
    k)`` when it ran on its group's K/V of step k without its bytes (stale reuse, the stale
    plan)."""
    if row.get("local"):
        return "local"
    if row.get("stale_from") is not None and not row.get("bytes"):
        return f"stale (step {row['stale_from']})"
    params = row.get("params") or {}
    if "rank" in params and "bits" in params:
        text = f"r{params['rank']} {params['bits']}b"
    elif "bits" in params:
        text = f"{params['bits']}b"
    elif params:
        text = ",".join(f"{k}{v}" for k, v in params.items() if not isinstance(v, list))
    elif row.get("config") is not None:
        text = f"config {row['config']}"
    else:
        return ""
    if row.get("truncated"):
        text += " (truncated)"
    elif row.get("requested") is not None and row.get("requested") != row.get("config"):
        text += " (fallback)"
    return text


def write_json(path: str | Path, document: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, default=_default))
    return path


def _default(o: Any) -> Any:
    if isinstance(o, float):
        return str(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def plot_timeline(timeline: list[dict[str, Any]], path: str | Path, title: str = "",
                  note: str = "", phases: list[dict[str, Any]] | None = None,
                  latency_s: float | None = None) -> Path:
    """Draw the set-up phases, the three stages of every shard, its configuration and the
    rate estimate into a PNG (:func:`timeline_figure`); returns its path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = timeline_figure(timeline, title, note, phases, latency_s)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_figure(timeline: list[dict[str, Any]], title: str = "", note: str = "",
                    phases: list[dict[str, Any]] | None = None,
                    latency_s: float | None = None) -> Any:
    """The matplotlib figure of :func:`plot_timeline`. ``latency_s`` (default: the last
    bar's end) is the total latency the title states and the dashed line marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    phases = list(phases or [])
    ends = [row[k] for row in timeline for k in ("recv_end", "recon_end", "exec_end")
            if row.get(k) is not None] + [p["end"] for p in phases]
    total = float(latency_s) if latency_s is not None else max(ends, default=0.0)
    rates = [(row.get("recv_start"), row.get("rate_bps")) for row in timeline]
    rates = [(t, r / 1e6) for t, r in rates if t is not None and r]
    n = max(1, len(timeline))
    setup_row = -1.2 if phases else None
    height = max(3.2, 0.2 * n + 2.6) + (1.3 if rates else 0.0)
    if rates:
        fig, (ax_rate, ax) = plt.subplots(
            2, 1, figsize=(10, height), sharex=True,
            gridspec_kw={"height_ratios": [1.3, max(2.0, 0.2 * n + 1.0)]})
    else:
        fig, ax = plt.subplots(figsize=(10, height))
        ax_rate = None
    for p in phases:
        color = PHASE_COLORS.get(p["phase"], "#BBBBBB")
        width = max(p["end"] - p["start"], 1e-4)
        hatch = "//" if p["phase"] == "startup allowance" else None
        ax.barh(setup_row, width, left=p["start"], height=0.5, color=color,
                alpha=0.55 if hatch else 0.9, hatch=hatch, edgecolor="#666666" if hatch
                else color, linewidth=0.5)
    for row in timeline:
        y = row["shard"]
        for start, end, _label, color, dy in STAGES:
            t0, t1 = row.get(start), row.get(end)
            if t0 is None or t1 is None:
                continue
            ax.barh(y + dy, max(t1 - t0, 1e-4), left=t0, height=0.26, color=color)
        stall = row.get("stall_s") or 0.0
        if stall > 0 and row.get("exec_start") is not None and row["shard"] > 0:
            ax.barh(y + 0.27, stall, left=row["exec_start"] - stall, height=0.26,
                    color="#C44E52", alpha=0.6)
        label = config_label(row)
        row_end = max((row[k] for k in ("recv_end", "recon_end", "exec_end")
                       if row.get(k) is not None), default=None)
        if label and row_end is not None:
            ax.text(row_end + 0.006 * max(total, 1e-3), y, label, va="center", fontsize=7,
                    color="#333333")
    ax.axvline(total, color="#333333", linestyle="--", linewidth=0.8)
    handles = [Patch(color=c, label=label) for _, _, label, c, _ in STAGES]
    handles.append(Patch(color="#C44E52", alpha=0.6, label="stall"))
    for name in dict.fromkeys(p["phase"] for p in phases):
        label = name + (" (304)" if name == "manifest" and any(
            p.get("cached") for p in phases if p["phase"] == name) else "")
        handles.append(Patch(facecolor=PHASE_COLORS.get(name, "#BBBBBB"),
                             hatch="//" if name == "startup allowance" else None,
                             alpha=0.55 if name == "startup allowance" else 0.9,
                             label=label))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1 if n > 10
                                                                     else -0.16),
              ncol=4, fontsize=8, frameon=False)
    top = setup_row - 0.6 if setup_row is not None else -0.5
    ax.set_ylim(n - 0.5, top)
    ticks = list(range(0, n, max(1, n // 20)))
    ax.set_yticks(([setup_row] if setup_row is not None else []) + ticks)
    ax.set_yticklabels((["set-up"] if setup_row is not None else []) + [str(t) for t in ticks])
    ax.set_xlim(0.0, total * 1.12 if total > 0 else 1.0)
    ax.set_xlabel("seconds since the edit started")
    ax.set_ylabel("shard (execution order)")
    ax.grid(axis="x", alpha=0.3)
    headline = f"total latency {total:.3f} s"
    if ax_rate is not None:
        xs = [t for t, _ in rates]
        ys = [r for _, r in rates]
        ax_rate.step(xs + [total], ys + [ys[-1]], where="post", color="#4C72B0", linewidth=1)
        ax_rate.plot(xs, ys, "o", color="#4C72B0", markersize=2.5)
        ax_rate.set_ylabel("rate estimate\n(Mbit/s)", fontsize=8)
        ax_rate.set_ylim(0, max(ys) * 1.2)
        ax_rate.grid(alpha=0.3)
        ax_rate.axvline(total, color="#333333", linestyle="--", linewidth=0.8)
        ax_rate.text(total, max(ys) * 1.1, f" done {total:.3f} s", fontsize=8, va="center")
        ax_rate.set_title(f"{title}\n{headline}" if title else headline, fontsize=10)
    else:
        ax.set_title(f"{title}\n{headline}" if title else headline, fontsize=10)
    if note:
        fig.text(0.01, 0.99, note, ha="left", va="top", fontsize=8, color="#C44E52",
                 weight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.97) if note else (0, 0, 1, 1))
    return fig
