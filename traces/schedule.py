"""Wall-clock capacity schedule shared by both link emulators.

A :class:`LinkSchedule` maps monotonic wall-clock time (``time.monotonic()``, the asyncio
loop clock) to capacity: trace time = ``start_s + (wall - origin)``, looping over the trace.
Live changes (:meth:`LinkSchedule.set_rate`, :meth:`LinkSchedule.set_trace`,
:meth:`LinkSchedule.restart`) start a new segment at the moment of the change; the history is
kept so :meth:`LinkSchedule.expected_bytes` gives the exact capacity of any past window,
which is what accuracy tests compare delivered bytes against.

:class:`LinkEmulator` is the interface both emulators (:class:`traces.link.PacedLink` /
:class:`traces.link.PacedLinkThread` and :class:`traces.netns.KernelShapedLink`) share.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from sakura.traces.errors import LinkError
from sakura.traces.model import Trace


@dataclass(frozen=True)
class Segment:
    """From ``wall_start`` on, capacity follows ``trace`` from trace time ``trace_start``."""

    wall_start: float
    trace: Trace
    trace_start: float

    def trace_time(self, wall: float) -> float:
        return self.trace_start + (wall - self.wall_start)


class LinkSchedule:
    """Capacity over monotonic wall-clock time, with live changes; thread-safe."""

    def __init__(
        self,
        trace: Trace,
        start_s: float = 0.0,
        origin: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(trace, Trace):
            raise LinkError(f"a link needs a traces.Trace, got {type(trace).__name__}")
        self._clock = clock
        self._lock = threading.Lock()
        wall = clock() if origin is None else float(origin)
        self._segments: list[Segment] = [Segment(wall, trace, float(start_s))]
        self._starts: list[float] = [wall]
        self.version = 0

    # ------------------------------------------------------------------ state
    @property
    def current(self) -> Segment:
        with self._lock:
            return self._segments[-1]

    @property
    def origin(self) -> float:
        """Wall time at which the current segment started (trace time ``start_s``)."""
        return self.current.wall_start

    @property
    def trace(self) -> Trace:
        return self.current.trace

    @property
    def segments(self) -> list[Segment]:
        with self._lock:
            return list(self._segments)

    def now(self) -> float:
        return self._clock()

    def _segment_index(self, wall: float) -> int:
        return max(0, bisect.bisect_right(self._starts, wall) - 1)

    def segment_at(self, wall: float) -> Segment:
        with self._lock:
            return self._segments[self._segment_index(wall)]

    def trace_time(self, wall: float | None = None) -> float:
        """Trace time (seconds, not wrapped) at wall time ``wall`` (default now)."""
        w = self._clock() if wall is None else wall
        return self.segment_at(w).trace_time(w)

    def rate_at(self, wall: float | None = None) -> float:
        """Capacity in bits/s at wall time ``wall`` (default now)."""
        w = self._clock() if wall is None else wall
        seg = self.segment_at(w)
        return float(seg.trace.rate_at(seg.trace_time(w)))

    # ------------------------------------------------------------------ integrals
    def bits_between(self, wall0: float, wall1: float) -> float:
        """Exact capacity in bits over the wall-clock window (across live changes)."""
        if wall1 <= wall0:
            return 0.0
        with self._lock:
            segs = list(self._segments)
            starts = list(self._starts)
        total = 0.0
        i = max(0, bisect.bisect_right(starts, wall0) - 1)
        while i < len(segs) and (i == 0 or starts[i] < wall1):
            seg = segs[i]
            lo = wall0 if i == 0 else max(wall0, seg.wall_start)
            hi = wall1 if i + 1 >= len(segs) else min(wall1, starts[i + 1])
            if hi > lo:
                total += seg.trace.bits_between(seg.trace_time(lo), seg.trace_time(hi))
            i += 1
        return total

    def expected_bytes(self, wall0: float, wall1: float) -> float:
        """Exact capacity in bytes over the wall-clock window."""
        return self.bits_between(wall0, wall1) / 8.0

    def finish_time(self, start_wall: float, nbytes: float) -> float:
        """Wall time when ``nbytes`` sent from ``start_wall`` arrive at capacity (inf if never).

        Uses the current segment (callers clamp ``start_wall`` to its start).
        """
        seg = self.current
        start_wall = max(start_wall, seg.wall_start)
        if nbytes <= 0:
            return start_wall
        if seg.trace.total_bits <= 0:
            return math.inf
        t0 = seg.trace_time(start_wall)
        return seg.wall_start + (seg.trace.time_to_deliver(nbytes, t0) - seg.trace_start)

    def next_change(self, wall: float) -> float:
        """Wall time of the next slice boundary of the current segment after ``wall``."""
        seg = self.current
        t = seg.trace_time(max(wall, seg.wall_start))
        tr = seg.trace
        cycles = math.floor(t / tr.duration_s)
        within = t - cycles * tr.duration_s
        idx = int(np.searchsorted(tr.edges_s, within + 1e-12, side="right"))
        nxt = tr.edges_s[idx] if idx < len(tr.edges_s) else tr.duration_s
        return seg.wall_start + (cycles * tr.duration_s + float(nxt) - seg.trace_start)

    def next_rate_change(self, wall: float, horizon_s: float = 60.0) -> float:
        """Wall time after ``wall`` when the rate next differs (``inf`` beyond the horizon)."""
        current = self.rate_at(wall)
        b = self.next_change(wall)
        while b - wall <= horizon_s:
            if self.rate_at(b + 1e-6) != current:
                return b
            b = self.next_change(b + 1e-6)
        return math.inf

    # ------------------------------------------------------------------ changes
    def _push(self, seg: Segment) -> None:
        with self._lock:
            while self._segments and self._segments[-1].wall_start > seg.wall_start:
                self._segments.pop()
                self._starts.pop()
            if self._segments and self._segments[-1].wall_start == seg.wall_start:
                self._segments[-1] = seg
            else:
                self._segments.append(seg)
                self._starts.append(seg.wall_start)
            self.version += 1

    def set_trace(self, trace: Trace, start_s: float = 0.0, at: float | None = None) -> None:
        """From now (or wall time ``at``) on, follow ``trace`` from trace time ``start_s``."""
        if not isinstance(trace, Trace):
            raise LinkError(f"set_trace needs a traces.Trace, got {type(trace).__name__}")
        wall = self._clock() if at is None else float(at)
        self._push(Segment(wall, trace, float(start_s)))

    def set_rate(self, rate_bps: float, at: float | None = None) -> None:
        """From now on, a constant ``rate_bps`` (0 = outage until the next change)."""
        if not (math.isfinite(rate_bps) and rate_bps >= 0):
            raise LinkError(f"link rate must be finite and >= 0 bits/s, got {rate_bps}")
        self.set_trace(Trace.constant(float(rate_bps), 1.0), 0.0, at)

    def restart(self, start_s: float | None = None, at: float | None = None) -> None:
        """Restart the current trace at ``start_s`` (default: its original start) now."""
        seg = self.current
        self.set_trace(seg.trace, seg.trace_start if start_s is None else start_s, at)


class LinkEmulator:
    """What both link emulators offer; subclasses drive ``self.schedule``.

    Common API: ``start()``/``stop()`` (and a context manager), ``set_rate(bps)``,
    ``set_trace(trace, start_s)``, ``restart(start_s)``, ``trace_time()``,
    ``expected_bytes(wall0, wall1)`` and the ``origin`` of trace time.
    """

    schedule: LinkSchedule

    @property
    def trace(self) -> Trace:
        return self.schedule.trace

    @property
    def origin(self) -> float:
        """Monotonic wall time (``time.monotonic()``) of trace time ``start_s``."""
        return self.schedule.origin

    def trace_time(self, wall: float | None = None) -> float:
        return self.schedule.trace_time(wall)

    def rate_bps(self, wall: float | None = None) -> float:
        return self.schedule.rate_at(wall)

    def expected_bytes(self, wall0: float, wall1: float) -> float:
        """Capacity of the link over a monotonic wall-clock window, in bytes (exact)."""
        return self.schedule.expected_bytes(wall0, wall1)

    def set_rate(self, rate_bps: float) -> None:
        self.schedule.set_rate(rate_bps)
        self._changed()

    def set_trace(self, trace: Trace, start_s: float = 0.0) -> None:
        self.schedule.set_trace(trace, start_s)
        self._changed()

    def restart(self, start_s: float | None = None) -> None:
        self.schedule.restart(start_s)
        self._changed()

    def _changed(self) -> None:  # pragma: no cover - overridden
        """Hook: the schedule changed live."""
