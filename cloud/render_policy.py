"""The render engine's online policy: the patch count R searched from what requests cost
and how well they came out, and the quality mode under low load. Pure logic.

FlashDiff searches R online from observed latency, quality and load instead of fixing it
per request. Here every finished regional request reports

* its **service time per step**: the seconds workers spent on its tasks (its own compute,
  not its queueing), divided by its steps;
* its **reuse error**: the mean relative difference between a re-run patch's fresh
  velocity and the one it reused while skipped (``RegionalStats.reuse_error``), the
  quality signal available online (no full-execution reference exists while serving).

:class:`PatchCountSearch` keeps those per candidate R. It first tries every candidate
``trials`` times (round robin; once by default: under concurrent arrivals the choices are
handed out before any request finishes, so each extra trial round spends another
len(candidates) requests on exploration), then picks the R with the smallest

    score(R) = service(R) / min_R service(R) * (1 + quality_weight * reuse_error(R))

re-trying the least-observed candidate every ``explore_every``-th choice so that a change
in the workload is noticed. Under **low load** (active requests per worker at most
``low_load``) the engine switches a request's gate to ``quality_eps`` at its next step
boundary (``quality_eps = 0``: every patch runs every step, i.e. full quality) and back
as soon as the load rises: spare capacity is spent on quality, none is taken from
throughput.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class PatchCountSearch:
    """Online choice of the patch count R (see the module doc)."""

    candidates: tuple[int, ...] = (2, 4, 6, 8)
    trials: int = 1
    explore_every: int = 8
    quality_weight: float = 1.0
    window: int = 16                      # observations kept per candidate (recent ones)
    obs: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    choices: int = 0
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.candidates or any(r < 1 for r in self.candidates):
            raise ValueError("candidates must be patch counts >= 1")

    def observe(self, patches: int, service_s_per_step: float, reuse_error: float) -> None:
        if patches not in self.candidates:
            return
        o = self.obs[patches]
        o.append((float(service_s_per_step), float(reuse_error)))
        del o[:-self.window]

    def scores(self) -> dict[int, float]:
        seen = {r: o for r, o in self.obs.items() if o}
        if not seen:
            return {}
        service = {r: sum(s for s, _ in o) / len(o) for r, o in seen.items()}
        error = {r: sum(e for _, e in o) / len(o) for r, o in seen.items()}
        best = min(service.values()) or 1e-12
        return {r: service[r] / best * (1 + self.quality_weight * error[r]) for r in seen}

    def choose(self) -> int:
        """R for the next request."""
        self.choices += 1
        counts = {r: len(self.obs.get(r, ())) for r in self.candidates}
        # exploration: every candidate handed out `trials` times first, round robin
        for _ in range(self.trials):
            for r in self.candidates:
                if self.history.count(r) <= _:
                    return self._pick(r)
        if self.explore_every and self.choices % self.explore_every == 0:
            return self._pick(min(self.candidates, key=lambda r: (counts[r], r)))
        scores = self.scores()
        if not scores:
            return self._pick(self.candidates[0])
        return self._pick(min(scores, key=lambda r: (scores[r], r)))

    def _pick(self, r: int) -> int:
        self.history.append(r)
        return r

    def to_dict(self) -> dict:
        return {"candidates": list(self.candidates), "choices": self.choices,
                "observations": {r: len(o) for r, o in self.obs.items()},
                "scores": self.scores(), "chosen": {r: self.history.count(r)
                                                    for r in self.candidates}}


def quality_mode(active_requests: int, workers: int, low_load: float) -> bool:
    """Whether the load is low enough to spend spare capacity on quality."""
    return workers > 0 and active_requests / workers <= low_load


__all__ = ["PatchCountSearch", "quality_mode"]
