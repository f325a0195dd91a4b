"""The render engine's online policy: the patch count R searched from what requests cost
and how well they came out, and the quality mode under low load. Pure logic.

FlashDiff searches R online from observed latency, quality and load instead of fixing it
per request. Here every finished regional request reports

* its **cost per step**: the seconds workers spent computing its tasks, plus the time its
  K/V spent moving between the engine and the workers (sending, unpickling and applying
  the replica syncs), plus the engine loop's own time on its tasks (building and
  applying them), divided by its steps: what a request costs the service, not its
  queueing;
* its **reuse error**: the mean relative difference between a re-run patch's fresh
  velocity and the one it reused while skipped (``RegionalStats.reuse_error``), the
  quality signal available online (no full-execution reference exists while serving).

:class:`PatchCountSearch` keeps those per candidate R and scores

    score(R) = cost(R) / min_R cost(R) * (1 + quality_weight * reuse_error(R))

It is a bounded descent over the sorted candidates, which assumes the score is unimodal
in R (more patches: finer regions, more skipping, but more calls and more K/V moved per
step): it starts at the middle candidate, tries it and its two neighbours ``trials`` times
each (once by default: under concurrent arrivals the choices are handed out before any
request finishes), moves to a neighbour that scores lower and tries that one's other
neighbour, and stops where no neighbour scores lower. So it evaluates at most every
candidate, usually three. Every ``explore_every``-th choice re-tries the least-observed
neighbour of the current R, so that a change in the workload moves it again. Under **low load** (active requests per worker at most
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
    start: int | None = None              # where the descent starts (None: the middle R)
    obs: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    choices: int = 0
    history: list[int] = field(default_factory=list)
    at: int = -1                          # index of the current candidate

    def __post_init__(self) -> None:
        if not self.candidates or any(r < 1 for r in self.candidates):
            raise ValueError("candidates must be patch counts >= 1")
        self.candidates = tuple(sorted(set(self.candidates)))
        if self.start is not None and self.start not in self.candidates:
            raise ValueError(f"start must be one of the candidates {self.candidates}")
        self.at = (self.candidates.index(self.start) if self.start is not None
                   else (len(self.candidates) - 1) // 2)

    def observe(self, patches: int, cost_s_per_step: float, reuse_error: float) -> None:
        if patches not in self.candidates:
            return
        o = self.obs[patches]
        o.append((float(cost_s_per_step), float(reuse_error)))
        del o[:-self.window]

    def scores(self) -> dict[int, float]:
        seen = {r: o for r, o in self.obs.items() if o}
        if not seen:
            return {}
        cost = {r: sum(c for c, _ in o) / len(o) for r, o in seen.items()}
        error = {r: sum(e for _, e in o) / len(o) for r, o in seen.items()}
        best = min(cost.values()) or 1e-12
        return {r: cost[r] / best * (1 + self.quality_weight * error[r]) for r in seen}

    def _neighbours(self) -> list[int]:
        return [i for i in (self.at - 1, self.at + 1) if 0 <= i < len(self.candidates)]

    def _descend(self) -> None:
        """Move to the lower-scoring neighbour while one scores below the current R
        (each move lowers the score, so this ends; on a unimodal cost it ends at the
        minimum)."""
        while True:
            sc = self.scores()
            cur = self.candidates[self.at]
            better = [i for i in self._neighbours()
                      if cur in sc and self.candidates[i] in sc
                      and sc[self.candidates[i]] < sc[cur]]
            if not better:
                return
            self.at = min(better, key=lambda i: sc[self.candidates[i]])

    def choose(self) -> int:
        """R for the next request."""
        self.choices += 1
        self._descend()
        # the current R and its neighbours are each handed out `trials` times first
        for i in [self.at, *self._neighbours()]:
            if self.history.count(self.candidates[i]) < self.trials:
                return self._pick(self.candidates[i])
        nb = self._neighbours()
        if nb and self.explore_every and self.choices % self.explore_every == 0:
            counts = {i: len(self.obs.get(self.candidates[i], ())) for i in nb}
            return self._pick(self.candidates[min(nb, key=lambda i: (counts[i], i))])
        return self._pick(self.candidates[self.at])

    def _pick(self, r: int) -> int:
        self.history.append(r)
        return r

    def to_dict(self) -> dict:
        return {"candidates": list(self.candidates), "choices": self.choices,
                "observations": {r: len(o) for r, o in self.obs.items()},
                "scores": self.scores(), "current": self.candidates[self.at],
                "chosen": {r: self.history.count(r) for r in self.candidates}}


def quality_mode(active_requests: int, workers: int, low_load: float) -> bool:
    """Whether the load is low enough to spend spare capacity on quality."""
    return workers > 0 and active_requests / workers <= low_load


__all__ = ["PatchCountSearch", "quality_mode"]
