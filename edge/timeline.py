"""The per-shard timeline of an edit: JSON file and plot of the three pipeline stages.

The plot has one row per shard (execution order top to bottom) with three bars: receive
(request sent to last byte), reconstruct (decode) and execute (the DiT blocks of the
shard); a stall (execution waiting for the shard) is drawn in red just before its execute
bar. The x axis is seconds since the edit started. The legend sits under the axes, so it
never covers the last shards; ``note`` (e.g. "MODELLED: device profile") is printed in
the figure, top left.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STAGES = (("recv_start", "recv_end", "receive", "#4C72B0", -0.27),
          ("recon_start", "recon_end", "reconstruct", "#DD8452", 0.0),
          ("exec_start", "exec_end", "execute", "#55A868", 0.27))


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
                  note: str = "") -> Path:
    """Draw the three stages of every shard; returns the written PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = max(1, len(timeline))
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.18 * n + 2.0)))
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
    handles = [Patch(color=c, label=label) for _, _, label, c, _ in STAGES]
    handles.append(Patch(color="#C44E52", alpha=0.6, label="stall"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4,
              fontsize=8, frameon=False)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel("seconds since the edit started")
    ax.set_ylabel("shard (execution order)")
    if title:
        ax.set_title(title, fontsize=10)
    if note:
        fig.text(0.01, 0.99, note, ha="left", va="top", fontsize=8, color="#C44E52",
                 weight="bold")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.97) if note else (0, 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
