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
  transfer is modelled); execution starts as soon as shard 0 is in;
* the stale plan and planned recompute (:mod:`edge.stale_plan`, for the policies that plan
  stale): the receive stage's rule, with the runtime's own functions (``skippable``,
  ``stale_source``, ``plan_unfetched``; a step planned local only on a rate a transfer
  refreshed since the last one). A shard planned stale is not fetched and executes at no
  wait on its group's last K/V; a step planned local is not fetched and takes the
  profile's local step, ``local_s / steps`` (a recompute step costs about a full step).
  The timed runs of the matched regime planned 8 of ~40 shards stale per sakura edit
  (``docs/replay-kernel``): without it this model fetched shards the runtime does not.

What is **measured**: the configurations the allocator picks decide the bytes; the edit
is then computed for real with exactly those configurations (fetched over HTTP, decoded,
then the native graphs as ``exact``, or ``cached_edit`` when the stale plan left a shard
unfetched) and compared with ``exact`` and ``full``.
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
from sakura.edge.stale_plan import plan_unfetched, stale_source
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
    # the stale plan: per shard None (fetched at ``configs[j]``), "stale" or "local"
    unfetched: list[str | None] = field(default_factory=list)

    @property
    def planned_stale(self) -> int:
        return self.unfetched.count("stale")

    @property
    def planned_local(self) -> int:
        return self.unfetched.count("local")


def scaled_tables(tables: list[ShardOptions], k: float) -> list[ShardOptions]:
    def scaled(options: list[Any]) -> list[Any]:
        return [replace(o, nbytes=max(1, int(round(o.nbytes * k)))) for o in options]

    return [ShardOptions(t.shard, scaled(t.options), t.compute_cost, scaled(t.dominated))
            for t in tables]


def simulate(policy: str, tables: list[ShardOptions], exec_s: list[float], trace: Trace,
             start_s: float, prior_bps: float, profile: DeviceProfile, k: float,
             safety: float = 0.8, max_ahead: int = 4,
             startup_fraction: float = DEFAULT_STARTUP_FRACTION,
             deadline_s: float | None = None,
             shard_blocks: list[tuple[int, list[int]]] | None = None,
             stale_max_age: int | None = None, recompute: bool = True) -> SimResult:
    """One streamed edit on the simulated clock (t = 0: the edit starts). ``deadline_s``
    replaces the startup allowance by ``deadline - execution`` (as the runtime does).
    ``shard_blocks`` (``(step, blocks)`` per shard, the pack's layout): the stale plan
    applies to a policy that plans stale (None: every shard is fetched); ``recompute``: a
    step may be planned local (the template's prompt embeddings are at hand);
    ``stale_max_age`` None: the runtime's (``dit.stale.STALE_MAX_AGE``)."""
    if stale_max_age is None:
        from sakura.dit.stale import STALE_MAX_AGE  # lazy: torch (edge.netem imports this module)

        stale_max_age = STALE_MAX_AGE
    pol = get_policy(policy)
    big = scaled_tables(tables, k)
    real = {(t.shard, o.id): o.nbytes for t in tables for o in t.options + t.dominated}
    allocator = pol.build(PolicyContext(
        tables=big, exec_s=exec_s, latency_s=0.0, budget_rate_bps=prior_bps, safety=safety))
    plan = StalePlan(shard_blocks, stale_max_age, recompute) if (
        shard_blocks is not None and pol.plans_stale) else None
    steps = 1 + max((s for s, _ in shard_blocks), default=0) if shard_blocks else 1
    local_step_s = profile.local_s / steps
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

    unfetched: list[str | None] = []
    for j in range(n):
        gate = ex_start[j - max_ahead] if j >= max_ahead else 0.0
        now = max(link_free, gate)
        report_until(now)
        window = progress.window(j, now)
        rate = monitor.estimate_bps() or prior_bps
        in_local_step = plan.step_local(j) if plan is not None else None
        decided = in_local_step
        cfg = None
        if decided is None:
            cfg = allocator.choose(j, window.window_s, rate,
                                   plan.may_skip(j) if plan is not None else None)
            if plan is not None and allocator.skippable(j, cfg):
                decided = plan.decide(j, monitor.estimate_bps() or 0.0)
        unfetched.append(decided)
        if plan is not None:
            plan.record(j, decided)
        if decided is not None:  # not fetched: no bytes, no wait for the link
            start = ex_end[-1] if ex_end else 0.0
            # a step planned local costs one local step, on its first shard planned local
            run_s = (exec_s[j] if decided == "stale" else
                     0.0 if in_local_step else local_step_s)
            progress.received(j, now)
            progress.reconstructed(j, now, now)
            ex_start.append(start)
            ex_end.append(start + run_s)
            configs.append(None)
            timeline.append({"shard": j, "bytes": 0, "recv_start": now, "recv_end": now,
                             "recon_start": now, "recon_end": now, "exec_start": start,
                             "exec_end": start + run_s, "stall_s": 0.0, "unfetched": decided})
            continue
        size = big[j].by_id(cfg).nbytes
        first = now + (profile.request_latency_s if j == 0 else 0.0)
        end = trace.time_to_deliver(float(size), t0=start_s + first) - start_s \
            if size else first
        monitor.record(j, size, now, first, end)
        if plan is not None:
            plan.measured = plan.measured or size > 0
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
                     exec_s=sum(e - s for s, e in zip(ex_start, ex_end)), timeline=timeline,
                     unfetched=unfetched)


@dataclass
class StalePlan:
    """The receive stage's stale plan on the simulated clock (``edge.pipeline.Pipeline``'s
    ``_plan_stale`` / ``_stale_options`` / ``_step_planned_local``, through the same
    :mod:`edge.stale_plan` functions)."""

    shard_blocks: list[tuple[int, list[int]]]
    max_age: int
    recompute: bool
    measured: bool = True  # a transfer refreshed the rate since the last step planned local
    stale: list[bool] = field(default_factory=list)
    local: list[bool] = field(default_factory=list)

    def record(self, j: int, decided: str | None) -> None:
        self.stale.append(decided == "stale")
        self.local.append(decided == "local")

    def step_local(self, j: int) -> str | None:
        """"local" when an earlier shard of ``j``'s step was planned local."""
        step = self.shard_blocks[j][0]
        return "local" if any(self.local[i] for i in range(j) if self.shard_blocks[i][0] == step
                              ) else None

    def _planned(self) -> list[bool]:
        """Per shard, whether it was planned stale (False for those not yet decided)."""
        return self.stale + [False] * (len(self.shard_blocks) - len(self.stale))

    def may_skip(self, j: int):
        """For the allocator's plan from ``j``: whether shard ``m`` may run stale, counting
        every shard from ``j`` on as unfetched."""
        planned = self._planned()
        return lambda m: stale_source(self.shard_blocks, planned, m, self.max_age,
                                      unfetched_from=j) is not None

    def decide(self, j: int, rate_bps: float) -> str | None:
        source = stale_source(self.shard_blocks, self._planned(), j, self.max_age)
        decided = plan_unfetched(source, self.recompute and self.max_age > 0
                                 and rate_bps > 0 and self.measured)
        if decided == "local":
            self.measured = False
        return decided
