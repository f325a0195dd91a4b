"""Rate memory: what the device knows about each origin's link between edits.

An app's second edit is the normal case. The device keeps, per origin (scheme://host:port),
the last rate estimate with the wall-clock time it was measured and the last request
latency, in the device state (``state.json``), across processes. The prior of the next
edit's first shards is that estimate *decayed toward a conservative fraction of itself*:

    prior(age) = rate * FLOOR ** (1 - 0.5 ** (age / HALF_LIFE_S))

so a fresh estimate is used as measured, an old one shrinks to ``FLOOR`` x itself, and
none ever vanishes. Before this rule an estimate expired after 10 s: a second ``sakura
edit`` a minute later revalidated its manifest with a 304 (no body to time), had no prior,
and sent its first 11 shards at the smallest configuration (23.7 dB against 34.2 dB for
the first edit, issue 28). The edit's own transfers (the manifest, the first shards)
replace the prior within ``rate_window`` samples (:class:`edge.monitor.BandwidthMonitor`),
so a prior that is too high costs the first shards' quality (their transfers are cut at the
deadline), one that is too low only their first configurations.

The constants come from the Lumos5G 5G traces in ``../shared/traces``: the measurement is
:func:`trace_memory_stats` (``tests/edge/test_state.py`` re-runs it on the real traces and
checks the rule against it). Of the ratio of the rate ``age`` seconds later to the rate
now, the 25th percentile falls from 1 at age 0 toward about 0.2 after five minutes; the
rule follows it (the link is at least as fast as the prior about 3 times in 4, at any age),
so a remembered rate is conservative but never useless.

Nothing request-specific is kept here: only origins, rates, latencies and times.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sakura.edge.monitor import BandwidthMonitor

# the 25th percentile of rate(t + age) / rate(t) over the 91 Lumos5G 5G traces
# (trace_memory_stats at 1 s resolution): 0.88 at 1 s, 0.81 at 5 s, 0.73 at 10 s, 0.47 at
# 30 s, 0.37 at 60 s, 0.31 at 120 s, 0.20 at 300 s; the median stays 0.97-1.04 up to 120 s.
# The rule below with these two constants gives 0.96, 0.84, 0.72, 0.45, 0.30, 0.22, 0.20.
FLOOR = 0.2
HALF_LIFE_S = 30.0


def origin_of(url: str) -> str:
    """``scheme://host:port`` of ``url``, lower-cased: the key of the rate memory."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


@dataclass
class OriginRate:
    """The last estimate against one origin (``at``: ``time.time()`` when measured)."""

    rate_bps: float
    at: float
    latency_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"rate_bps": self.rate_bps, "at": self.at, "latency_s": self.latency_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OriginRate:
        rate, at = float(d["rate_bps"]), float(d["at"])
        if not (math.isfinite(rate) and rate > 0 and math.isfinite(at)):
            raise ValueError("not a rate")
        lat = d.get("latency_s")
        return cls(rate, at, None if lat is None else float(lat))


def decayed(rate_bps: float, age_s: float, floor: float = FLOOR,
            half_life_s: float = HALF_LIFE_S) -> float:
    """``rate_bps`` measured ``age_s`` ago, as a prior now (see the module docstring); an
    age below 0 (a clock set back) counts as old."""
    if age_s < 0:
        age_s = math.inf
    return rate_bps * floor ** (1.0 - 0.5 ** (age_s / half_life_s))


class RateMemory:
    """Per-origin rate estimates with their age (the device state's ``rates``)."""

    def __init__(self, entries: Mapping[str, OriginRate] | None = None, *,
                 floor: float = FLOOR, half_life_s: float = HALF_LIFE_S,
                 clock: Any = time.time) -> None:
        if not (0 < floor <= 1 and half_life_s > 0):
            raise ValueError("floor must be in (0, 1] and half_life_s > 0")
        self.entries: dict[str, OriginRate] = dict(entries or {})
        self.floor, self.half_life_s, self.clock = floor, half_life_s, clock

    def prior_bps(self, server: str, now: float | None = None) -> float | None:
        """The prior of an edit against ``server`` now: its decayed estimate, or None for
        an origin never measured."""
        e = self.entries.get(origin_of(server))
        if e is None:
            return None
        age = (self.clock() if now is None else now) - e.at
        return decayed(e.rate_bps, age, self.floor, self.half_life_s)

    def latency_s(self, server: str) -> float | None:
        e = self.entries.get(origin_of(server))
        return None if e is None else e.latency_s

    def remember(self, server: str, rate_bps: float | None, latency_s: float | None = None,
                 now: float | None = None) -> None:
        """A fresh estimate against ``server`` (None or not positive: nothing learnt)."""
        key = origin_of(server)
        at = self.clock() if now is None else now
        if rate_bps is None or not math.isfinite(rate_bps) or rate_bps <= 0:
            if latency_s is not None and key in self.entries:
                self.entries[key].latency_s = latency_s
            return
        old = self.entries.get(key)
        lat = latency_s if latency_s is not None else (old.latency_s if old else None)
        self.entries[key] = OriginRate(float(rate_bps), at, lat)

    def observe_fetch(self, server: str, got: Any) -> None:
        """A manifest request (``client.ManifestFetch``): a body is a rate sample (timed
        as the monitor times a lone transfer); a 304 moves no body and gives the request
        latency only, which keeps the estimate's age (it measured no rate)."""
        latency = max(0.0, float(got.first_byte) - float(got.start))
        if got.cached or not got.size:
            self.remember(server, None, latency)
            return
        monitor = BandwidthMonitor(1)
        monitor.record(None, got.size, got.start, got.first_byte, got.end)
        self.remember(server, monitor.estimate_bps(), latency)

    def observe_edit(self, server: str, monitor: Any,
                     timeline: Sequence[Mapping[str, Any]]) -> None:
        """The estimate a streamed edit ended with (its last ``k`` transfers)."""
        rate = monitor.estimate_bps()
        latency = monitor.latency_s()
        self.remember(server, rate, latency if latency > 0 else None)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict[str, Any]:
        return {k: v.to_dict() for k, v in sorted(self.entries.items())}

    @classmethod
    def from_json(cls, doc: Any, **kw: Any) -> RateMemory:
        """From ``to_json``'s form; damaged entries are dropped, never trusted."""
        entries = {}
        if isinstance(doc, Mapping):
            for k, v in doc.items():
                try:
                    entries[str(k)] = OriginRate.from_dict(v)
                except (TypeError, ValueError, KeyError):
                    continue
        return cls(entries, **kw)


def trace_memory_stats(rates: Sequence[Sequence[float]], dt_s: float,
                       ages_s: Sequence[float], quantile: float = 0.25
                       ) -> dict[float, float]:
    """The ``quantile`` of ``rate(t + age) / rate(t)`` over every trace and ``t`` where
    both are positive, per age: how far below a remembered rate the link is, ``quantile``
    of the time, that long after (the measurement behind :data:`FLOOR` and
    :data:`HALF_LIFE_S`)."""
    import numpy as np

    out = {}
    for age in ages_s:
        lag = max(1, int(round(age / dt_s)))
        ratios = []
        for r in rates:
            a = np.asarray(r, dtype=float)
            if len(a) <= lag:
                continue
            now, later = a[:-lag], a[lag:]
            ok = (now > 0) & (later > 0)
            ratios.append(later[ok] / now[ok])
        joined = np.concatenate(ratios) if ratios else np.array([1.0])
        out[float(age)] = float(np.quantile(joined, quantile))
    return out
