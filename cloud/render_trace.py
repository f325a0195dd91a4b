"""Arrival traces for the render engine: seeded Poisson and bursty arrivals, trace files,
and a replay that submits each request at its arrival time and measures latency and
throughput.

A trace is a list of :class:`Arrival` (seconds from the start, a prompt, a seed). Files
are JSON lines ``{"t": 0.12, "prompt": "...", "seed": 3}`` or CSV with a header
``t,prompt,seed``.
"""

from __future__ import annotations

import csv
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from sakura.cloud.render import RenderEngine
from sakura.cloud.render_api import RenderError, RenderRequest, RenderResult


@dataclass(frozen=True)
class Arrival:
    t: float
    prompt: str
    seed: int


def poisson_arrivals(n: int, rate: float, prompts: list[str], seed: int = 0) -> list[Arrival]:
    """``n`` arrivals of a Poisson process of ``rate`` requests/s (exponential gaps)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(Arrival(t, prompts[i % len(prompts)], seed * 1000 + i))
        t += rng.expovariate(rate)
    return out


def bursty_arrivals(n: int, rate: float, prompts: list[str], burst: int = 4,
                    jitter_s: float = 0.02, seed: int = 0) -> list[Arrival]:
    """Bursts of about ``burst`` requests (within ``jitter_s``) at Poisson burst times, mean
    rate ``rate`` requests/s overall: the load shape FlashDiff's scheduler is for."""
    rng = random.Random(seed)
    t, out, i = 0.0, [], 0
    while i < n:
        size = min(n - i, max(1, round(rng.gauss(burst, burst / 4))))
        for _ in range(size):
            out.append(Arrival(t + rng.uniform(0, jitter_s), prompts[i % len(prompts)],
                               seed * 1000 + i))
            i += 1
        t += rng.expovariate(rate / burst)
    out.sort(key=lambda a: a.t)
    return out


def load_trace(path: str | Path) -> list[Arrival]:
    """Read a trace file (JSON lines or CSV with ``t,prompt,seed``)."""
    path = Path(path)
    if not path.exists():
        raise RenderError(f"trace not found: {path}")
    out = []
    try:
        if path.suffix == ".csv":
            with path.open(newline="") as f:
                for row in csv.DictReader(f):
                    out.append(Arrival(float(row["t"]), row["prompt"], int(row["seed"])))
        else:
            for line in path.read_text().splitlines():
                if line.strip():
                    d = json.loads(line)
                    out.append(Arrival(float(d["t"]), str(d["prompt"]), int(d["seed"])))
    except (KeyError, ValueError, TypeError) as exc:
        raise RenderError(f"{path}: not a render trace ({exc})") from exc
    return sorted(out, key=lambda a: a.t)


def save_trace(trace: list[Arrival], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps({"t": a.t, "prompt": a.prompt, "seed": a.seed})
                                  + "\n" for a in trace))


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``xs``, linearly interpolated; nan when empty."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = q / 100 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class ReplayResult:
    results: list[RenderResult]
    makespan_s: float

    @property
    def latencies(self) -> list[float]:
        return [r.latency_s for r in self.results]

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)

    @property
    def throughput_rps(self) -> float:
        return len(self.results) / self.makespan_s if self.makespan_s > 0 else 0.0

    def summary(self) -> dict:
        return {"requests": len(self.results), "makespan_s": self.makespan_s,
                "throughput_rps": self.throughput_rps, "p50_latency_s": self.percentile(50),
                "p90_latency_s": self.percentile(90), "p99_latency_s": self.percentile(99),
                "skipped_fraction": (sum(r.stats["skipped_fraction"] for r in self.results)
                                     / max(1, len(self.results)))}


def replay(engine: RenderEngine, trace: list[Arrival],
           make_request: Callable[[Arrival], RenderRequest], timeout_s: float = 3600.0,
           time_scale: float = 1.0) -> ReplayResult:
    """Submit every arrival at ``t * time_scale`` seconds after the start; wait for all.

    Makespan = first arrival to last completion; latency = completion - submission.
    """
    futures = []
    start = time.monotonic()
    for a in trace:
        delay = start + a.t * time_scale - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(engine.submit(make_request(a)))
    results = [f.result(timeout=timeout_s) for f in futures]
    end = max(r.finish for r in results) if results else start
    first = min(r.arrival for r in results) if results else start
    return ReplayResult(results, end - first)


def request_factory(base: RenderRequest) -> Callable[[Arrival], RenderRequest]:
    """Requests like ``base`` with each arrival's prompt and seed."""
    return lambda a: replace(base, prompt=a.prompt, seed=a.seed)


__all__ = ["Arrival", "ReplayResult", "bursty_arrivals", "load_trace", "percentile",
           "poisson_arrivals", "replay", "request_factory", "save_trace"]
