"""Per-shard choice of representation, and the registry of policies that use it.

Before each shard the runtime computes a window (see :mod:`edge.monitor`): the time left to
receive the shard before execution needs it. An allocator turns (window, rate estimate,
per-request latency) into a byte budget and picks a configuration of that shard from the
manifest's profiled table. Allocators are pure: ``choose(shard, window_s, rate_bps)``
depends only on its arguments and the table, so they are unit-tested with scripted
arrivals.

Quality of a configuration, highest first: ``quality.psnr_db`` (output PSNR on profiling
requests) when every candidate of the shard has it, else ``-quality.weighted_err``, else
the byte size (more bytes, better). Only the profiled non-dominated (``pareto``)
configurations are candidates, unless a shard marks none.

Policies (:data:`POLICIES`) name a pack (codec) and an allocator:

============================ ======== ============================================================
policy                       codec    choice per shard
============================ ======== ============================================================
``sakura``                   sakura   plan over the next shards (:mod:`edge.lookahead`): least
                                      summed output error within rate x each deadline
``svd``                      svd      same, plain SVD pack (q = 0)
``intq``                     intq     greedy: highest quality that fits rate x its own window
                                      (uniform integer quantization, adaptive bitwidth)
``cachegen``                 cachegen greedy, CacheGen-DiT quality levels
``fp16``                     fp16     the only configuration (raw FP16 cache)
``sakura-fixed-config``      sakura   one (rank, bits) for every shard, from the median-rate
                                      budget (no shard adaptation)
``sakura-fixed-bits``        sakura   adaptive rank (the plan), bits fixed (default 4)
``sakura-greedy``            sakura   ablation of the plan: greedy, as the baselines
``sakura-optimistic``        sakura   the plan over 1.25x the estimated fit (truncation
                                      at the deadline bounds what an overestimate costs)
``sakura-floor``             sakura   the plan over the configurations at or above the
                                      quality floor: a local edit's error (the pack's
                                      ``local_psnr_db``) shared over the shards
``local``                    --       no cache: the whole model on the device
============================ ======== ============================================================

``Policy.local_fallback``: whether the native runtime may compute a step on the device when
none of its shards can arrive in time (SAKURA's policies and ``cachegen``, whose paper falls
back to recomputation; not ``fp16`` and ``intq``, plain streaming baselines, nor ``local``).

``Policy.plans_stale``: whether the receive stage leaves a shard unfetched when the choice is
the policy's smallest configuration and the shard's group holds recent K/V
(:mod:`edge.stale_plan`; ``Allocator.skippable``): SAKURA's policies, not the baselines.

``options["lookahead"]`` (``EditOptions.policy_options``) turns the plan on or off for any
adaptive policy; the baselines keep their published greedy rule by default.

The two ablations choose among *uniform* configurations (every component at one
precision). A ``sakura`` pack built with the codec's default table (the thinned Pareto
front) offers few of them; a pack encoded with ``keep="all"`` offers every ladder rank at
every bitwidth. :data:`ABLATION_PACK` names such a pack; the runtime streams it instead
when asked (``EditOptions.pack``, ``sakura edit --pack``; ``sakura bench edit`` does so
when the server lists it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from sakura.edge.errors import EdgeError
from sakura.edge.lookahead import STALE, Lookahead, config_cost
from sakura.edge.stale_plan import skippable as stale_skippable


@dataclass(frozen=True)
class ConfigOption:
    """One configuration of one shard as the allocator sees it."""

    id: int
    nbytes: int
    params: Mapping[str, Any]
    psnr_db: float | None = None
    weighted_err: float | None = None
    pareto: bool = True

    @property
    def bits(self) -> int | None:
        b = self.params.get("bits")
        return int(b) if b is not None else None

    @property
    def uniform(self) -> bool:
        """Every stored component at the same precision (False for mixed-precision)."""
        ranks = [int(r) for r in self.params.get("ranks", []) if int(r) > 0]
        return all(r == ranks[0] for r in ranks)

    def params_key(self) -> tuple:
        return tuple(sorted((k, _freeze(v)) for k, v in self.params.items()))


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


@dataclass
class ShardOptions:
    """The candidate configurations of one shard, best quality first."""

    shard: int
    options: list[ConfigOption]
    compute_cost: float = 1.0
    # configurations off the Pareto front (not offered to the adaptive policy), kept for
    # policies that restrict the set: the best 4-bit configurations need not be on the
    # mixed front, and fixed-bits found none in a shard of the sakura-all pack
    dominated: list[ConfigOption] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.options:
            raise EdgeError(f"shard {self.shard} has no configurations in the manifest")
        self.options = rank_by_quality(self.options)
        # fewest bytes; among equal sizes the one ranked last (as the C++ twin)
        self._smallest = min(reversed(self.options), key=lambda o: o.nbytes)

    def by_id(self, config: int) -> ConfigOption:
        for o in self.options + self.dominated:
            if o.id == config:
                return o
        raise EdgeError(f"shard {self.shard} has no configuration {config}")

    @property
    def smallest(self) -> ConfigOption:
        return self._smallest

    @property
    def best(self) -> ConfigOption:
        return self.options[0]

    def filtered(self, keep: Callable[[ConfigOption], bool]) -> ShardOptions:
        kept = [o for o in self.options + self.dominated if keep(o)]
        if not kept:
            raise EdgeError(f"shard {self.shard}: no configuration matches the policy")
        return ShardOptions(self.shard, kept, self.compute_cost)


def rank_by_quality(options: list[ConfigOption]) -> list[ConfigOption]:
    """Best first (see the module docstring); ties: fewer bytes first."""
    if all(o.psnr_db is not None and math.isfinite(o.psnr_db) for o in options):
        return sorted(options, key=lambda o: (-o.psnr_db, o.weighted_err or 0.0, o.nbytes))
    if all(o.weighted_err is not None for o in options):
        return sorted(options, key=lambda o: (o.weighted_err, o.nbytes))
    return sorted(options, key=lambda o: -o.nbytes)


def options_from_manifest(manifest: Mapping[str, Any], pareto_only: bool = True
                          ) -> list[ShardOptions]:
    """The per-shard candidate tables of a pack manifest, in shard (execution) order."""
    shards = sorted(manifest.get("shards", []), key=lambda s: int(s["index"]))
    if [int(s["index"]) for s in shards] != list(range(len(shards))) or not shards:
        raise EdgeError("the manifest's shards are not numbered 0..n-1")
    out = []
    for s in shards:
        opts = []
        for c in s["configs"]:
            q = c.get("quality") or {}
            opts.append(ConfigOption(
                id=int(c["id"]), nbytes=int(c["bytes"]), params=dict(c.get("params") or {}),
                psnr_db=_float(q.get("psnr_db")), weighted_err=_float(q.get("weighted_err")),
                pareto=bool(c.get("pareto", True))))
        dominated: list[ConfigOption] = []
        if pareto_only and any(o.pareto for o in opts):
            opts, dominated = ([o for o in opts if o.pareto], [o for o in opts if not o.pareto])
        out.append(ShardOptions(int(s["index"]), opts, float(s.get("compute_cost", 1.0)),
                                dominated))
    return out


def _float(v: Any) -> float | None:
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


# ----------------------------------------------------------------------------- allocators


def budget_bytes(window_s: float, rate_bps: float, latency_s: float = 0.0,
                 safety: float = 1.0) -> float:
    """Bytes that fit in the window at the estimated rate after the request latency."""
    if not (rate_bps > 0 and math.isfinite(rate_bps)):
        return 0.0
    return max(0.0, window_s - latency_s) * rate_bps / 8.0 * safety


class Allocator(Protocol):
    """Chooses the configuration of a shard from its window and the rate estimate."""

    name: str

    def choose(self, shard: int, window_s: float, rate_bps: float,
               stale: Callable[[int], bool] | None = None) -> int:
        """``stale(m)``: shard ``m`` may run on its group's kept K/V at no bytes (the stale
        plan; a lookahead plans with it, :mod:`edge.lookahead`)."""
        ...

    def fallbacks(self, shard: int) -> list[int]:
        """The configurations of ``shard`` the policy accepts in place of its choice (a
        prefix received by the deadline, the part before a damaged unit); none: the policy
        waits for its choice (``sakura-fixed-config``)."""
        ...

    def ceiling(self, shard: int) -> int:
        """The configuration of ``shard`` the policy chooses when the link allows anything:
        a shard that ran below the pack's largest but on this one was limited by the policy
        (fixed bits or configuration), not by the link (``edge.quality.received_quality``)."""
        ...

    def skippable(self, shard: int, config: int) -> bool:
        """Whether the stale plan (:mod:`edge.stale_plan`) may run ``shard`` on its group's
        kept K/V instead of fetching ``config``: the policy's smallest configuration, or one
        profiled below ``STALE_PLAN_DB``."""
        ...


@dataclass
class AdaptiveAllocator:
    """Highest-quality configuration whose bytes fit ``rate x (window - latency) x safety``;
    the smallest one when none fits. With a ``lookahead`` (:mod:`edge.lookahead`) the choice
    is the first of a plan over the next shards that minimizes their summed output error
    under the same budgets at each one's deadline."""

    tables: list[ShardOptions]
    latency_s: float = 0.0
    safety: float = 0.8
    name: str = "adaptive"
    lookahead: Lookahead | None = None

    def choose(self, shard: int, window_s: float, rate_bps: float,
               stale: Callable[[int], bool] | None = None) -> int:
        table = self.tables[shard]
        if self.lookahead is not None:
            budgets = [budget_bytes(w, rate_bps, self.latency_s, self.safety)
                       for w in self.lookahead.windows(shard, window_s)]
            sizes = [[o.nbytes for o in t.options]
                     for t in self.tables[shard:shard + len(budgets)]]
            may = ([bool(stale(shard + m)) for m in range(len(budgets))]
                   if stale is not None else None)
            pick = self.lookahead.choose(shard, sizes, budgets, may)
            if pick is None or pick == STALE:  # (the smallest: the receive stage skips it)
                return table.smallest.id
            return table.options[pick].id
        budget = budget_bytes(window_s, rate_bps, self.latency_s, self.safety)
        for opt in table.options:  # best first
            if opt.nbytes <= budget:
                return opt.id
        return table.smallest.id

    def fallbacks(self, shard: int) -> list[int]:
        return [o.id for o in self.tables[shard].options]

    def ceiling(self, shard: int) -> int:
        return self.tables[shard].best.id

    def skippable(self, shard: int, config: int) -> bool:
        table = self.tables[shard]
        return stale_skippable(table.by_id(config).psnr_db, config == table.smallest.id)


@dataclass
class FixedAllocator:
    """A precomputed configuration per shard, whatever the window."""

    configs: list[int]
    name: str = "fixed"

    def choose(self, shard: int, window_s: float, rate_bps: float,
               stale: Callable[[int], bool] | None = None) -> int:
        return self.configs[shard]

    def fallbacks(self, shard: int) -> list[int]:
        return []

    def ceiling(self, shard: int) -> int:
        return self.configs[shard]

    def skippable(self, shard: int, config: int) -> bool:
        return False  # it keeps its configuration (and stalls instead)


def fixed_config(tables: list[ShardOptions], exec_s: list[float], budget_rate_bps: float,
                 safety: float = 0.8) -> FixedAllocator:
    """One parameter set (e.g. rank and bits) for every shard: the best quality whose mean
    bytes per shard fit the budget of the median rate over the mean shard execution time
    (the steady-state window); the smallest common one when none fits."""
    common: dict[tuple, list[ConfigOption]] = {}
    for t in tables:
        for o in t.options:
            if o.uniform:
                common.setdefault(o.params_key(), []).append(o)
    common = {k: v for k, v in common.items() if len(v) == len(tables)}
    if not common:
        raise EdgeError("no configuration (same parameters) is offered by every shard")
    budget = budget_bytes(sum(exec_s) / len(exec_s), budget_rate_bps, 0.0, safety)

    def quality(opts: list[ConfigOption]) -> tuple:
        if all(o.psnr_db is not None for o in opts):
            return (sum(o.psnr_db for o in opts) / len(opts),)
        if all(o.weighted_err is not None for o in opts):
            return (-sum(o.weighted_err for o in opts) / len(opts),)
        return (sum(o.nbytes for o in opts),)

    def mean_bytes(opts: list[ConfigOption]) -> float:
        return sum(o.nbytes for o in opts) / len(opts)

    fitting = [v for v in common.values() if mean_bytes(v) <= budget]
    chosen = (max(fitting, key=lambda v: (quality(v), -mean_bytes(v))) if fitting
              else min(common.values(), key=mean_bytes))
    return FixedAllocator([o.id for o in chosen], name="fixed-config")


def make_lookahead(tables: list[ShardOptions], exec_s: list[float]) -> Lookahead | None:
    """The lookahead of these tables (costs best first), or None when a shard's
    configurations have neither an output PSNR nor a weighted error."""
    costs = []
    for t in tables:
        c = [config_cost(o.psnr_db, o.weighted_err) for o in t.options]
        if any(v is None for v in c):
            return None
        costs.append(c)
    return Lookahead(costs, list(exec_s))


def to_native(allocator: Allocator, native: Any) -> Any:
    """The same allocator as a ``sakura_native`` object (for the native runtime): the
    candidate tables, best first, as the policy built them."""
    if isinstance(allocator, AdaptiveAllocator):
        la = allocator.lookahead
        out = native.AdaptiveAllocator([[(o.id, o.nbytes) for o in t.options]
                                        for t in allocator.tables],
                                       allocator.latency_s, allocator.safety)
        if la is not None:
            out.set_lookahead([list(c) for c in la.costs], list(la.slots_s), la.horizon,
                              la.bins)
        out.set_skippable([[o.id for o in t.options
                            if stale_skippable(o.psnr_db, o is t.smallest)]
                           for t in allocator.tables])
        return out
    if isinstance(allocator, FixedAllocator):
        return native.FixedAllocator(list(allocator.configs))
    raise EdgeError(f"the native runtime has no twin of the {allocator.name} allocator")


# ----------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may use to build its allocator for one edit."""

    tables: list[ShardOptions]
    exec_s: list[float]
    latency_s: float = 0.0
    budget_rate_bps: float | None = None  # the median rate (fixed-config ablation)
    safety: float = 0.8
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Policy:
    """A system under test: which pack it streams and how it chooses per shard."""

    name: str
    codec: str | None  # None: no network (local)
    build: Callable[[PolicyContext], Allocator] | None
    description: str
    # computes a step on the device when no shard of it can arrive in time (the native
    # runtime's local fallback): SAKURA's policies, and CacheGen, whose paper falls back to
    # recomputation; the plain streaming baselines (fp16, intq) wait for their bytes
    local_fallback: bool = True
    # the stale plan (edge/stale_plan.py): a shard at the policy's smallest configuration
    # runs on its group's recent K/V instead of being fetched; SAKURA's own device-side rule,
    # so not the baselines', which keep their published streaming
    plans_stale: bool = False
    # manifest fields the policy plans with; without one it plans as its base (``sakura``),
    # and the edit says so (:meth:`missing`)
    needs: tuple[str, ...] = ()

    def missing(self, manifest: Mapping[str, Any]) -> str | None:
        """A warning when the pack lacks a field this policy plans with (a pack built before
        the field existed), else None."""
        absent = [f for f in self.needs if manifest.get(f) is None]
        if not absent:
            return None
        return (f"the {manifest.get('codec')} pack has no {', '.join(absent)} (built before "
                f"it was measured): {self.name} plans as sakura; rebuild the packs with "
                "`sakura build` to use it")


def _lookahead(ctx: PolicyContext, tables: list[ShardOptions], default: bool
               ) -> Lookahead | None:
    """The policy's plan over the next shards (``options["lookahead"]``, else ``default``)."""
    on = ctx.options.get("lookahead", default)
    return make_lookahead(tables, ctx.exec_s) if on and ctx.exec_s else None


def _adaptive(ctx: PolicyContext) -> Allocator:
    """SAKURA's own allocation: the plan over the next shards (:mod:`edge.lookahead`)."""
    return AdaptiveAllocator(ctx.tables, ctx.latency_s, ctx.safety, name="adaptive",
                             lookahead=_lookahead(ctx, ctx.tables, True))


def local_share_floor_db(local_psnr_db: float, shards: int) -> float:
    """The per-shard quality floor: a local edit's error (``local_psnr_db`` against exact)
    shared evenly over the edit's shards, as a per-shard output PSNR (the lookahead's
    additive error model, :mod:`edge.lookahead`)."""
    return local_psnr_db + 10.0 * math.log10(max(1, shards))


def floored(tables: list[ShardOptions], floor_db: float) -> list[ShardOptions]:
    """Each shard's options at or above ``floor_db`` (an option without a PSNR is kept);
    a shard with none keeps its best."""
    out = []
    for t in tables:
        kept = [o for o in t.options if o.psnr_db is None or o.psnr_db >= floor_db]
        out.append(ShardOptions(t.shard, kept or [t.best], t.compute_cost, t.dominated))
    return out


def _floored(ctx: PolicyContext) -> Allocator:
    local_db = ctx.options.get("local_psnr_db")
    tables = ctx.tables
    if local_db is not None:
        tables = floored(tables, local_share_floor_db(float(local_db), len(tables)))
    return AdaptiveAllocator(tables, ctx.latency_s, ctx.safety, name="floored",
                             lookahead=_lookahead(ctx, tables, True))


def _greedy(ctx: PolicyContext) -> Allocator:
    """The baselines' allocation as published (CacheGen adapts chunk by chunk to the
    throughput it measures): the best configuration that fits each shard's own window."""
    return AdaptiveAllocator(ctx.tables, ctx.latency_s, ctx.safety, name="greedy",
                             lookahead=_lookahead(ctx, ctx.tables, False))


def _greedy_sakura(ctx: PolicyContext) -> Allocator:
    """Ablation of the plan: SAKURA's pack with the greedy rule."""
    return AdaptiveAllocator(ctx.tables, ctx.latency_s, ctx.safety, name="greedy",
                             lookahead=None)


OPTIMISTIC_SAFETY = 1.25
"""``sakura-optimistic``: the budget at 1.25x the estimated fit (safety 1.0 against the
default 0.8). With truncation at the deadline an overestimate costs quality on the shard it
hits (its verified prefix runs), not time; ``sakura bench tail`` measures whether it pays."""


def _optimistic(ctx: PolicyContext) -> Allocator:
    return AdaptiveAllocator(ctx.tables, ctx.latency_s, ctx.safety * OPTIMISTIC_SAFETY,
                             name="optimistic", lookahead=_lookahead(ctx, ctx.tables, True))


def _fixed_bits(ctx: PolicyContext) -> Allocator:
    bits = int(ctx.options.get("bits", 4))
    tables = [t.filtered(lambda o: o.bits == bits and o.uniform) for t in ctx.tables]
    return AdaptiveAllocator(tables, ctx.latency_s, ctx.safety, name=f"fixed-bits-{bits}",
                             lookahead=_lookahead(ctx, tables, True))


def _fixed_config(ctx: PolicyContext) -> Allocator:
    if ctx.budget_rate_bps is None:
        raise EdgeError("sakura-fixed-config needs a budget rate (the trace's median rate)")
    return fixed_config(ctx.tables, ctx.exec_s, ctx.budget_rate_bps, ctx.safety)


ABLATION_PACK = "sakura-all"
ABLATIONS = ("sakura-fixed-config", "sakura-fixed-bits")

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("sakura", "sakura", _adaptive, "SAKURA: adaptive rank and bits per shard",
               plans_stale=True),
        Policy("local", None, None, "whole model on the device, no cache"),
        Policy("fp16", "fp16", _greedy, "stream the raw FP16 cache", local_fallback=False),
        Policy("intq", "intq", _greedy, "uniform integer quantization, adaptive bitwidth",
               local_fallback=False),
        Policy("cachegen", "cachegen", _greedy, "CacheGen adapted to DiT, adaptive level"),
        Policy("svd", "svd", _adaptive, "plain SVD (q = 0), adaptive rank and bits",
               plans_stale=True),
        Policy("sakura-fixed-config", "sakura", _fixed_config,
               "ablation: one (rank, bits) for all shards from the median-rate budget"),
        Policy("sakura-fixed-bits", "sakura", _fixed_bits,
               "ablation: adaptive rank, fixed bitwidth", plans_stale=True),
        Policy("sakura-greedy", "sakura", _greedy_sakura,
               "ablation: the best configuration that fits each shard's own window",
               plans_stale=True),
        Policy("sakura-optimistic", "sakura", _optimistic,
               "variant: the plan over a budget 1.25x the estimated fit", plans_stale=True),
        Policy("sakura-floor", "sakura", _floored,
               "variant: no configuration below its share of a local edit's error",
               needs=("local_psnr_db",), plans_stale=True),
    )
}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise EdgeError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]
