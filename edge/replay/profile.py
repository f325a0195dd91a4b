"""The phone device profile: simulated time, real bytes, real allocator, real edit quality.

The ``profile`` regime stands for the paper's phone (FLUX.2-klein-4B on a Snapdragon 8
Elite Gen 5: ~13 s fully local, ~2.3 s masked execution at 10% of the tokens, 1.46 GiB
FP16 cache per 512x512 template) instead of this host. What is **modelled**:

* execution: the masked execution of a template with token mask ratio ``m`` takes the
  affine interpolation between the profile's two published points, ``masked_s`` (2.3 s) at
  ``masked_ratio`` (10%) and ``local_s`` (13 s) at 100% (every token computed):
  ``masked_s + (local_s - masked_s) (m - masked_ratio) / (1 - masked_ratio)``. Masked
  execution has a fixed part (text tokens, attention over the cached keys) and a part
  proportional to the computed tokens; a line through the origin instead would make a
  100% mask take 23 s, more than local generation. Split over shards in proportion to the
  per-shard times measured on this host (``EdgeRuntime.profile``); ``local`` takes
  ``local_s``;
* bytes: every configuration's real byte size times ``k = fp16_gib / (this template's FP16
  cache)``, so the FP16 pack is 1.46 GiB and every codec keeps its real compression ratio;
* the link: the real trace at its real rates (no scaling: 1.46 GiB at the Lumos5G median
  takes ~1.9x the 13 s local time and ~11x the 2.3 s window, the paper's regime), one
  transfer at a time, ``request_latency_s`` before the first body (later requests are
  pipelined behind the previous body, as the runtime does); reconstruction is not timed
  (assumed hidden behind execution);
* the pipeline: the runtime's own allocator, :class:`~edge.monitor.BandwidthMonitor` and
  :class:`~edge.monitor.ExecutionProgress` driven by this simulated clock, at most
  ``max_ahead`` shards ahead of execution, with the runtime's startup allowance
  (``startup_fraction`` of the modelled execution time, counted from t = 0: no manifest
  transfer is modelled); execution starts as soon as shard 0 is in.

What is **measured**: the configurations the allocator picks decide the bytes; the edit
is then computed for real with exactly those configurations (fetched over HTTP, decoded,
``cached_edit``) and compared with ``exact`` and ``full``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sakura.edge.allocator import PolicyContext, ShardOptions, get_policy
from sakura.edge.monitor import (
    DEFAULT_STARTUP_FRACTION,
    BandwidthMonitor,
    ExecutionProgress,
    startup_allowance_s,
)
from sakura.traces import Trace

GIB = float(1 << 30)


@dataclass(frozen=True)
class DeviceProfile:
    """Compute and cache-size anchors of the profiled phone (see ``ProfileSpec``)."""

    name: str
    local_s: float
    masked_s: float
    masked_ratio: float
    fp16_gib: float
    request_latency_s: float = 0.02

    def masked_total_s(self, token_mask_ratio: float) -> float:
        slope = (self.local_s - self.masked_s) / (1.0 - self.masked_ratio)
        return max(0.0, self.masked_s + slope * (token_mask_ratio - self.masked_ratio))

    def shard_exec_s(self, measured: list[float], token_mask_ratio: float) -> list[float]:
        total = sum(measured) or 1.0
        want = self.masked_total_s(token_mask_ratio)
        return [want * x / total for x in measured]

    def byte_scale(self, fp16_bytes: int) -> float:
        return self.fp16_gib * GIB / float(fp16_bytes)


@dataclass
class SimResult:
    latency_s: float
    configs: list[int]
    bytes: int                 # modelled bytes (real sizes x k)
    real_bytes: int            # the chosen configurations' real sizes
    stalls: int
    stall_s: float
    startup_s: float
    exec_s: float
    timeline: list[dict[str, Any]] = field(default_factory=list)


def scaled_tables(tables: list[ShardOptions], k: float) -> list[ShardOptions]:
    def scaled(options: list[Any]) -> list[Any]:
        return [replace(o, nbytes=max(1, int(round(o.nbytes * k)))) for o in options]

    return [ShardOptions(t.shard, scaled(t.options), t.compute_cost, scaled(t.dominated))
            for t in tables]


def simulate(policy: str, tables: list[ShardOptions], exec_s: list[float], trace: Trace,
             start_s: float, prior_bps: float, profile: DeviceProfile, k: float,
             safety: float = 0.8, max_ahead: int = 4,
             startup_fraction: float = DEFAULT_STARTUP_FRACTION,
             deadline_s: float | None = None) -> SimResult:
    """One streamed edit on the simulated clock (t = 0: the edit starts). ``deadline_s``
    replaces the startup allowance by ``deadline - execution`` (as the runtime does)."""
    big = scaled_tables(tables, k)
    real = {(t.shard, o.id): o.nbytes for t in tables for o in t.options + t.dominated}
    allocator = get_policy(policy).build(PolicyContext(
        tables=big, exec_s=exec_s, latency_s=0.0, budget_rate_bps=prior_bps, safety=safety))
    monitor = BandwidthMonitor(5, prior_bps)
    allowance = (startup_allowance_s(exec_s, startup_fraction) if deadline_s is None
                 else max(0.0, deadline_s - sum(exec_s)))
    progress = ExecutionProgress.with_allowance(exec_s, 0.0, allowance, now=0.0)
    n = len(exec_s)
    recv_end: list[float] = []
    ex_start: list[float] = []
    ex_end: list[float] = []
    configs: list[int] = []
    timeline: list[dict[str, Any]] = []
    link_free = 0.0
    stalls, stall_s, nbytes, rbytes = 0, 0.0, 0, 0
    reported = 0  # shards whose execution events the progress tracker has seen

    def report_until(now: float) -> None:
        nonlocal reported
        while reported < len(ex_start) and ex_start[reported] <= now:
            progress.exec_started(reported, ex_start[reported])
            if ex_end[reported] <= now:
                progress.exec_ended(reported, ex_end[reported])
                reported += 1
            else:
                break

    for j in range(n):
        gate = ex_start[j - max_ahead] if j >= max_ahead else 0.0
        now = max(link_free, gate)
        report_until(now)
        window = progress.window(j, now)
        rate = monitor.estimate_bps() or prior_bps
        cfg = allocator.choose(j, window.window_s, rate)
        size = big[j].by_id(cfg).nbytes
        first = now + (profile.request_latency_s if j == 0 else 0.0)
        end = trace.time_to_deliver(float(size), t0=start_s + first) - start_s \
            if size else first
        monitor.record(j, size, now, first, end)
        progress.received(j, end)
        progress.reconstructed(j, end, end)
        link_free = end
        recv_end.append(end)
        prev_end = ex_end[-1] if ex_end else 0.0
        start = max(prev_end, end)
        wait = max(0.0, end - prev_end) if j > 0 else 0.0
        if wait > 0:
            stalls += 1
            stall_s += wait
        ex_start.append(start)
        ex_end.append(start + exec_s[j])
        configs.append(cfg)
        nbytes += size
        rbytes += real[(j, cfg)]
        timeline.append({"shard": j, "bytes": size, "recv_start": now, "recv_end": end,
                         "recon_start": end, "recon_end": end, "exec_start": start,
                         "exec_end": start + exec_s[j], "stall_s": wait})
    return SimResult(latency_s=ex_end[-1], configs=configs, bytes=nbytes, real_bytes=rbytes,
                     stalls=stalls, stall_s=stall_s, startup_s=ex_start[0],
                     exec_s=sum(exec_s), timeline=timeline)
