"""The :class:`Trace` model: piecewise-constant link capacity over time.

A trace is a sequence of slices. Slice ``i`` starts at ``times_s[i]`` (``times_s[0] == 0``),
ends at ``times_s[i + 1]`` (the last one at ``duration_s``) and carries ``rates_bps[i]`` bits
per second. Every time query loops the trace (time ``t`` means ``t mod duration_s`` plus whole
cycles), like Mahimahi's ``mm-link``. A rate of 0 is an outage: it is data, never an error.

Integrals are exact: ``bytes_between`` sums rate x time over the slices (with looping) and
``time_to_deliver`` inverts that integral, skipping outages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from sakura.traces.errors import TraceError

_EPS = 1e-9


def _frozen(values: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.array(values, dtype=np.float64, copy=True).reshape(-1)
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class Trace:
    """Piecewise-constant capacity (bits/s) over time; immutable; loops when queried.

    Build one with :meth:`from_rates` (uniform slices), :meth:`from_edges`, :meth:`constant`
    or the loaders in :mod:`traces.formats`. ``labels`` optionally names the network of each
    slice (``"5G"``, ``"LTE"``, ``"WiFi"``...), as G-NetTrack's ``NetworkMode`` column does.
    """

    times_s: np.ndarray
    rates_bps: np.ndarray
    duration_s: float
    name: str = "trace"
    labels: tuple[str, ...] | None = None
    source: str = ""
    fmt: str = ""
    _edges: np.ndarray = field(init=False, repr=False, compare=False)
    _cum_bits: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        times = _frozen(self.times_s)
        rates = _frozen(self.rates_bps)
        duration = float(self.duration_s)
        if times.size == 0:
            raise TraceError(f"trace {self.name!r} is empty (no slices)")
        if times.size != rates.size:
            raise TraceError(
                f"trace {self.name!r}: {times.size} slice starts but {rates.size} rates"
            )
        if not np.all(np.isfinite(times)) or abs(times[0]) > _EPS:
            raise TraceError(f"trace {self.name!r}: times_s must be finite and start at 0")
        if np.any(np.diff(times) <= 0):
            raise TraceError(f"trace {self.name!r}: times_s must be strictly increasing")
        if not math.isfinite(duration) or duration <= times[-1]:
            raise TraceError(
                f"trace {self.name!r}: duration_s={duration} must exceed the last slice start "
                f"{times[-1]}"
            )
        if not np.all(np.isfinite(rates)) or np.any(rates < 0):
            raise TraceError(f"trace {self.name!r}: rates_bps must be finite and >= 0")
        labels = self.labels
        if labels is not None:
            labels = tuple(str(x) for x in labels)
            if len(labels) != times.size:
                raise TraceError(
                    f"trace {self.name!r}: {len(labels)} labels for {times.size} slices"
                )
        edges = _frozen(np.append(times, duration))
        cum = _frozen(np.concatenate(([0.0], np.cumsum(rates * np.diff(edges)))))
        object.__setattr__(self, "times_s", times)
        object.__setattr__(self, "rates_bps", rates)
        object.__setattr__(self, "duration_s", duration)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "_edges", edges)
        object.__setattr__(self, "_cum_bits", cum)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_rates(
        cls,
        rates_bps: Sequence[float] | np.ndarray,
        interval_s: float = 1.0,
        name: str = "trace",
        labels: Sequence[str] | None = None,
        **kwargs: str,
    ) -> Trace:
        """Uniform slices of ``interval_s`` seconds, one per rate (bits/s)."""
        rates = np.asarray(rates_bps, dtype=np.float64).reshape(-1)
        if not interval_s > 0:
            raise TraceError(f"interval_s must be > 0, got {interval_s}")
        times = np.arange(rates.size, dtype=np.float64) * float(interval_s)
        return cls(
            times,
            rates,
            rates.size * float(interval_s),
            name=name,
            labels=None if labels is None else tuple(labels),
            **kwargs,
        )

    @classmethod
    def from_edges(
        cls,
        edges_s: Sequence[float] | np.ndarray,
        rates_bps: Sequence[float] | np.ndarray,
        name: str = "trace",
        labels: Sequence[str] | None = None,
        **kwargs: str,
    ) -> Trace:
        """Slices between consecutive ``edges_s`` (n + 1 edges starting at 0, n rates)."""
        edges = np.asarray(edges_s, dtype=np.float64).reshape(-1)
        if edges.size < 2:
            raise TraceError("from_edges needs at least two edges")
        return cls(
            edges[:-1],
            rates_bps,
            float(edges[-1]),
            name=name,
            labels=None if labels is None else tuple(labels),
            **kwargs,
        )

    @classmethod
    def constant(cls, rate_bps: float, duration_s: float = 1.0, name: str = "") -> Trace:
        """A constant-rate trace (loops forever, like Mahimahi's fixed-rate trace)."""
        return cls(
            np.zeros(1),
            np.array([float(rate_bps)]),
            float(duration_s),
            name=name or f"constant-{rate_bps / 1e6:g}Mbps",
        )

    # ------------------------------------------------------------------ basic views
    def __len__(self) -> int:
        return int(self.times_s.size)

    def __repr__(self) -> str:
        return (
            f"Trace(name={self.name!r}, slices={len(self)}, duration_s={self.duration_s:g}, "
            f"mean_mbps={self.mean_bps / 1e6:.3g})"
        )

    @property
    def edges_s(self) -> np.ndarray:
        """Slice boundaries: ``times_s`` followed by ``duration_s`` (read-only array)."""
        return self._edges

    @property
    def widths_s(self) -> np.ndarray:
        """Length of every slice in seconds."""
        return np.diff(self._edges)

    @property
    def interval_s(self) -> float | None:
        """The common slice length when all slices are equally long, else None."""
        widths = self.widths_s
        if np.allclose(widths, widths[0], rtol=1e-9, atol=1e-9):
            return float(widths[0])
        return None

    @property
    def total_bits(self) -> float:
        """Capacity of one pass over the trace, in bits."""
        return float(self._cum_bits[-1])

    @property
    def mean_bps(self) -> float:
        """Time-weighted mean capacity (bits/s)."""
        return self.total_bits / self.duration_s

    # ------------------------------------------------------------------ queries (loop)
    def _wrap(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cycles = np.floor(t / self.duration_s)
        within = t - cycles * self.duration_s
        # Guard float round-off at the cycle boundary.
        over = within >= self.duration_s
        cycles = np.where(over, cycles + 1, cycles)
        within = np.where(over, 0.0, np.maximum(within, 0.0))
        return cycles, within

    def _slice_index(self, within: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.times_s, within, side="right") - 1
        return np.clip(idx, 0, len(self) - 1)

    def rate_at(self, t: float | np.ndarray) -> float | np.ndarray:
        """Capacity (bits/s) at time ``t`` seconds (looping); vectorised over arrays."""
        arr = np.asarray(t, dtype=np.float64)
        _, within = self._wrap(arr)
        rates = self.rates_bps[self._slice_index(within)]
        return float(rates) if np.ndim(rates) == 0 else rates

    def label_at(self, t: float) -> str | None:
        """Network label of the slice at time ``t`` (looping), or None when unlabelled."""
        if self.labels is None:
            return None
        _, within = self._wrap(np.asarray(float(t)))
        return self.labels[int(self._slice_index(within))]

    def cum_bits(self, t: float | np.ndarray) -> float | np.ndarray:
        """Bits deliverable from time 0 to ``t`` (looping; negative t counts backwards)."""
        arr = np.asarray(t, dtype=np.float64)
        cycles, within = self._wrap(arr)
        idx = self._slice_index(within)
        part = self._cum_bits[idx] + self.rates_bps[idx] * (within - self.times_s[idx])
        out = cycles * self.total_bits + part
        return float(out) if np.ndim(out) == 0 else out

    def bits_between(self, t0: float, t1: float) -> float:
        """Exact capacity integral over ``[t0, t1]`` in bits (looping)."""
        if t1 < t0:
            raise TraceError(f"bits_between: t1={t1} is before t0={t0}")
        return max(0.0, float(self.cum_bits(t1)) - float(self.cum_bits(t0)))

    def bytes_between(self, t0: float, t1: float) -> float:
        """Exact capacity integral over ``[t0, t1]`` in bytes (looping)."""
        return self.bits_between(t0, t1) / 8.0

    def time_at_cum_bits(self, target_bits: float) -> float:
        """Earliest time at which ``cum_bits`` reaches ``target_bits`` (inverse integral)."""
        total = self.total_bits
        if total <= 0:
            raise TraceError(f"trace {self.name!r} has zero capacity everywhere")
        k = math.floor(target_bits / total)
        within = target_bits - k * total
        if within <= 0:
            # A whole number of cycles: reached when the last non-zero slice ended.
            return float(self._last_positive_end() + (k - 1) * self.duration_s)
        e = int(np.searchsorted(self._cum_bits, within, side="left"))
        e = min(max(e, 1), len(self))
        rate = self.rates_bps[e - 1]
        t = self._edges[e - 1] + (within - self._cum_bits[e - 1]) / rate
        return float(k * self.duration_s + min(t, self._edges[e]))

    def _last_positive_end(self) -> float:
        positive = np.nonzero(self.rates_bps > 0)[0]
        return float(self._edges[positive[-1] + 1])

    def time_to_deliver(self, nbytes: float, t0: float = 0.0) -> float:
        """Absolute time at which ``nbytes`` sent from ``t0`` at full capacity have arrived.

        Loops the trace and waits through outages. Raises :class:`TraceError` for an
        all-zero trace (the transfer would never complete). ``nbytes <= 0`` returns ``t0``.
        """
        if nbytes <= 0:
            return float(t0)
        if self.total_bits <= 0:
            raise TraceError(
                f"trace {self.name!r} has zero capacity everywhere: {nbytes:g} bytes never arrive"
            )
        target = float(self.cum_bits(t0)) + 8.0 * float(nbytes)
        return max(float(t0), self.time_at_cum_bits(target))

    def transfer_time(self, nbytes: float, t0: float = 0.0) -> float:
        """Seconds a transfer of ``nbytes`` starting at ``t0`` takes at capacity."""
        return self.time_to_deliver(nbytes, t0) - float(t0)

    # ------------------------------------------------------------------ transforms
    def _replace(self, **changes: object) -> Trace:
        kwargs: dict[str, object] = {
            "times_s": self.times_s,
            "rates_bps": self.rates_bps,
            "duration_s": self.duration_s,
            "name": self.name,
            "labels": self.labels,
            "source": self.source,
            "fmt": self.fmt,
        }
        kwargs.update(changes)
        return Trace(**kwargs)  # type: ignore[arg-type]

    def window(self, t0: float, t1: float, name: str | None = None) -> Trace:
        """The looped trace between absolute times ``t0 < t1``, re-based to start at 0."""
        if not t1 > t0:
            raise TraceError(f"window: end {t1} must be after start {t0}")
        d = self.duration_s
        k0 = math.floor(t0 / d)
        k1 = math.ceil(t1 / d)
        starts: list[np.ndarray] = []
        rates: list[np.ndarray] = []
        labels: list[str] = []
        for k in range(k0, k1):
            base = k * d
            lo = max(t0, base)
            hi = min(t1, base + d)
            if hi - lo <= _EPS:
                continue
            i0 = int(self._slice_index(np.asarray(lo - base)))
            i1 = int(np.searchsorted(self.times_s, hi - base, side="left"))
            idx = np.arange(i0, max(i1, i0 + 1))
            s = np.maximum(self.times_s[idx] + base, lo) - t0
            starts.append(s)
            rates.append(self.rates_bps[idx])
            if self.labels is not None:
                labels.extend(self.labels[i] for i in idx)
        times = np.concatenate(starts)
        keep = np.concatenate(([True], np.diff(times) > _EPS))
        times = times[keep]
        rate_arr = np.concatenate(rates)[keep]
        label_t = tuple(lab for lab, ok in zip(labels, keep) if ok) if self.labels else None
        times[0] = 0.0
        return self._replace(
            times_s=times,
            rates_bps=rate_arr,
            duration_s=t1 - t0,
            labels=label_t,
            name=name if name is not None else f"{self.name}[{t0:g}:{t1:g}]",
        )

    def slice(self, start_s: float, duration_s: float | None = None) -> Trace:
        """The trace from ``start_s`` for ``duration_s`` seconds (default: to the end).

        ``start_s`` wraps into the trace; a duration beyond the end loops the trace.
        """
        start = float(start_s) % self.duration_s
        length = self.duration_s - start if duration_s is None else float(duration_s)
        if not length > 0:
            raise TraceError(f"slice duration must be > 0, got {length}")
        return self.window(start, start + length)

    def looped(self, total_s: float | None = None) -> Trace:
        """An explicit trace of ``total_s`` seconds made by repeating this one.

        Every query already loops, so without ``total_s`` this returns the trace itself.
        """
        if total_s is None:
            return self
        return self.window(0.0, float(total_s), name=f"{self.name}*loop{total_s:g}s")

    def scaled(self, factor: float) -> Trace:
        """Every rate multiplied by ``factor`` (>= 0); dynamics and outages kept."""
        if not (math.isfinite(factor) and factor >= 0):
            raise TraceError(f"scale factor must be finite and >= 0, got {factor}")
        return self._replace(
            rates_bps=self.rates_bps * float(factor), name=f"{self.name}x{factor:g}"
        )

    def renamed(self, name: str) -> Trace:
        """The same trace under another name."""
        return self._replace(name=name)

    def with_labels(self, label: str) -> Trace:
        """The same trace with every slice labelled ``label``."""
        return self._replace(labels=(label,) * len(self))

    def concat(self, other: Trace) -> Trace:
        """This trace followed by ``other`` (e.g. mixed 4G + 5G)."""
        return Trace.concatenate([self, other])

    @staticmethod
    def concatenate(traces: Iterable[Trace], name: str | None = None) -> Trace:
        """Traces one after another; labels are kept (unlabelled slices get ``""``)."""
        items = list(traces)
        if not items:
            raise TraceError("concatenate needs at least one trace")
        offsets = np.cumsum([0.0] + [t.duration_s for t in items[:-1]])
        times = np.concatenate([t.times_s + off for t, off in zip(items, offsets)])
        rates = np.concatenate([t.rates_bps for t in items])
        labels: tuple[str, ...] | None = None
        if any(t.labels is not None for t in items):
            labels = tuple(lab for t in items for lab in (t.labels if t.labels else ("",) * len(t)))
        fmts = {t.fmt for t in items}
        return Trace(
            times,
            rates,
            float(sum(t.duration_s for t in items)),
            name=name or "+".join(t.name for t in items),
            labels=labels,
            fmt=fmts.pop() if len(fmts) == 1 else "mixed",
        )

    def select(self, label: str) -> Trace:
        """Only the slices labelled ``label``, joined end to end (time gaps removed)."""
        if self.labels is None:
            raise TraceError(f"trace {self.name!r} has no per-slice network labels")
        mask = np.array([lab == label for lab in self.labels])
        if not mask.any():
            raise TraceError(f"trace {self.name!r} has no slice labelled {label!r}")
        widths = self.widths_s[mask]
        edges = np.concatenate(([0.0], np.cumsum(widths)))
        return Trace.from_edges(
            edges,
            self.rates_bps[mask],
            name=f"{self.name}[{label}]",
            labels=[label] * int(mask.sum()),
            source=self.source,
            fmt=self.fmt,
        )

    def resampled(self, window_s: float) -> Trace:
        """Mean capacity over consecutive windows of ``window_s`` (last one may be shorter).

        Labels become the label covering most of each window.
        """
        if not window_s > 0:
            raise TraceError(f"window_s must be > 0, got {window_s}")
        n = max(1, math.ceil(self.duration_s / window_s - 1e-9))
        edges = np.minimum(np.arange(n + 1) * float(window_s), self.duration_s)
        edges[-1] = self.duration_s
        keep = np.concatenate(([True], np.diff(edges) > _EPS))
        edges = edges[keep]
        bits = np.diff(np.asarray(self.cum_bits(edges)))
        rates = np.maximum(bits / np.diff(edges), 0.0)
        labels = None
        if self.labels is not None:
            mids = (edges[:-1] + edges[1:]) / 2
            labels = [self.labels[int(i)] for i in self._slice_index(mids)]
        return Trace.from_edges(
            edges, rates, name=self.name, labels=labels, source=self.source, fmt=self.fmt
        )

    # ------------------------------------------------------------------ statistics
    def stats(self, window_s: float = 1.0) -> dict[str, float | int | str]:
        """The numbers people quote, over windows of ``window_s`` seconds (default 1 s).

        ``mean_mbps`` is the exact time-weighted mean. ``median/p10/p90_mbps`` are
        percentiles of the per-window mean rates. ``outage_fraction`` is the fraction of
        windows with zero capacity (for 1-s traces: the fraction of zero-rate seconds).
        """
        per_window = self.resampled(window_s) if self.interval_s != window_s else self
        rates_mbps = per_window.rates_bps / 1e6
        weights = per_window.widths_s
        return {
            "name": self.name,
            "format": self.fmt,
            "duration_s": round(self.duration_s, 6),
            "slices": len(self),
            "mean_mbps": self.mean_bps / 1e6,
            "median_mbps": float(np.percentile(rates_mbps, 50)),
            "p10_mbps": float(np.percentile(rates_mbps, 10)),
            "p90_mbps": float(np.percentile(rates_mbps, 90)),
            "min_mbps": float(rates_mbps.min()),
            "max_mbps": float(rates_mbps.max()),
            "outage_fraction": float(weights[rates_mbps <= 0].sum() / weights.sum()),
        }

    # ------------------------------------------------------------------ sampling
    def sample_starts(self, n: int, seed: int = 0, span_s: float = 0.0) -> np.ndarray:
        """``n`` reproducible start offsets (seconds, rounded to 1 ms), seeded.

        Starts are uniform in ``[0, duration_s - span_s]`` so that a run of ``span_s``
        seconds fits without looping; if the span is longer than the trace they are uniform
        over the whole trace (the run then loops). Same (n, seed, duration, span) -> same
        starts, on every machine.
        """
        if n < 0:
            raise TraceError(f"number of start points must be >= 0, got {n}")
        hi = self.duration_s - float(span_s)
        if hi <= 0:
            hi = self.duration_s
        rng = np.random.default_rng(int(seed))
        starts = np.round(rng.uniform(0.0, hi, size=int(n)), 3)
        return np.minimum(starts, np.nextafter(self.duration_s, 0.0))
