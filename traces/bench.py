"""``sakura bench link``: measured accuracy of both link emulators on real traces.

For each trace a reproducible piece is chosen (seeded start points, first one whose peak
rate is at most ``max_mbps``; otherwise the piece is scaled down to that peak and the factor
is reported). A TCP flow is blasted through the paced link and, where root and network
namespaces are available, through kernel shaping; received bytes per window are compared
with the trace's integral. ``paced_rel_error`` / ``kernel_rel_error`` are the largest
per-window relative errors over all traces (``None`` when an emulator could not run).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sakura.traces.catalog import TRACE_SETS, find_trace_files, require_trace_dir
from sakura.traces.errors import LinkError, TraceError
from sakura.traces.formats import load_trace
from sakura.traces.measure import Measurement, measure_kernel, measure_paced
from sakura.traces.model import Trace
from sakura.traces.netns import kernel_shaping_unavailable_reason

#: One representative file per family when the benchmark is pointed at the trace folder.
DEFAULT_PICKS = ("lte", "5g-driving", "ucc5g", "wifi", "mahimahi")


@dataclass(frozen=True)
class Piece:
    """The part of a trace a benchmark runs over."""

    trace: Trace
    source: str
    start_s: float
    scale: float


def choose_piece(
    trace: Trace, span_s: float, *, max_mbps: float = 200.0, seed: int = 0, tries: int = 50
) -> Piece:
    """A seeded start whose next ``span_s`` seconds peak at <= ``max_mbps`` and carry data."""
    starts = trace.sample_starts(tries, seed=seed, span_s=span_s)
    best: tuple[float, float] | None = None
    for s in starts:
        piece = trace.slice(float(s), span_s)
        peak = float(piece.rates_bps.max()) / 1e6
        if piece.total_bits <= 0:
            continue
        if peak <= max_mbps:
            return Piece(piece, trace.name, float(s), 1.0)
        if best is None or peak < best[1]:
            best = (float(s), peak)
    if best is None:
        raise TraceError(f"trace {trace.name!r} has no capacity in any sampled piece")
    factor = max_mbps / best[1]
    return Piece(trace.slice(best[0], span_s).scaled(factor), trace.name, best[0], factor)


def default_bench_files(root: Path, picks: Sequence[str] = DEFAULT_PICKS) -> list[Path]:
    """First file (sorted) of each picked family under ``root``."""
    files = []
    for name in picks:
        matches = sorted(root.glob(TRACE_SETS[name]))
        if matches:
            files.append(matches[0])
    return files


def _summary(ms: list[Measurement]) -> dict[str, float | None]:
    errs = [m.max_rel_error for m in ms if m.max_rel_error is not None]
    means = [m.mean_rel_error for m in ms if m.mean_rel_error is not None]
    return {
        "max": max(errs) if errs else None,
        "mean": float(np.mean(means)) if means else None,
        "outage_bytes": sum(m.outage_bytes for m in ms),
    }


def run_link_bench(
    paths: Sequence[str | os.PathLike[str]] = (),
    *,
    quick: bool = False,
    window_s: float = 2.0,
    seed: int = 0,
    max_mbps: float = 200.0,
    kernel: bool = True,
) -> dict[str, object]:
    """Measure both emulators on the given trace files/folders (default: the trace folder)."""
    n_windows = 1 if quick else 3
    files: list[Path] = []
    for p in paths or [require_trace_dir()]:
        path = Path(p)
        if path.is_dir() and any(path.glob(TRACE_SETS["lte"])):
            files.extend(default_bench_files(path, DEFAULT_PICKS[:3] if quick else DEFAULT_PICKS))
        else:
            files.extend(find_trace_files([path]))
    if not files:
        raise TraceError("no trace files to benchmark")
    if quick:
        files = files[:3]
    reason = kernel_shaping_unavailable_reason() if kernel else "disabled (--no-kernel)"
    span = 0.5 + window_s * n_windows + 0.5
    per_trace = []
    paced: list[Measurement] = []
    kern: list[Measurement] = []
    for i, f in enumerate(files):
        piece = choose_piece(load_trace(f), span, max_mbps=max_mbps, seed=seed + i)
        entry: dict[str, object] = {
            "file": str(f),
            "trace": piece.source,
            "start_s": piece.start_s,
            "scale": piece.scale,
            "mean_mbps": piece.trace.mean_bps / 1e6,
        }
        m = measure_paced(piece.trace, 0.0, window_s=window_s, n_windows=n_windows)
        paced.append(m)
        entry["paced"] = m.to_dict()
        if reason is None:
            try:
                k = measure_kernel(piece.trace, 0.0, window_s=window_s, n_windows=n_windows)
            except LinkError as exc:
                entry["kernel"] = {"error": str(exc)}
            else:
                kern.append(k)
                entry["kernel"] = k.to_dict()
        per_trace.append(entry)
    ps, ks = _summary(paced), _summary(kern)
    return {
        "window_s": window_s,
        "windows_per_trace": n_windows,
        "max_mbps": max_mbps,
        "seed": seed,
        "paced_rel_error": ps["max"],
        "paced_mean_rel_error": ps["mean"],
        "paced_outage_bytes": ps["outage_bytes"],
        "kernel_rel_error": ks["max"],
        "kernel_mean_rel_error": ks["mean"],
        "kernel_outage_bytes": ks["outage_bytes"] if kern else None,
        "kernel_skipped": reason,
        "traces": per_trace,
    }
