"""Named networks of real traces and their seeded start points.

A network is a set of real trace files under the trace folder (``traces.trace_set``), or
``mixed``: alternating 20-s pieces of Lumos5G 4G and 5G traces (``traces.mixed_trace``,
one seeded mix per start point). A start point is (trace, offset): drawn with a seeded
generator, the same for every policy, so systems are compared on identical network
conditions. Trace files are read from the shared folder, never copied.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from sakura.traces import Trace, load_trace, mixed_trace, trace_set
from sakura.traces.errors import TraceError

#: network name -> (trace set, network type shown in the report); ``mixed`` is built
NETWORKS: dict[str, tuple[str | None, str]] = {
    "5g": ("5g", "5G"),
    "5g-walking": ("5g-walking", "5G"),
    "5g-driving": ("5g-driving", "5G"),
    "ucc5g": ("ucc5g", "5G"),
    "lte": ("lte", "LTE"),
    "mixed": (None, "mixed 4G+5G"),
    "wifi": ("wifi", "Wi-Fi"),
    "wifi-cellular": ("wifi-cellular", "cellular"),
    "mahimahi": ("mahimahi", "LTE"),
}
MIXED_SEGMENT_S = 20.0
MIXED_SEGMENTS = 6


@dataclass(frozen=True)
class StartPoint:
    """One start point of one network: which trace and where in it (seconds)."""

    network: str
    index: int
    trace: str    # trace file name, or mixed-<seed>
    start_s: float


def network_type(name: str) -> str:
    return NETWORKS[name][1]


@lru_cache(maxsize=64)
def _load(path: str) -> Trace:
    return load_trace(path)


def network_files(name: str, root: str | None = None) -> list[Path]:
    """The real trace files of a named network (``mixed``: the 4G and 5G sets)."""
    if name not in NETWORKS:
        raise TraceError(f"unknown network {name!r}; known: {', '.join(NETWORKS)}")
    tset = NETWORKS[name][0]
    if tset is None:
        return trace_set("lte", root) + trace_set("5g", root)
    return trace_set(tset, root)


def _mixed(seed: int, root: str | None) -> Trace:
    lte = [_load(str(p)) for p in trace_set("lte", root)]
    nr = [_load(str(p)) for p in trace_set("5g", root)]
    return mixed_trace(lte, nr, segments=MIXED_SEGMENTS, segment_s=MIXED_SEGMENT_S,
                       seed=seed, name=f"mixed-{seed}")


def start_points(name: str, n: int, seed: int, span_s: float,
                 root: str | None = None) -> list[StartPoint]:
    """``n`` reproducible start points of network ``name`` (trace file and offset)."""
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
    if NETWORKS.get(name, (1,))[0] is None:
        network_files(name, root)  # a clear error when the traces are missing
        out = []
        for i in range(n):
            mseed = int(rng.integers(1 << 30))
            dur = MIXED_SEGMENTS * MIXED_SEGMENT_S
            start = round(float(rng.uniform(0, max(dur - span_s, 0.0))), 3)
            out.append(StartPoint(name, i, f"mixed-{mseed}", start))
        return out
    files = network_files(name, root)
    out = []
    for i in range(n):
        path = files[int(rng.integers(len(files)))]
        tr = _load(str(path))
        start = round(float(rng.uniform(0, max(tr.duration_s - span_s, 0.0))), 3)
        out.append(StartPoint(name, i, path.name, start))
    return out


def load_start_trace(sp: StartPoint, root: str | None = None) -> Trace:
    """The (unscaled) trace of a start point."""
    if sp.trace.startswith("mixed-"):
        return _mixed(int(sp.trace.split("-", 1)[1]), root)
    for path in network_files(sp.network, root):
        if path.name == sp.trace:
            return _load(str(path))
    raise TraceError(f"trace {sp.trace} of network {sp.network} is no longer in the trace "
                     "folder")


def pooled_median_bps(name: str, root: str | None = None) -> float:
    """Median of the 1-s rates of every trace of the network, pooled (bits/s)."""
    if NETWORKS[name][0] is None:
        traces = [_mixed(s, root) for s in range(10)]
    else:
        traces = [_load(str(p)) for p in network_files(name, root)]
    rates = []
    for tr in traces:
        r = tr.resampled(1.0)
        rates.append(np.asarray(r.rates_bps))
    med = float(np.median(np.concatenate(rates)))
    if not med > 0:
        raise TraceError(f"network {name!r} has a median rate of 0: cannot match the regime")
    return med


def past_median_bps(trace: Trace, start_s: float, window_s: float = 30.0) -> float:
    """Median rate of the ``window_s`` before ``start_s`` (what the phone saw recently:
    the rate prior of the first shard and the fixed-config ablation's budget)."""
    t0 = (start_s - window_s) % trace.duration_s
    med = float(trace.slice(round(t0, 3), window_s).stats(window_s=1.0)["median_mbps"]) * 1e6
    if med > 0:
        return med
    return max(float(trace.stats()["median_mbps"]) * 1e6, 1e5)
