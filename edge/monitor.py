"""Bandwidth and execution-progress bookkeeping for the allocator.

:class:`BandwidthMonitor` keeps one sample per shard transfer (bytes, request start, first
body byte, end) and estimates throughput as the harmonic mean of the last ``k`` body rates,
as adaptive video streaming does (robust to short bursts that overstate the rate), with the
prior rate (if any) standing for the samples still missing from the ``k``, plus the
per-request latency (median of recent times to first byte). A body that arrived in less
than ``min_body_s`` (one read, or a burst the link had saved up) gives no rate, only a
lower bound (``8 n`` over the time from the request to the body's end less one round trip,
the smallest time to first byte of the other transfers, and at least ``min_body_s``): such
bodies newer than the last informative sample
can only raise the estimate, so after a slow spell the estimate climbs back as the
configurations grow instead of staying stuck at the smallest one.

:class:`ExecutionProgress` knows the measured execution time of every shard (a calibration,
corrected online by the ratio of measured to predicted times), when each shard arrived,
was reconstructed and executed. From that it predicts when execution will reach a shard:
its *deadline*. The allocator's window for shard ``j`` is ``deadline_j - now`` minus the
expected reconstruction time: the nominal slot (the execution time of shard ``j - 1``, the
time it is received in while ``j - 1`` executes) plus the *carry-over*, the time by which
earlier shards arrived ahead of their deadlines.

Nothing executes before shard 0 is in, so before execution starts the prediction needs a
start time: ``origin + startup_s`` at the earliest (default ``startup_s = exec_s[0]``).
A *startup allowance* (:meth:`ExecutionProgress.with_allowance`) moves that start later on
purpose: the device waits a little (a fraction of the edit's execution time) so that the
first shards, which have no execution to hide behind, can be sent at better
configurations. It applies to shard 0 and to every later shard's prediction while nothing
has executed; once a shard has started executing, predictions follow the real progress
and the allowance no longer matters.

All times are seconds on one monotonic clock (the runtime uses ``time.monotonic()``).
Both classes are thread-safe: the pipeline's stages report from different threads.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass

MIN_BODY_S = 5e-4  # floor of a body duration when computing a rate
# Startup allowance: the fraction of the edit's predicted execution time by which execution
# may start later than the shards start streaming, so that the first shards go at better
# configurations (0: none). Chosen on the demo: docs/RESULTS.md, "Startup allowance".
DEFAULT_STARTUP_FRACTION = 0.1


@dataclass(frozen=True)
class TransferSample:
    """One completed transfer (a shard body, or the manifest)."""

    shard: int | None
    nbytes: int
    start: float
    first_byte: float
    end: float

    @property
    def latency_s(self) -> float:
        return max(0.0, self.first_byte - self.start)

    @property
    def body_s(self) -> float:
        return max(MIN_BODY_S, self.end - self.first_byte)

    @property
    def rate_bps(self) -> float:
        """Body throughput in bits per second."""
        return 8.0 * self.nbytes / self.body_s


class BandwidthMonitor:
    """Throughput and latency estimates from recent transfers."""

    def __init__(self, k: int = 5, initial_bps: float | None = None,
                 min_body_s: float = 0.002) -> None:
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k
        self.initial_bps = initial_bps
        self.min_body_s = min_body_s
        self.samples: list[TransferSample] = []
        self._lock = threading.Lock()

    def record(self, shard: int | None, nbytes: int, start: float, first_byte: float,
               end: float) -> TransferSample:
        sample = TransferSample(shard, int(nbytes), float(start), float(first_byte), float(end))
        with self._lock:
            self.samples.append(sample)
        return sample

    def _informative(self, s: TransferSample) -> bool:
        return s.end - s.first_byte >= self.min_body_s

    def estimate_bps(self) -> float | None:
        """Harmonic mean of the last ``k`` informative body rates, raised to what fast
        bodies since the newest informative one prove (see :meth:`_lower_bound`); the
        prior (``initial_bps``, may be None) before any informative sample."""
        with self._lock:
            samples = list(self.samples)
        informative = [s for s in samples if self._informative(s)][-self.k:]
        if informative:
            # the prior stands for the samples still missing from a full window: two bodies
            # that came in a saved-up burst at the start of an edit (97 Mbit/s on a 17
            # Mbit/s link) would otherwise replace a sound prior outright
            prior = (self.k - len(informative)) if self.initial_bps else 0
            estimate: float | None = (len(informative) + prior) / (
                sum(1.0 / s.rate_bps for s in informative)
                + (prior / self.initial_bps if prior else 0.0))
            newer = [s for s in samples if s.end > informative[-1].end
                     and not self._informative(s)]
        else:
            estimate = self.initial_bps
            newer = samples
        bound = self._lower_bound(newer[-self.k:], samples)
        if bound is not None and (estimate is None or bound > estimate):
            return bound
        return estimate

    def _lower_bound(self, fast: list[TransferSample], samples: list[TransferSample]
                     ) -> float | None:
        """A body of ``n`` bytes that arrived in less than ``min_body_s`` proves a rate of
        at least ``8 n / min_body_s``: after a slow spell, when only the smallest
        configurations fit, their fast arrivals lift the estimate step by step (each
        choice a little larger), like a slow start, instead of leaving it stuck."""
        if not fast:
            return None
        # the bytes crossed the link between the request and the body's end: a body read in
        # one go may have waited in the socket buffer (a saved-up burst), so its body time
        # alone proves nothing (a 22 KB shard read at once "proved" 87 Mbit/s on a 12 Mbit/s
        # link and sized the next shards 7x too large). Less one round trip, the smallest
        # time to first byte of the *other* transfers (the request's way out and the first
        # byte's way back carry none of the body; the body's own first byte may have waited
        # behind the burst): without it, on a 30 ms link a 1 KB configuration proved 0.26
        # Mbit/s, the next choice was 1 KB again and the estimate never left the smallest
        # configuration of a 20 Mbit/s link
        def round_trip(s: TransferSample) -> float:
            return min((o.latency_s for o in samples if o is not s), default=0.0)

        return max(8.0 * s.nbytes / max(self.min_body_s, s.end - s.start - round_trip(s))
                   for s in fast)

    def latency_s(self) -> float:
        """Median time to first byte of the last ``k`` transfers (0 before any)."""
        with self._lock:
            recent = self.samples[-self.k:]
        return statistics.median(s.latency_s for s in recent) if recent else 0.0

    def bytes_total(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self.samples if s.shard is not None)


@dataclass
class ShardProgress:
    """What is known about one shard's way through the pipeline (absolute clock times)."""

    recv_end: float | None = None
    recon_start: float | None = None
    recon_end: float | None = None
    exec_start: float | None = None
    exec_end: float | None = None


@dataclass(frozen=True)
class Window:
    """The allocator's input for one shard.

    ``slot_s`` is the nominal part of the window: the predicted execution time of shard
    ``j - 1``, for shard 0 ``startup_s`` (counted from the origin, so shard 0's carry is
    negative by the time already spent, e.g. on the manifest). ``carry_s = window_s -
    slot_s``: time carried over from earlier shards arriving early; for shards 1, 2, ...
    while nothing executes yet it includes what is left of the startup allowance.
    """

    shard: int
    window_s: float   # time left to receive the shard (deadline - now - reconstruction)
    slot_s: float     # the nominal part: execution time of the previous shard (or startup)
    carry_s: float    # window_s - slot_s: early arrival / allowance carried over
    deadline: float   # predicted execution start of the shard (absolute)


def check_startup_fraction(fraction: float) -> float:
    """``fraction`` as a float in [0, 1] (ValueError, with the reason, otherwise)."""
    try:
        f = float(fraction)
    except (TypeError, ValueError):
        raise ValueError(f"startup_fraction must be a number in [0, 1], got {fraction!r}"
                         ) from None
    if isinstance(fraction, bool) or not math.isfinite(f) or not 0.0 <= f <= 1.0:
        raise ValueError(f"startup_fraction must be a number in [0, 1] (a fraction of the "
                         f"edit's execution time), got {fraction!r}")
    return f


def startup_allowance_s(exec_s: Sequence[float], fraction: float) -> float:
    """The startup allowance: ``fraction`` of the predicted execution time of the edit."""
    return check_startup_fraction(fraction) * sum(max(0.0, float(x)) for x in exec_s)


class ExecutionProgress:
    """Predicts each shard's execution start from measured times and current progress.

    ``exec_s[j]`` is the calibrated execution time of shard ``j``; measured execution times
    correct all later predictions by an exponentially averaged ratio measured / predicted.
    ``startup_s``: before anything executes, execution is predicted to start at ``origin +
    startup_s`` at the earliest (later if shard 0 is not ready by then); it is shard 0's
    window and also shifts the predictions of shards 1, 2, ... (default: ``exec_s[0]``).
    """

    def __init__(self, exec_s: list[float], origin: float, startup_s: float | None = None,
                 alpha: float = 0.5) -> None:
        if not exec_s:
            raise ValueError("need the execution time of at least one shard")
        self.exec_s = [max(0.0, float(x)) for x in exec_s]
        self.origin = float(origin)
        self.startup_s = float(exec_s[0] if startup_s is None else startup_s)
        if not math.isfinite(self.startup_s) or self.startup_s < 0:
            raise ValueError(f"startup_s must be a finite time >= 0, got {startup_s!r}")
        self.alpha = alpha
        self.scale = 1.0
        self.recon_est_s = 0.0
        self.shards = [ShardProgress() for _ in exec_s]
        self._lock = threading.Lock()

    @classmethod
    def with_allowance(cls, exec_s: list[float], origin: float, allowance_s: float,
                       now: float, alpha: float = 0.5) -> ExecutionProgress:
        """Execution predicted to start ``allowance_s`` after ``now`` (when the shards start
        streaming, e.g. once the manifest is in) at the earliest, and never before the
        default ``origin + exec_s[0]``: ``startup_s = max(exec_s[0], now - origin +
        allowance_s)``. An allowance of 0 gives the default prediction exactly (``now``
        is never earlier than the present)."""
        if not math.isfinite(allowance_s) or allowance_s < 0:
            raise ValueError(f"the startup allowance must be a finite time >= 0, got "
                             f"{allowance_s!r}")
        first = max(0.0, float(exec_s[0])) if exec_s else 0.0
        return cls(exec_s, origin, startup_s=max(first, now - origin + allowance_s),
                   alpha=alpha)

    @property
    def start_not_before(self) -> float:
        """The earliest predicted start of execution (absolute): ``origin + startup_s``."""
        return self.origin + self.startup_s

    @property
    def num_shards(self) -> int:
        return len(self.exec_s)

    # ------------------------------------------------------------------ events
    def received(self, shard: int, t: float) -> None:
        with self._lock:
            self.shards[shard].recv_end = t

    def reconstructed(self, shard: int, start: float, end: float) -> None:
        with self._lock:
            p = self.shards[shard]
            p.recon_start, p.recon_end = start, end
            d = max(0.0, end - start)
            self.recon_est_s = d if self.recon_est_s == 0 else (
                self.alpha * d + (1 - self.alpha) * self.recon_est_s)

    def exec_started(self, shard: int, t: float) -> None:
        with self._lock:
            self.shards[shard].exec_start = t

    def exec_ended(self, shard: int, t: float) -> None:
        with self._lock:
            p = self.shards[shard]
            p.exec_end = t
            predicted = self.exec_s[shard]
            if p.exec_start is not None and predicted > 0:
                ratio = max(0.0, t - p.exec_start) / predicted
                self.scale = self.alpha * ratio + (1 - self.alpha) * self.scale

    # ------------------------------------------------------------------ predictions
    def predicted_exec_s(self, shard: int) -> float:
        return self.exec_s[shard] * self.scale

    def _ready(self, i: int, now: float) -> float:
        p = self.shards[i]
        if p.recon_end is not None:
            return p.recon_end
        if p.recon_start is not None:
            return max(now, p.recon_start + self.recon_est_s)
        if p.recv_end is not None:
            return max(now, p.recv_end + self.recon_est_s)
        return now + self.recon_est_s  # not received yet: at best right after now

    def deadline(self, shard: int, now: float) -> float:
        """Predicted time execution starts ``shard`` (all shards before it executed)."""
        with self._lock:
            return self._deadline(shard, now)

    def _deadline(self, shard: int, now: float) -> float:
        started = [i for i in range(shard) if self.shards[i].exec_start is not None]
        if started:
            c = started[-1]
            p = self.shards[c]
            if p.exec_end is not None:
                t = p.exec_end
            else:
                t = max(now, p.exec_start + self.predicted_exec_s(c))
            first = c + 1
        else:
            # nothing executes yet: execution starts once shard 0 is ready, and not before
            # origin + startup_s (the startup allowance, for shard 0 and every later shard)
            if shard == 0:
                return max(now, self.start_not_before)
            t = max(self._ready(0, now), self.start_not_before)
            t += self.predicted_exec_s(0)
            first = 1
        for i in range(first, shard):
            t = max(t, self._ready(i, now)) + self.predicted_exec_s(i)
        return t

    def window(self, shard: int, now: float) -> Window:
        """Time left to receive ``shard`` so that it is reconstructed before its deadline."""
        with self._lock:
            deadline = self._deadline(shard, now)
            window = deadline - now - self.recon_est_s
            slot = self.startup_s if shard == 0 else self.predicted_exec_s(shard - 1)
        return Window(shard, window, slot, window - slot, deadline)
