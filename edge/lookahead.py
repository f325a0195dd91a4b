"""Tail-aware allocation: choose a shard's configuration with the next shards' deadlines in view.

The greedy rule (:class:`~edge.allocator.AdaptiveAllocator` without a lookahead) gives shard
``j`` the best configuration that fits ``rate x window_j``. The window of ``j`` is also the
time the link needs for ``j + 1, j + 2, ...``: after a dip (or with a startup allowance)
greedy spends the whole slack on the shard at hand and the next shards, whose windows are
one execution slot each, drop to the smallest configuration. Those are often early-step
shards, which the edit is most sensitive to.

The lookahead plans the next ``horizon`` shards at once and commits only the first choice
(receding horizon: the plan is made again at every shard with a fresh rate estimate):

* **objective**: the edit's error, as the sum over shards of each configuration's output
  MSE, ``10^(-psnr_db / 10)`` (``psnr_db``: the output PSNR with only that shard changed,
  measured per configuration when the pack was built, ``cloud/psnr_profile.py``). Errors of
  different shards add to first order, so this weighs every shard by its measured effect on
  the image: early steps, whose errors the later steps carry, count more. Without a PSNR
  profile, the codec's ``weighted_err`` is the cost (no step weighting), and with neither the
  lookahead is off;
* **constraints**: the link delivers the bytes in request order, so the bytes of shards
  ``j..m`` must fit ``budget_bytes(window_j + slots_j..m-1)`` for every ``m`` in the
  horizon (``slots``: the predicted execution time of each shard, the time the link gains
  per shard);
* **solver**: a dynamic program over the cumulative bytes in ``BINS`` steps of the last
  shard's budget (sizes rounded up, so a plan never exceeds a budget), ``horizon x BINS x
  configurations`` operations: on the demo's face-technologist pack (40 shards, up to 28
  Pareto configurations) 0.025 ms per choice in C++ and 0.74 ms in the Python runtime's
  NumPy version (200 choices timed on this 2-core host). A shard with nothing that fits at some state takes its
  smallest configuration there (it will be truncated or wait), and the shards after it see
  the link as full.

**Stale shards** (the stale plan, :mod:`edge.stale_plan`): a shard whose block group holds
K/V recent enough may be left unfetched and run on them. The plan offers it as one more
option of zero bytes at the cost of :data:`~edge.stale_plan.STALE_PLAN_DB` (the per-shard
output PSNR below which the plan already prefers running stale, from the worst measured
three-step stale run), for every shard in the horizon the caller says may run stale
(``stale``). Without it the plan reserved bytes for shards that were then skipped, and the
shard that refreshes a group at its age cap got the leftovers: on the tail bench's worst
edits, configurations 1-2 (2026-12-06). When the plan's first choice is that option,
:meth:`Lookahead.choose` returns :data:`STALE` (the allocator answers with the smallest
configuration, which the receive stage then leaves unfetched).

When not even the smallest configuration of shard ``j`` fits its own window, the choice is
its smallest, as the greedy rule does. The C++ twin is ``sakura::Lookahead``
(``native/src/sakura/allocator.cpp``), with the same arithmetic in the same order;
``tests/edge/test_lookahead.py`` checks that both choose the same on random tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sakura.edge.stale_plan import STALE_PLAN_DB

BINS = 256
"""Resolution of the cumulative-bytes axis: 1/256 of the horizon's budget (a configuration
is charged at most one bin more than its size)."""

HORIZON = 8
"""Shards planned at once. Beyond about four execution slots a dip has passed or the rate
estimate has changed; eight leaves room for the startup allowance spread over early shards."""


STALE = -2
""":meth:`Lookahead.choose`'s answer when the plan runs the shard on its group's kept K/V."""

STALE_COST = 10.0 ** (-STALE_PLAN_DB / 10.0)
"""The additive error the plan charges a shard run stale (:data:`STALE_PLAN_DB` as an output
PSNR; ``kStaleCost`` in C++)."""


def config_cost(psnr_db: float | None, weighted_err: float | None) -> float | None:
    """The additive error of one configuration (see the module docstring), None if unknown."""
    if psnr_db is not None and math.isfinite(psnr_db):
        return 10.0 ** (-psnr_db / 10.0)
    if weighted_err is not None and math.isfinite(weighted_err):
        return float(weighted_err)
    return None


@dataclass(frozen=True)
class Lookahead:
    """The per-shard costs (aligned with the allocator's tables, best first) and slots."""

    costs: Sequence[Sequence[float]]
    slots_s: Sequence[float]
    horizon: int = HORIZON
    bins: int = BINS

    def windows(self, shard: int, window_s: float) -> list[float]:
        """The windows of shards ``shard ..`` (at most ``horizon``), ``window_s`` being
        ``shard``'s: each later one longer by the slots before it."""
        out: list[float] = []
        acc = window_s
        for m in range(shard, min(len(self.slots_s), shard + self.horizon)):
            out.append(acc)
            acc += self.slots_s[m]
        return out

    def choose(self, shard: int, sizes: Sequence[Sequence[int]], budgets: Sequence[float],
               stale: Sequence[bool] | None = None) -> int | None:
        """The index (into the table of ``shard``, best first) of its configuration under
        the plan. ``sizes[m]`` and ``budgets[m]``: the configurations' bytes of shard
        ``shard + m`` and the bytes that fit by its deadline (cumulative), for every shard
        the horizon holds (:meth:`windows`); ``stale[m]``: that shard may run on its group's
        kept K/V at no bytes (module docstring). :data:`STALE` when the plan runs ``shard``
        so; None when nothing fits the first budget and it may not."""
        last = len(budgets) - 1
        may = list(stale) if stale is not None else [False] * len(budgets)
        if budgets[0] <= 0.0:
            return STALE if may[0] else None
        q = budgets[last] / self.bins
        caps = [min(self.bins, math.floor(b / q)) for b in budgets]
        caps[last] = self.bins
        f = np.zeros(self.bins + 1)
        states = np.arange(self.bins + 1)
        for m in range(last, 0, -1):
            cost, nbytes = self.costs[shard + m], sizes[m]
            g = np.full(self.bins + 1, math.inf)
            for c, n in zip(cost, nbytes):
                nxt = states + math.ceil(n / q)
                ok = nxt <= caps[m]
                g[ok] = np.minimum(g[ok], c + f[nxt[ok]])
            # nothing fits: its smallest configuration (truncated or waited for), the link
            # full for the shards after it
            if may[m]:  # zero bytes: whatever the earlier shards took
                g = np.minimum(g, STALE_COST + f)
            small = min(range(len(nbytes)), key=lambda i: (nbytes[i], -i))
            g[np.isinf(g)] = cost[small] + f[self.bins]
            f = g
        best, pick = math.inf, None
        for i, (c, n) in enumerate(zip(self.costs[shard], sizes[0])):
            nb = math.ceil(n / q)
            if nb <= caps[0]:
                v = c + f[nb]
                if v < best:
                    best, pick = v, i
        if may[0] and STALE_COST + f[0] < best:
            pick = STALE
        return pick
