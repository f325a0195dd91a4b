"""The patch gate (FlashDiff step 3): before each step after the warm-up, which patches
run and which reuse their last velocity.

Default (the paper's rule, ``gate="paper"``): :class:`PaperGate` keeps, per patch, the
change ``Delta_p`` of its self-attention importance between its last two executions
(frozen while the patch is skipped), weighs it by the sum over all patches
(``w_p = Delta_p / sum_q Delta_q``, so the weights sum to 1), skips a patch when
``w_p < eps``, forces it back after ``max_skips`` skips, and runs the heaviest patch when
nothing else would (at least one patch per gated step).
Alternatives: ``"importance"`` (:class:`ImportanceGate`, the earlier default: fresh
changes since each patch's last run, divided by the sum of importances, so every patch
may skip in the same step), ``"drift"`` (:class:`PatchGate`, importance x velocity drift
normalised by its running mean) and ``"periodic"`` (:class:`PeriodicGate`, a fixed
schedule, no signal: the cap-only baseline). The gate names and default thresholds are in
``dit/regional/config.py``; :class:`~sakura.dit.regional.state.RegionalState` builds the
gate the config names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GateDecision:
    """One step's gate output over the patches."""

    active: torch.Tensor   # bool [R]
    weights: torch.Tensor  # normalised scores [R]
    forced: torch.Tensor   # bool [R]: active only because of max_skips
    guaranteed: torch.Tensor | None = None  # bool [R]: active only because one must run

    def active_ids(self) -> list[int]:
        return torch.nonzero(self.active).flatten().tolist()


@dataclass
class PatchGate:
    """Skip patches whose normalised refinement score is below ``eps``; force a patch
    back after ``max_skips`` consecutive skips. ``skips[p]`` counts the current run.

    Scores are ``importance x change``. ``normalize="step"`` divides them by this step's
    mean over the patches (a patch is judged against the others now);
    ``normalize="running"`` divides by the mean over every step decided so far,
    this one included (a patch is judged against the others over the run, so quiet
    steps skip more and steps where everything changes skip less)."""

    patches: int
    eps: float = 0.5
    max_skips: int = 3
    normalize: str = "step"
    skips: torch.Tensor = field(default=None)  # type: ignore[assignment]
    _sum: float = 0.0
    _steps: int = 0

    def __post_init__(self) -> None:
        if self.skips is None:
            self.skips = torch.zeros(self.patches, dtype=torch.long)
        if self.normalize not in ("step", "running"):
            raise ValueError("normalize must be 'step' or 'running'")

    @staticmethod
    def weights(importance: torch.Tensor, change: torch.Tensor,
                reference: float | None = None) -> torch.Tensor:
        score = importance.double().clamp_min(0) * change.double().clamp_min(0)
        ref = score.mean() if reference is None else torch.tensor(reference, dtype=torch.float64)
        if not torch.isfinite(ref) or ref <= 0:
            return torch.ones_like(score)
        return score / ref

    def decide(self, importance: torch.Tensor, change: torch.Tensor) -> GateDecision:
        ref = None
        if self.normalize == "running":
            score = importance.double().clamp_min(0) * change.double().clamp_min(0)
            if torch.isfinite(score.mean()):
                self._sum += float(score.mean())
                self._steps += 1
            ref = self._sum / max(1, self._steps)
        w = self.weights(importance, change, ref)
        forced = (self.skips >= self.max_skips) & (w < self.eps)
        active = (w >= self.eps) | forced
        self.skips = torch.where(active, torch.zeros_like(self.skips), self.skips + 1)
        return GateDecision(active, w.float(), forced)


@dataclass
class PaperGate:
    """The paper's gate. ``Delta_p`` = the change of patch ``p``'s self-attention
    importance between its last two executions; it is refreshed only when ``p`` runs
    (frozen while it is skipped). Weights ``w_p = Delta_p / sum_q Delta_q`` (uniform when
    every change is 0) sum to 1; ``p`` is skipped when ``w_p < eps``; a patch skipped
    ``max_skips`` times in a row runs (``forced``); when no patch would run, the one of
    largest weight runs (``guaranteed``), so every gated step runs at least one patch.

    :meth:`start` takes every patch's importance at the last warm-up step (all patches
    ran there). :meth:`decide` takes this step's importance (the probe, standing in for
    the measurement the paper takes inside a patch's own execution): the first call sets
    every ``Delta`` to the change since the warm-up (all patches ran at the step before);
    after a decision, the patches
    that run get ``Delta_p = |A_p(now) - A_p(last run)|`` and their reference moves to
    now; the skipped keep both."""

    patches: int
    eps: float = 0.15
    max_skips: int = 3
    # the patch count ``eps`` is meant for: the threshold is ``eps * eps_patches / patches``,
    # so that the weight a patch needs, relative to a uniform 1 / R, stays the same when the
    # engine's R search changes R (None: ``eps`` as is, the paper's rule). Measured: with a
    # fixed eps 0.22 the R search settled on R = 6-8, where it skipped 65% of patch-steps
    # and served 21-23 dB (docs/bench/flashdiff.json, the run before this field)
    eps_patches: int | None = None
    reference: torch.Tensor | None = None   # importance at each patch's last run
    delta: torch.Tensor | None = None       # frozen change per patch
    skips: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.skips is None:
            self.skips = torch.zeros(self.patches, dtype=torch.long)

    @property
    def threshold(self) -> float:
        """The weight a patch needs to run (``eps``, scaled to ``patches`` when
        ``eps_patches`` is set)."""
        if self.eps_patches is None:
            return self.eps
        return self.eps * self.eps_patches / self.patches

    def start(self, importance: torch.Tensor) -> None:
        """The importance every patch had at the last warm-up step (all of them ran)."""
        self.reference = importance.double().clone()
        self.delta = None

    def weights(self) -> torch.Tensor:
        d = self.delta.double().clamp_min(0)
        total = float(d.sum())
        if not torch.isfinite(d).all() or total <= 0:
            return torch.full((self.patches,), 1.0 / self.patches, dtype=torch.float64)
        return d / total

    def decide(self, importance: torch.Tensor | None) -> GateDecision:
        """``importance`` None (no probe: ``eps = 0``): every patch runs, nothing moves."""
        if importance is None:
            self.skips.zero_()
            on = torch.ones(self.patches, dtype=torch.bool)
            return GateDecision(on, torch.full((self.patches,), 1.0 / self.patches), ~on, ~on)
        if self.reference is None:
            raise RuntimeError("PaperGate.start() must see the warm-up importance first")
        imp = importance.double()
        if self.delta is None:  # every patch ran at the last warm-up step
            self.delta = (imp - self.reference).abs()
        w = self.weights()
        chosen = w >= self.threshold
        forced = (self.skips >= self.max_skips) & ~chosen
        active = chosen | forced
        guaranteed = torch.zeros_like(active)
        if not active.any():
            guaranteed[int(torch.argmax(w))] = True
            active = guaranteed.clone()
        self.delta = torch.where(active, (imp - self.reference).abs(), self.delta)
        self.reference = torch.where(active, imp, self.reference)
        self.skips = torch.where(active, torch.zeros_like(self.skips), self.skips + 1)
        return GateDecision(active, w.float(), forced, guaranteed)


@dataclass
class ImportanceGate:
    """The earlier default (``gate="importance"``; the paper's rule is :class:`PaperGate`):
    skip a patch when the change of its self-attention importance
    since it last ran, relative to the sum over all patches, is below ``eps``; a patch
    skipped ``max_skips`` times in a row runs (forced reactivation).

    ``decide(importance)`` takes this step's probe (``A_p``, one value per patch). The
    reference of a patch is its importance at the step it last ran; the gate updates it
    for the patches it activates. ``weights`` of the decision = the relative changes."""

    patches: int
    eps: float = 0.01
    max_skips: int = 3
    reference: torch.Tensor | None = None
    skips: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.skips is None:
            self.skips = torch.zeros(self.patches, dtype=torch.long)

    def start(self, importance: torch.Tensor) -> None:
        """The importance every patch had when it last ran (the last warm-up step)."""
        self.reference = importance.double().clone()

    @staticmethod
    def change(importance: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        imp = importance.double()
        total = float(imp.clamp_min(0).sum())
        if total <= 0 or not torch.isfinite(imp).all():
            return torch.full_like(imp, torch.inf)  # nothing to compare: run
        return (imp - reference).abs() / total

    def decide(self, importance: torch.Tensor | None) -> GateDecision:
        """``importance`` None (no probe: ``eps = 0``): every patch runs, the references
        stay as they were."""
        if importance is None:
            self.skips.zero_()
            on = torch.ones(self.patches, dtype=torch.bool)
            return GateDecision(on, torch.full((self.patches,), float("inf")), ~on)
        if self.reference is None:
            raise RuntimeError("ImportanceGate.start() must see the warm-up importance first")
        rel = self.change(importance, self.reference)
        forced = (self.skips >= self.max_skips) & (rel < self.eps)
        active = (rel >= self.eps) | forced
        self.skips = torch.where(active, torch.zeros_like(self.skips), self.skips + 1)
        self.reference = torch.where(active, importance.double(), self.reference)
        return GateDecision(active, rel.float(), forced)


@dataclass
class PeriodicGate:
    """A fixed schedule with no signal (the *cap-only* baseline): every patch runs a
    fraction ``1 - skip_fraction`` of the steps, evenly spaced, the patches' phases
    staggered (patch ``p`` starts with credit ``p / R``); ``max_skips`` still forces."""

    patches: int
    skip_fraction: float = 0.5
    max_skips: int = 3
    credit: torch.Tensor = field(default=None)  # type: ignore[assignment]
    skips: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if not 0 <= self.skip_fraction < 1:
            raise ValueError("skip_fraction must be in [0, 1)")
        if self.credit is None:
            self.credit = torch.arange(self.patches, dtype=torch.float64) / self.patches
        if self.skips is None:
            self.skips = torch.zeros(self.patches, dtype=torch.long)

    def decide(self, importance: torch.Tensor | None = None) -> GateDecision:
        self.credit = self.credit + (1 - self.skip_fraction)
        due = self.credit >= 1 - 1e-9
        forced = (self.skips >= self.max_skips) & ~due
        active = due | forced
        self.credit = torch.where(active, (self.credit - 1).clamp_min(0), self.credit)
        self.skips = torch.where(active, torch.zeros_like(self.skips), self.skips + 1)
        return GateDecision(active, due.float(), forced)
