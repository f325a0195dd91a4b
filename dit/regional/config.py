"""The knobs of regional execution (:class:`RegionalConfig`) and the names they take:
the gates, their default thresholds, the partitions and the default patch count."""

from __future__ import annotations

from dataclasses import dataclass

GATES = ("paper", "importance", "drift", "periodic")
# The paper gate's eps at the default grid partition (issue 32 item 6): `sakura bench
# flashdiff --quick`'s epsilon_sweep (docs/bench/flashdiff.json; 2 prompts, 64 px, 10 steps,
# R 4) runs eps 0.2 / 0.22 / 0.24 at compute 0.959 / 0.889 / 0.724 for 43.0 / 36.7 / 27.0 dB
# from full, so 0.22 sits just before the gate's cliff, nearest the compute the Otsu
# default ran at (0.86 with eps 0.15).
DEFAULT_EPS = {"paper": 0.22, "importance": 0.01, "drift": 1.0, "periodic": 0.0}
DEFAULT_PATCHES = 4
# "grid" is the default: at equal compute it beats the paper's Otsu focus/context split on
# the shipped model (partition_comparison in docs/bench/flashdiff.json: 36.7 against 34.8 dB
# at compute 0.889; dit/REGIONAL.md); "otsu" is kept by name as the paper's.
PARTITIONS = ("grid", "otsu", "cuts")
DEFAULT_PARTITION = "grid"


@dataclass
class RegionalConfig:
    """Knobs of regional execution (defaults: ``dit/REGIONAL.md``)."""

    warmup: int = 4
    gate: str = "paper"                 # "paper" | "importance" | "drift" | "periodic"
    eps: float | None = None            # gate threshold; None: DEFAULT_EPS[gate]
    max_skips: int = 3
    # the paper gate's eps is for this many patches; at R patches its threshold is
    # eps * eps_patches / R (PaperGate.eps_patches; None: the paper's fixed eps)
    eps_patches: int | None = DEFAULT_PATCHES
    partition: str = DEFAULT_PARTITION  # "grid" | "otsu" (the paper's) | "cuts"
    patches: int | None = None          # R; None: DEFAULT_PATCHES ("cuts": bounded search)
    probe_depth: int = 1                # probe blocks the paper / importance gates' probe runs
    skip_fraction: float = 0.5          # the periodic gate's schedule
    patch_candidates: tuple[int, ...] = (2, 3, 4, 6, 8)
    balance_tol: float = 0.25
    overhead_weight: float = 1.0
    min_patch_tokens: int = 4
    context: str = "stale"              # "stale" | "none" (naive independent patches)
    execution: str = "joint"            # "joint" | "separate" (see dit/REGIONAL.md)
    importance_power: float = 0.5       # drift gate: score = importance**power * change
    change: str = "relative"            # drift gate: "relative" | "absolute" velocity drift
    normalize: str = "running"          # drift gate: "running" | "step" (PatchGate)

    @property
    def threshold(self) -> float:
        return DEFAULT_EPS[self.gate] if self.eps is None else self.eps

    def validate(self, steps: int) -> None:
        if self.warmup < 1:
            raise ValueError("warmup must be >= 1 (the partition needs one full step)")
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}")
        if self.context not in ("stale", "none"):
            raise ValueError("context must be 'stale' or 'none'")
        if self.execution not in ("joint", "separate"):
            raise ValueError("execution must be 'joint' or 'separate'")
        if self.normalize not in ("step", "running"):
            raise ValueError("normalize must be 'step' or 'running'")
        if self.change not in ("relative", "absolute"):
            raise ValueError("change must be 'relative' or 'absolute'")
        if self.max_skips < 0 or self.threshold < 0:
            raise ValueError("eps and max_skips must be non-negative")
        if self.eps_patches is not None and self.eps_patches < 1:
            raise ValueError("eps_patches must be >= 1 (or None)")
        if self.patches is not None and self.patches < 1:
            raise ValueError("patches must be >= 1")
        if self.probe_depth < 1:
            raise ValueError("probe_depth must be >= 1")
        if not 0 <= self.skip_fraction < 1:
            raise ValueError("skip_fraction must be in [0, 1)")
