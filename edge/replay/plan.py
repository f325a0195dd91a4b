"""The replay's plan: every run in execution order (template, network, start point,
policy), and the names of its variants (``q<q>`` packs folders, ``sakura-d<m>`` deadlines).

Planning reads the traces' start points only; a bad or missing trace fails here, before
anything is built or written.
"""

from __future__ import annotations

from dataclasses import dataclass

from sakura.edge.replay.config import ReplayConfig
from sakura.edge.replay.networks import StartPoint, start_points
from sakura.edge.replay.results import RunKey


@dataclass(frozen=True)
class PlannedRun:
    key: RunKey
    template: str      # served template id (a resolution variant carries -<res>)
    base: str          # catalog template it comes from
    variant: str       # packs folder: main | q<q>
    policy: str        # runtime policy
    start: StartPoint


def q_variant(q: float) -> str:
    return f"q{q:g}"


def deadline_policy(multiple: float) -> str:
    """The name of sakura's operating point with a deadline of ``multiple`` x T."""
    return f"sakura-d{multiple:g}"


def deadline_multiple(policy: str) -> float | None:
    """``m`` of ``sakura-d<m>`` (None for any other policy)."""
    if not policy.startswith("sakura-d"):
        return None
    try:
        return float(policy[len("sakura-d"):])
    except ValueError:
        return None


def plan(cfg: ReplayConfig, root: str | None = None) -> list[PlannedRun]:
    """Every run of the replay in execution order (template, network, start, policy)."""
    mode = cfg.regime
    nets = list(dict.fromkeys(list(cfg.networks) + list(cfg.ablation.networks)))
    # the ablations use the first start points of the network's (same seed, same order)
    starts = {n: start_points(n, max(cfg.starts_of(n), cfg.ablation.starts), cfg.seed,
                              cfg.span_s, root) for n in nets}
    out: list[PlannedRun] = []

    def add(tid: str, base: str, networks: tuple[str, ...], policies: list[tuple[str, str, str]],
            ablation: bool = False) -> None:
        for net in networks:
            k = (cfg.ablation.starts or cfg.starts_of(net)) if ablation else cfg.starts_of(net)
            for sp in starts[net][:k]:
                for name, variant, policy in policies:
                    if not cfg.runs_on(name, net):
                        continue
                    key = RunKey(mode, tid, net, sp.trace, sp.start_s, sp.index, name)
                    out.append(PlannedRun(key, tid, base, variant, policy, sp))

    main = [(p, "main", p) for p in cfg.policies]
    # q = 0 is svd's codec path; every other q is a pinned pack (q = 0.5 too: the default
    # sakura chooses q per shard)
    qs = [(f"sakura-q{q:g}", q_variant(q), "sakura") for q in cfg.ablation.q
          if q != 0.0] if "sakura" in cfg.policies else []
    points = [(deadline_policy(m), "main", "sakura") for m in cfg.deadlines
              ] if "sakura" in cfg.policies else []
    heads = tuple(n for n in cfg.networks if n in cfg.headline_networks)
    for tid in cfg.templates:
        add(tid, tid, cfg.networks, main)
        if points and heads:
            add(tid, tid, heads, points)
        if qs:
            add(tid, tid, cfg.ablation.networks, qs, ablation=True)
    for base in cfg.ablation.resolution_templates:
        for res in cfg.ablation.resolutions:
            add(f"{base}-{res}", base, cfg.ablation.networks, main, ablation=True)
    return out
