"""Bandwidth and execution-progress bookkeeping for the allocator.

:class:`BandwidthMonitor` keeps one sample per transfer (bytes, request start, first body
byte, end) and estimates throughput as the bytes of the last ``k`` transfers over the time
the link was busy with them: the length of the union of their intervals, each from when
its bytes could start to cross the link (its request plus one round trip, the smallest time
to first byte of the other transfers, and no later than its first byte) to its end. Why not
a mean of per-body rates, as adaptive video streaming does with one transfer at a time:
with requests pipelined and overlapping, and a link that saves up a little capacity while
idle (a 20 ms burst on the paced link, a cellular scheduler's grant), bodies of 20-30 KB
arrived in 2 ms and "proved" 50-120 Mbit/s on a 20 Mbit/s link, the next shards were sized
for that and stalled; over the union, a burst's bytes are paid for by the time around them.
Until ``k`` transfers are in, the prior rate (if any) stands for the missing ones, so two
bursty first bodies do not replace a sound prior. A window whose busy time is under
``min_body_s`` (one read each) cannot be timed: ``8 n / min_body_s`` is only a lower bound
and never lowers the prior, and after a slow spell such quick arrivals of the smallest
configurations lift the estimate step by step, like a slow start. Likewise a window that
is *app-limited* (bytes arriving less than ``APP_LIMITED_SHARE`` of its busy time: small
bodies behind request latencies, the link idle in between, as BBR marks its delivery-rate
samples) measures the requests, not the link: it only raises the estimate held before it.
So the estimate is kept as of each sample (``record``), and a window that says nothing
about the link leaves it standing. The per-request latency is the median of recent times
to first byte.

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

# Startup allowance: the fraction of the edit's predicted execution time by which execution
# may start later than the shards start streaming, so that the first shards go at better
# configurations (0: none). Chosen on the demo: docs/RESULTS.md, "Startup allowance".
DEFAULT_STARTUP_FRACTION = 0.1

# A window of transfers is app-limited when bytes were arriving less than this share of its
# busy time: small bodies behind request latencies (the link idle between them). Its rate
# is then a lower bound that only raises the estimate held before it. Without this rule a
# first edit on a constant 40 Mbit/s link measured 10 Mbit/s from its manifest and then
# 0.2-0.8 Mbit/s from its smallest-configuration shards (170-byte bodies behind 10-20 ms
# requests), and sent 11 shards at the smallest configuration (issue 28); on loopback the
# same edit estimated 0.1-0.2 Mbit/s. A saturated link carries bytes nearly all its busy
# time (all but the first round trip of a pipelined window).
APP_LIMITED_SHARE = 0.5


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
        self._held: float | None = initial_bps  # the estimate as of the last sample
        self._lock = threading.Lock()

    def record(self, shard: int | None, nbytes: int, start: float, first_byte: float,
               end: float) -> TransferSample:
        sample = TransferSample(shard, int(nbytes), float(start), float(first_byte), float(end))
        with self._lock:
            self.samples.append(sample)
            self._held = self._estimate(self.samples, self._held)
        return sample

    def estimate_bps(self) -> float | None:
        """Bytes over busy time of the last ``k`` transfers (see the module docstring);
        the prior (``initial_bps``, may be None) before any transfer and, until ``k`` are
        in, for the missing ones; transfers too quick to time, and app-limited windows
        (the link carried bytes less than ``APP_LIMITED_SHARE`` of the busy time), only
        raise the estimate held before them."""
        with self._lock:
            return self._held if self.samples else self.initial_bps

    def _estimate(self, samples: list[TransferSample], held: float | None) -> float | None:
        prior = self.initial_bps
        window = samples[-self.k:]
        busy, reach = 0.0, -math.inf
        for begin, end in sorted((self._begin(s, samples), s.end) for s in window):
            if end > reach:
                busy += end - max(begin, reach)
                reach = end
        body, reach = 0.0, -math.inf
        for begin, end in sorted((s.first_byte, s.end) for s in window):
            if end > reach:
                body += end - max(begin, reach)
                reach = end
        measured = 8.0 * sum(s.nbytes for s in window) / max(busy, self.min_body_s)
        floor = held if len(samples) > 1 else prior
        if busy < self.min_body_s:  # too quick to time: a lower bound
            return measured if not floor or measured > floor else floor
        missing = self.k - len(window) if prior else 0
        if missing > 0 and measured > 0:
            measured = (len(window) + missing) / (len(window) / measured + missing / prior)
        if floor and body < APP_LIMITED_SHARE * busy:  # app-limited: a lower bound
            return max(measured, floor)
        return measured

    @staticmethod
    def _begin(s: TransferSample, samples: list[TransferSample]) -> float:
        """When ``s``'s bytes could start to cross the link: its request plus one round
        trip (the smallest time to first byte of the *other* transfers: its own may have
        waited behind other bodies), and no later than its first byte."""
        round_trip = min((o.latency_s for o in samples if o is not s), default=0.0)
        return min(s.first_byte, s.start + round_trip)

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

    def exec_ended_local(self, shard: int, t: float) -> None:
        """A shard whose step ran on the device (local fallback) ended: the time a local
        step took says nothing about cached execution, so the scale stays."""
        with self._lock:
            self.shards[shard].exec_end = t

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
