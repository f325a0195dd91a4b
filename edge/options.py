"""The knobs of a streamed edit: :class:`EditOptions` (each field with the measurement that
chose its default) and the allocator's options an edit passes on (:func:`policy_options`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sakura.dit.stale import STALE_MAX_AGE
from sakura.edge import PRECISIONS
from sakura.edge.errors import EdgeError
from sakura.edge.monitor import DEFAULT_STARTUP_FRACTION, check_startup_fraction
from sakura.edge.retry import RetryPolicy

#: the HTTP versions EditOptions.http_version takes (HTTP/2: the native runtime only)
HTTP_VERSIONS = ("1.1", "2")


@dataclass
class EditOptions:
    """Knobs of a streamed edit (defaults are the design's)."""

    max_ahead: int = 4          # shards fetched ahead of execution (in flight ... ready)
    max_ready: int = 2          # reconstructed shards held ahead of execution (memory)
    max_inflight: int = 6       # pipelined requests (1: one request at a time)
    # open max_inflight - 1 connections at once before the first request (a HEAD of the
    # pack each: public) and let hedges take an idle one from that pool, so no handshake
    # crosses a downlink queue that a body has filled (native runtime; docs/RESULTS.md)
    warm_connections: bool = True
    # the native runtime's HTTP: "1.1", or "2" (h2c with prior knowledge, every request a
    # stream of one connection; nginx's `listen PORT http2;`, never `sakura serve`, which
    # speaks HTTP/1.1 only); docs/bench/http2.json measured both (edge/README.md)
    http_version: str = "1.1"
    # the scheme://host:port the native runtime reads pack ranges from, the same paths as
    # the server's (None: the server's): Debian 12's nginx 1.22 speaks h2c on a listener of
    # its own only, while manifests still come over HTTP/1.1 from the server URL
    pack_origin: str | None = None
    # the local fallback (both runtimes; issue 28 item 10): a step whose first shard is not
    # in within one local step's predicted time is computed on the device with every token,
    # as `local` does, and so is each next step until a shard is in when its step begins
    local_fallback: bool = True
    # stale reuse (both runtimes; dit/stale.py): a late step runs on each block group's last
    # K/V if it is at most this many steps old, instead of computing the step with every
    # token (docs/bench/stale-reuse.json chose 3; 0: never)
    stale_max_age: int = STALE_MAX_AGE
    # the stale plan (both runtimes; edge/stale_plan.py): a shard whose planned configuration
    # is its policy's smallest is not fetched when its block group holds K/V at most
    # stale_max_age steps old; it runs on those (SAKURA's policies; needs the local fallback
    # and stale reuse). docs/bench/stale-vs-smallest.json: stale beat the smallest
    # configuration in 114 of 114 shards
    stale_plan: bool = True
    # ... and where such a shard's group holds no recent K/V, its step is recomputed on the
    # device instead of fetched (where the local step is a recompute step: exact K/V, the
    # next steps' stale source; edge/stale_plan.py, "Planned recompute")
    stale_plan_local: bool = True
    # prefix refinement (both runtimes; issue 28 item 5): while the link is idle and no
    # shard may be requested yet, a received shard whose execution is at least twice the
    # extension's expected time away is extended to a larger configuration of its policy by
    # one more single-range GET of the same pack (its bytes are a prefix of that one's)
    refine: bool = True
    # beyond max_ahead, up to max_ahead_cap shards, a shard is requested once its predicted
    # execution start is lookahead_rtts request latencies away: with the native runtime a
    # shard executes in ~10 ms, less than one 5G round trip, so 4 shards ahead left no time
    # to transfer anything but the smallest configurations (edge/README.md, "Pipeline");
    # a max_ahead above max_ahead_cap wins
    lookahead_rtts: float = 3.0
    max_ahead_cap: int = 16
    # where the native runtime decodes sakura/svd shards: "cpu" (SIMD kernels) or "opencl"
    # ("opencl:NAME" picks a device by name; pocl on this machine, an Adreno on a phone)
    reconstruct: str = "cpu"
    # CPUs of the native runtime's receive and reconstruct threads (None: the caller's).
    # On a phone they are the modem's DMA and the GPU, never the execution unit; on a host
    # with few cores, giving them other cores than execution's keeps receiving and decoding
    # from slowing execution (the benches give them the server and link's core)
    pipeline_cpus: tuple[int, ...] | None = None
    # the shard loop's graphs (native runtime, device bundles): "fp32", or "int8"
    # (edge.backends.int8: dynamic int8 Linear layers, attention over the fp32 cache fp32)
    precision: str = "fp32"
    safety: float = 0.8         # fraction of rate x window the allocator may use
    rate_window: int = 5        # shards in the harmonic-mean rate estimate
    budget_rate_bps: float | None = None  # median rate for sakura-fixed-config
    initial_rate_bps: float | None = None  # rate prior (None: the device's last estimate)
    cache_manifests: bool = True  # keep manifests on the device, revalidate by ETag
    # the origin the rate memory keys this edit by (None: the server URL); an emulated link
    # in front of a server passes the server's, as the emulator's port changes every run
    rate_origin: str | None = None
    # feed this edit's transfers to the rate memory (False: a reference computation over
    # another path, e.g. --compare-exact's fp16 edit straight from the server)
    remember_rate: bool = True
    pack: str | None = None     # stream this codec's pack instead of the policy's default
    policy_options: dict[str, Any] = field(default_factory=dict)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # told, a line per retry, what the edit's client waits for (PackClient.on_wait; the
    # native receive stage says the same words: HttpOptions::on_wait)
    on_wait: Callable[[str], None] | None = None
    # execution may start this fraction of the predicted execution time after the manifest
    # is in, so the first shards fit better configurations (0: start as soon as possible)
    startup_fraction: float = DEFAULT_STARTUP_FRACTION
    # a deadline for the whole edit (s from its start; None: none): execution may then start
    # as late as deadline - predicted execution, which replaces the startup allowance (how
    # the replay gives sakura a latency target for its iso-latency/iso-quality views)
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> EditOptions:
        """Raise :class:`EdgeError` for an unusable value (also checked at each edit, as
        the fields may be changed after construction)."""
        try:
            check_startup_fraction(self.startup_fraction)
        except ValueError as exc:
            raise EdgeError(str(exc)) from None
        if self.deadline_s is not None and not (math.isfinite(self.deadline_s)
                                                and self.deadline_s > 0):
            raise EdgeError(f"deadline_s must be a time > 0 s, got {self.deadline_s!r}")
        if not (math.isfinite(self.lookahead_rtts) and self.lookahead_rtts >= 0):
            raise EdgeError(f"lookahead_rtts must be >= 0, got {self.lookahead_rtts!r}")
        if min(self.max_ahead, self.max_ready, self.max_inflight) < 1:
            raise EdgeError("max_ahead, max_ready and max_inflight must be >= 1")
        if self.precision not in PRECISIONS:
            raise EdgeError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                            f"{self.precision!r}")
        if self.http_version not in HTTP_VERSIONS:
            raise EdgeError(f"http_version must be one of {', '.join(HTTP_VERSIONS)}, got "
                            f"{self.http_version!r}")
        if self.reconstruct != "cpu" and not self.reconstruct.startswith("opencl"):
            raise EdgeError(f"reconstruct must be cpu or opencl[:device], got "
                            f"{self.reconstruct!r}")
        if self.pipeline_cpus is not None:
            cpus = tuple(self.pipeline_cpus)
            if not cpus or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                   for c in cpus):
                raise EdgeError(f"pipeline_cpus must be CPU numbers >= 0, got "
                                f"{self.pipeline_cpus!r}")
        return self


def policy_options(opts: EditOptions, manifest: dict[str, Any]) -> dict[str, Any]:
    """The allocator's options: the caller's, and the pack's ``local_psnr_db`` (a local
    edit's PSNR against exact, measured when the pack was built) for the quality floor."""
    local = manifest.get("local_psnr_db")
    return {**({} if local is None else {"local_psnr_db": float(local)}),
            **opts.policy_options}
