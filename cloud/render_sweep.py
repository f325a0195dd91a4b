"""``load_sweep`` (issue 32): regional serving against full serving over offered load.

One engine (``workers`` processes, one torch thread each) serves both modes. Full
execution's capacity is measured first (``workers`` full requests at once, as
``serving_bench`` and ``slo_bench`` do: :func:`sakura.cloud.render_slo.full_service_s`), and
the R search's exploration is spent untimed. Then, for every offered load in ``loads``
(multiples of that capacity) and every arrival seed, the same seeded bursty trace
(``render_trace.bursty_arrivals``, ``requests`` arrivals) is replayed in full and in
regional mode, in alternating order from seed to seed so that neither mode always runs on
the warmer engine.

Per load (a list entry):

- ``throughput_ratio_vs_full``: regional requests/s over full requests/s, each the mean
  over the seeds' replays;
- ``p90_latency_ratio_vs_full``: the p90 of all regional latencies over the p90 of all
  full latencies (pooled over the seeds);
- ``served_psnr_db_vs_full``: every served regional image against the served full image
  of the same arrival (pooled squared error): the quality the throughput was bought with;
- ``ci95``: a percentile bootstrap over the seeds (the replays are the independent units;
  ``BOOTSTRAP`` resamples, seeded) of each of the three. With 3 seeds it is coarse, and it
  says so by being wide.

The issue's target: ``throughput_ratio_vs_full >= 1.5`` with ``served_psnr_db_vs_full >= 30``
at loads 2 and 3. Under a load below 1 both modes keep up with the arrivals, so the
throughput ratio is near 1 there by construction; the latency ratio is what regional
serving buys at low load.
"""

from __future__ import annotations

import os
import random
import statistics
from dataclasses import dataclass, field, replace

from sakura.cloud.render import RenderEngine
from sakura.cloud.render_api import EngineConfig, RenderRequest
from sakura.cloud.render_slo import full_service_s, warm_search
from sakura.cloud.render_trace import (
    ReplayResult,
    bursty_arrivals,
    percentile,
    replay,
    request_factory,
)
from sakura.dit.regional import RegionalConfig
from sakura.dit.regional_bench import ImageAccumulator, psnr_from_mse

LOADS = (0.5, 1.0, 2.0, 3.0)  # issue 32: offered load in multiples of full's capacity
BOOTSTRAP = 2000  # resamples of the seeds for ci95


def served_images(full: list[ReplayResult], regional: list[ReplayResult]) -> ImageAccumulator:
    """Every served regional image against the served full image of the same arrival (the
    replays share one trace, so their results pair up in trace order)."""
    acc = ImageAccumulator()
    for f, g in zip(full, regional):
        for a, b in zip(f.results, g.results):
            if a.image is not None and b.image is not None:
                acc.add(b.image, a.image, b.stats["skipped_fraction"],
                        b.stats.get("compute_fraction", 1.0))
    return acc


@dataclass
class SeedPair:
    """One arrival seed's full and regional replays, reduced to what the figures need."""

    full_rps: float
    regional_rps: float
    full_latency_s: list[float]
    regional_latency_s: list[float]
    se: float  # squared error of the served regional images against the full ones
    count: int  # values compared
    compute_fraction: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, full: ReplayResult, regional: ReplayResult) -> SeedPair:
        acc = served_images([full], [regional])
        return cls(full.throughput_rps, regional.throughput_rps, full.latencies,
                   regional.latencies, acc.se, acc.count,
                   [r.stats.get("compute_fraction", 1.0) for r in regional.results])


def figures(pairs: list[SeedPair]) -> dict[str, float]:
    """The three pooled figures of a set of seeds' replays."""
    full_rps = statistics.fmean(p.full_rps for p in pairs)
    reg_rps = statistics.fmean(p.regional_rps for p in pairs)
    full_p90 = percentile([x for p in pairs for x in p.full_latency_s], 90)
    reg_p90 = percentile([x for p in pairs for x in p.regional_latency_s], 90)
    count = sum(p.count for p in pairs)
    return {
        "throughput_ratio_vs_full": reg_rps / full_rps if full_rps > 0 else float("nan"),
        "p90_latency_ratio_vs_full": reg_p90 / full_p90 if full_p90 > 0 else float("nan"),
        "served_psnr_db_vs_full": (psnr_from_mse(sum(p.se for p in pairs) / count)
                                   if count else float("nan")),
    }


def bootstrap_ci95(pairs: list[SeedPair], resamples: int = BOOTSTRAP,
                   seed: int = 0) -> dict[str, list[float]]:
    """Percentile bootstrap over the seeds: ``{figure: [lo, hi]}``."""
    rng = random.Random(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(resamples):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        for k, v in figures(sample).items():
            draws.setdefault(k, []).append(v)
    return {k: [percentile(v, 2.5), percentile(v, 97.5)] for k, v in draws.items()}


def load_sweep(weights: str | None, encoder, prompts: list[str], cfg: RegionalConfig, *,
               workers: int = 2, requests: int = 48, seeds: int = 3, steps: int = 10,
               size: int = 64, loads: tuple[float, ...] = LOADS) -> list[dict]:
    """The ``load_sweep`` key (module docstring), a list with one entry per load; each
    entry also carries the sweep's conditions (service time, load average)."""
    full = RenderRequest(steps=steps, size=size, guidance=3.0, mode="full")
    regional = replace(full, mode="regional")
    ecfg = EngineConfig(workers=workers, weights=weights, regional=cfg, quality_eps=None)
    conditions = {"workers": workers, "steps": steps, "size": size,
                  "trace": f"bursty (seeded): bursts of ~{max(2, requests // 4)} at Poisson "
                           "times",
                  "ci95_method": f"percentile bootstrap over the seeds ({BOOTSTRAP} "
                                 "resamples)"}
    entries = []
    with RenderEngine(ecfg, encoder) as eng:
        service = full_service_s(eng, full, prompts, workers)
        warm_search(eng, regional, prompts)
        for load in loads:
            rate = load * workers / service
            pairs = []
            for s in range(seeds):
                trace = bursty_arrivals(requests, rate, prompts, burst=max(2, requests // 4),
                                        seed=s)
                modes = (full, regional) if s % 2 == 0 else (regional, full)
                reps = {m.mode: replay(eng, trace, request_factory(m)) for m in modes}
                pairs.append(SeedPair.of(reps["full"], reps["regional"]))
            entries.append({
                "load": load, "requests": requests, "seeds": seeds, **figures(pairs),
                "ci95": bootstrap_ci95(pairs), "arrival_rate_rps": rate,
                "full_request_service_s": service,
                "compute_fraction": statistics.fmean(x for p in pairs
                                                     for x in p.compute_fraction),
                **conditions, "load_average": list(os.getloadavg())})
    return entries


__all__ = ["BOOTSTRAP", "LOADS", "SeedPair", "bootstrap_ci95", "figures", "load_sweep",
           "served_images"]
