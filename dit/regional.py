"""FlashDiff regional execution: saliency, the patch partition, the patch gate, and the
per-request state machine that drives a model through a small backend interface.

The algorithm (``dit/REGIONAL.md`` has the full description, the paper's rules and where
this implementation differs):

1. **Warm-up.** The first ``warmup`` steps run every token of the region (the whole image
   in generation, the masked tokens in a cached edit). The last warm-up step also reports
   the attention mass of every image query on each prompt token (cond branch, mean over
   heads and probe blocks), computed by the fused attention kernel with one extra value
   column per text token: no attention matrix is materialised.
2. **Saliency and partition.** Saliency of a token = its attention mass on the *salient*
   prompt tokens (special tokens, punctuation and function words excluded:
   :func:`salient_token_mask`). Default (the paper's, ``partition="otsu"``): Otsu's
   threshold of the saliency values splits the region into a *focus* and a *context* set,
   and the ``R`` patches are shared between them in proportion to their sizes
   (``r_f = round(R n_f / n)``), each set cut into compact equal-size patches
   (:func:`focus_context_partition`). Alternatives: ``"cuts"`` (recursive axis-aligned
   Otsu cuts under a size balance, :func:`otsu_partition`, with the bounded search over R
   of :func:`choose_partition`) and ``"grid"`` (a uniform grid, the paper's baseline).
3. **Gate.** Default (the paper's, ``gate="importance"``): before every later step a cheap
   *probe* (the first attention block over all region tokens, fused kernel plus a
   reduction: :class:`ProbeResult`) measures each patch's self-attention importance
   ``A_p`` (attention mass its queries put on its own tokens); a patch is skipped when
   ``|A_p - A_p(last run)| / sum_q A_q < eps``, and forced to run after ``max_skips``
   consecutive skips (:class:`ImportanceGate`). Alternatives: ``"drift"`` (the score
   ``importance ** p x velocity drift``, normalised by its running mean:
   :class:`PatchGate`) and ``"periodic"`` (a fixed schedule of a given skipped fraction,
   no signal: :class:`PeriodicGate`, the cap-only baseline). A skipped patch reuses its
   last velocity.
4. **Patch execution.** An active patch runs its own tokens (and the text tokens) fresh;
   the rest of the region is visible through the K/V each token had at its last
   execution (``context="stale"``), the template cache stays visible in edits. All
   patches of one step read the store as it was at the step boundary, and their writes
   are applied after the step, so a patch's output does not depend on which other
   patches ran with it, on which worker, or in which order (what makes the cloud render
   engine's (request, step, patch) outputs idempotent). ``context="none"`` is the naive
   baseline: independent patches that see only themselves.

Everything model-specific sits behind :class:`RegionalBackend` (``dit.regional_mmdit``
implements it for the default MMDiT, ``dit.adapters.regional`` for the diffusers models).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

# Function words excluded from saliency (plus anything without a letter or digit).
FUNCTION_WORDS = frozenset(
    "a an the and or but nor of to in on at by for with without from into onto over under "
    "as is are was were be been being it its this that these those his her their our your "
    "my he she they we you i me him them us some any each every no not than then so very "
    "up down out off about above below near next".split()
)


# ----------------------------------------------------------------------------- tokens


def salient_token_mask(tokenizer, prompt: str, max_tokens: int) -> torch.Tensor:
    """Which of the ``max_tokens`` text positions carry content (bool ``[max_tokens]``).

    Uses the same tokenisation as ``dit.text.TextEncoder`` (lower-cased, padded to
    ``max_tokens``). Special tokens (CLS/SEP/PAD), punctuation and :data:`FUNCTION_WORDS`
    are excluded; a word piece ``##x`` follows the word it continues. If nothing is left
    (an empty or all-function-word prompt) every non-special token counts.
    """
    enc = tokenizer(prompt.lower(), padding="max_length", truncation=True,
                    max_length=max_tokens)
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"])
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    out = torch.zeros(max_tokens, dtype=torch.bool)
    nonspecial = torch.zeros(max_tokens, dtype=torch.bool)
    head_salient = False
    for i, tok in enumerate(tokens[:max_tokens]):
        if tok in special:
            head_salient = False
            continue
        nonspecial[i] = True
        if tok.startswith("##"):
            out[i] = head_salient
            continue
        head_salient = bool(re.search(r"[a-z0-9]", tok)) and tok not in FUNCTION_WORDS
        out[i] = head_salient
    return out if out.any() else nonspecial


# ----------------------------------------------------------------------------- partition


@dataclass(frozen=True)
class Split:
    """One Otsu cut: tokens ``left`` (coordinate < ``cut`` on ``axis``) and ``right``."""

    left: torch.Tensor
    right: torch.Tensor
    axis: int
    cut: float
    between_var: float


def _cut_candidates(coords: torch.Tensor, sal: torch.Tensor, axis: int):
    """All cuts along one axis: (n_left, cut value, between-class variance) per candidate."""
    order = torch.argsort(coords[:, axis], stable=True)
    c = coords[order, axis].double()
    s = sal[order].double()
    n = len(s)
    n0 = torch.arange(1, n, dtype=torch.float64)
    cs = torch.cumsum(s, 0)[:-1]
    mu0 = cs / n0
    mu1 = (s.sum() - cs) / (n - n0)
    var_b = (n0 / n) * (1 - n0 / n) * (mu0 - mu1) ** 2
    distinct = c[1:] > c[:-1]  # a cut must fall between two different coordinates
    cut = (c[1:] + c[:-1]) / 2
    return order, n0.long(), cut, var_b, distinct


def otsu_split(coords: torch.Tensor, sal: torch.Tensor, frac: float = 0.5,
               balance_tol: float = 0.25, bounds: tuple[float, float] | None = None) -> Split:
    """The balanced axis-aligned cut of a token set with the largest Otsu criterion.

    ``coords`` ``[n, 2]`` (row, column), ``sal`` ``[n]``. Allowed cuts leave
    ``n_left / n`` within ``frac +- balance_tol * min(frac, 1 - frac)`` and fall between
    two distinct coordinates (``bounds`` = explicit ``(lo, hi)`` for ``n_left`` instead).
    Among them the one maximising the between-class variance ``w0 w1 (mu0 - mu1)^2``
    wins; ties go to the most balanced cut (so a uniform map is cut into equal halves).
    If no allowed cut exists the most balanced distinct cut is taken.
    """
    n = coords.shape[0]
    if n < 2:
        raise ValueError("cannot split fewer than 2 tokens")
    if bounds is None:
        slack = balance_tol * min(frac, 1 - frac) * n
        bounds = (frac * n - slack, frac * n + slack)
    lo, hi = bounds[0] - 1e-9, bounds[1] + 1e-9
    s64 = sal.double()
    scale = float(((s64 - s64.mean()) ** 2).mean()) or 1.0
    best = fallback = None
    for axis in (0, 1):
        order, n0, cut, var_b, distinct = _cut_candidates(coords, sal, axis)
        if not distinct.any():
            continue
        imbalance = (n0.double() - frac * n).abs()
        ok = distinct & (n0.double() >= lo) & (n0.double() <= hi)
        if ok.any():
            # relative criterion rounded so float noise does not break ties
            score = torch.where(ok, torch.round(var_b / scale * 1e9) / 1e9, -torch.inf)
            top = score.max()
            i = int(torch.argmin(torch.where(score == top, imbalance, torch.inf)))
            key = (float(top), -float(imbalance[i]))
            if best is None or key > best[0]:
                best = (key, axis, order, int(n0[i]), float(cut[i]), float(var_b[i]))
        j = int(torch.argmin(torch.where(distinct, imbalance, torch.inf)))
        key = -float(imbalance[j])
        if fallback is None or key > fallback[0]:
            fallback = (key, axis, order, int(n0[j]), float(cut[j]), float(var_b[j]))
    choice = best or fallback
    if choice is None:  # every token at the same position: split by order
        order = torch.arange(n)
        k = max(1, min(n - 1, round(frac * n)))
        return Split(order[:k], order[k:], 0, float("nan"), 0.0)
    _, axis, order, k, cut, var_b = choice
    return Split(order[:k], order[k:], axis, cut, var_b)


@dataclass(frozen=True)
class Partition:
    """Patches (index tensors into the region's tokens) and how well they explain the
    saliency: ``explained`` = between-patch variance / total variance (1 when flat)."""

    patches: tuple[torch.Tensor, ...]
    explained: float
    objective: float = float("nan")
    searched: tuple[tuple[int, float], ...] = ()
    focus: int = 0  # focus patches (the first ones) of a focus/context partition

    @property
    def count(self) -> int:
        return len(self.patches)

    def sizes(self) -> list[int]:
        return [len(p) for p in self.patches]

    def owner(self, n: int) -> torch.Tensor:
        """Patch index of every region token ``[n]``."""
        out = torch.full((n,), -1, dtype=torch.long)
        for i, p in enumerate(self.patches):
            out[p] = i
        return out


def explained_variance(sal: torch.Tensor, patches) -> float:
    s = sal.double()
    total = float(((s - s.mean()) ** 2).sum())
    if total <= 1e-18 * max(1.0, float((s**2).sum())):
        return 1.0
    between = sum(len(p) * float((s[p].mean() - s.mean()) ** 2) for p in patches)
    return between / total


def otsu_partition(coords: torch.Tensor, sal: torch.Tensor, patches: int,
                   balance_tol: float = 0.25) -> Partition:
    """Recursive Otsu partition of a token set into ``patches`` load-balanced patches.

    A set that must become ``r`` patches is cut (:func:`otsu_split`) into sides that
    become ``r0 = floor(r/2)`` and ``r - r0`` patches. The cut must leave every side able
    to hold patches of ``(1 +- balance_tol) * n / patches`` tokens, so (where the grid
    allows) every final patch is within the tolerance of the mean size: equal-cost
    monotasks for the scheduler.
    """
    n = coords.shape[0]
    if not 1 <= patches <= n:
        raise ValueError(f"cannot make {patches} patches of {n} tokens")
    unit = n / patches
    small, big = (1 - balance_tol) * unit, (1 + balance_tol) * unit

    def rec(idx: torch.Tensor, r: int) -> list[torch.Tensor]:
        if r == 1:
            return [idx.sort().values]
        r0, m = r // 2, len(idx)
        r1 = r - r0
        bounds = (max(r0 * small, m - r1 * big), min(r0 * big, m - r1 * small))
        sp = otsu_split(coords[idx], sal[idx], r0 / r, balance_tol, bounds)
        return rec(idx[sp.left], r0) + rec(idx[sp.right], r1)

    parts = rec(torch.arange(n), patches)
    return Partition(tuple(parts), explained_variance(sal, parts))


def choose_partition(coords: torch.Tensor, sal: torch.Tensor, candidates=(2, 3, 4, 6, 8),
                     overhead_tokens: int = 16, overhead_weight: float = 1.0,
                     balance_tol: float = 0.25, min_patch_tokens: int = 4) -> Partition:
    """Bounded search over the number of patches.

    For every candidate ``R`` (at most ``n / min_patch_tokens``) the recursive Otsu
    partition is built and scored by ``J(R) = (1 - explained(R)) + overhead_weight *
    (R - 1) * overhead_tokens / (n + overhead_tokens)``: saliency variance a patch mixes
    (its salient part forces the whole patch to run) plus the extra rows that ``R``
    separate patch executions compute (each recomputes the text tokens). The smallest
    ``J`` wins (the smaller ``R`` on ties).
    """
    n = coords.shape[0]
    limit = max(1, n // max(1, min_patch_tokens))
    rs = sorted({r for r in candidates if 1 <= r <= limit}) or [1]
    best, searched = None, []
    for r in rs:
        part = otsu_partition(coords, sal, r, balance_tol)
        obj = (1 - part.explained) + overhead_weight * (r - 1) * overhead_tokens / (n + overhead_tokens)
        searched.append((r, obj))
        if best is None or obj < best[1] - 1e-12:
            best = (part, obj)
    part, obj = best
    return Partition(part.patches, part.explained, obj, tuple(searched))


def otsu_threshold(values: torch.Tensor) -> float:
    """Otsu's threshold of a 1-D sample: the cut between two sorted distinct values that
    maximises the between-class variance ``w0 w1 (mu0 - mu1)^2`` (NaN if all are equal)."""
    v = values.double().flatten().sort().values
    n = len(v)
    if n < 2 or float(v[-1] - v[0]) <= 1e-12 * max(1.0, float(v.abs().max())):
        return float("nan")
    n0 = torch.arange(1, n, dtype=torch.float64)
    cs = torch.cumsum(v, 0)[:-1]
    mu0, mu1 = cs / n0, (v.sum() - cs) / (n - n0)
    var_b = (n0 / n) * (1 - n0 / n) * (mu0 - mu1) ** 2
    var_b = torch.where(v[1:] > v[:-1], var_b, -torch.inf)  # cut between distinct values
    i = int(torch.argmax(var_b))
    return float((v[i] + v[i + 1]) / 2)


def balanced_bisection(coords: torch.Tensor, idx: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Cut the tokens ``idx`` into ``parts`` compact sets of equal size (+-1 token):
    recursively, across the longer side of the set's bounding box, at the rank that gives
    each side its share of the parts."""
    if parts <= 1 or len(idx) <= 1:
        return [idx.sort().values]
    c = coords[idx].double()
    span = c.max(0).values - c.min(0).values
    axis = 0 if span[0] >= span[1] else 1
    key = c[:, axis] * (c[:, 1 - axis].abs().max() + 1) + c[:, 1 - axis]
    order = idx[torch.argsort(key, stable=True)]
    left = parts // 2
    k = max(1, min(len(idx) - 1, round(len(idx) * left / parts)))
    return (balanced_bisection(coords, order[:k], left)
            + balanced_bisection(coords, order[k:], parts - left))


def focus_context_partition(coords: torch.Tensor, sal: torch.Tensor, patches: int) -> Partition:
    """The paper's partition: Otsu's threshold of the saliency splits the tokens into a
    *focus* set (saliency above the threshold) and a *context* set; the ``patches`` are
    shared in proportion to the sets' sizes (``r_f = round(R n_f / n)``, at least one
    each when both exist) and each set is cut into ``r`` compact equal-size patches
    (:func:`balanced_bisection`). A flat map has no focus: a balanced split of the whole
    region. ``Partition.focus`` = how many of the patches (the first ones) are focus."""
    n = coords.shape[0]
    if not 1 <= patches <= n:
        raise ValueError(f"cannot make {patches} patches of {n} tokens")
    tau = otsu_threshold(sal)
    focus = sal.double() > tau if tau == tau else torch.zeros(n, dtype=torch.bool)
    nf = int(focus.sum())
    if nf == 0 or nf == n or patches == 1:
        parts = balanced_bisection(coords, torch.arange(n), patches)
        return Partition(tuple(parts), explained_variance(sal, parts), focus=0)
    rf = min(max(1, round(patches * nf / n)), patches - 1, nf)
    rc = patches - rf
    if rc > n - nf:  # the context is too small for its share
        rc = n - nf
        rf = patches - rc
    parts = (balanced_bisection(coords, torch.nonzero(focus).flatten(), rf)
             + balanced_bisection(coords, torch.nonzero(~focus).flatten(), rc))
    return Partition(tuple(parts), explained_variance(sal, parts), focus=rf)


def grid_partition(coords: torch.Tensor, sal: torch.Tensor, patches: int) -> Partition:
    """A uniform grid of ``a x b = patches`` cells (``a <= b``, ``a`` the largest divisor
    up to sqrt(R)): rows cut into ``a`` equal bands by the row coordinate, each band into
    ``b`` equal cells by the column coordinate. The paper's baseline (its Fig. 8);
    ``sal`` is only used for ``explained``."""
    n = coords.shape[0]
    if not 1 <= patches <= n:
        raise ValueError(f"cannot make {patches} patches of {n} tokens")
    a = max(d for d in range(1, int(patches ** 0.5) + 1) if patches % d == 0)
    b = patches // a

    def bands(idx: torch.Tensor, axis: int, k: int) -> list[torch.Tensor]:
        c = coords[idx].double()
        order = idx[torch.argsort(c[:, axis] * (c[:, 1 - axis].abs().max() + 1)
                                  + c[:, 1 - axis], stable=True)]
        cuts = [round(len(idx) * i / k) for i in range(k + 1)]
        return [order[cuts[i]:cuts[i + 1]] for i in range(k)]

    parts = [cell.sort().values for band in bands(torch.arange(n), 0, a)
             for cell in bands(band, 1, b)]
    return Partition(tuple(parts), explained_variance(sal, parts))


PARTITIONS = ("otsu", "cuts", "grid")


def make_partition(kind: str, coords: torch.Tensor, sal: torch.Tensor, patches: int | None,
                   cfg: RegionalConfig | None = None, text_tokens: int = 16) -> Partition:
    """The partition of ``kind`` (see :data:`PARTITIONS`) with ``patches`` patches (None:
    ``DEFAULT_PATCHES``, or for ``"cuts"`` the bounded search of :func:`choose_partition`)."""
    n = coords.shape[0]
    cfg = cfg or RegionalConfig()
    if kind == "cuts":
        if patches:
            return otsu_partition(coords, sal, min(patches, n), cfg.balance_tol)
        return choose_partition(coords, sal, cfg.patch_candidates, text_tokens,
                                cfg.overhead_weight, cfg.balance_tol, cfg.min_patch_tokens)
    r = min(patches, n) if patches else min(DEFAULT_PATCHES,
                                            max(1, n // max(1, cfg.min_patch_tokens)))
    if kind == "otsu":
        return focus_context_partition(coords, sal, r)
    if kind == "grid":
        return grid_partition(coords, sal, r)
    raise ValueError(f"partition must be one of {PARTITIONS}")


# ----------------------------------------------------------------------------- gate


@dataclass
class GateDecision:
    """One step's gate output over the patches."""

    active: torch.Tensor   # bool [R]
    weights: torch.Tensor  # normalised scores [R]
    forced: torch.Tensor   # bool [R]: active only because of max_skips

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
class ImportanceGate:
    """The paper's gate: skip a patch when the change of its self-attention importance
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


GATES = ("importance", "drift", "periodic")
DEFAULT_EPS = {"importance": 0.01, "drift": 1.0, "periodic": 0.0}
DEFAULT_PATCHES = 4


def fused_masses(q: torch.Tensor, k: torch.Tensor, indicator: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
    """Attention mass of every query of the first batch row on groups of keys, mean over
    heads: ``[queries, m]``, from the fused attention kernel, never materialising the
    attention matrix. ``indicator`` ``[K, m]`` (1 where key j belongs to group i) is used
    as the values: ``softmax(q k^T) @ indicator`` is the mass. It is zero-padded to the
    head dimension and split into head-dimension-wide chunks, because the fused kernels
    want values as wide as the keys (wider values fall back to PyTorch's materialising
    path, which is what this avoids)."""
    d, m = q.shape[-1], indicator.shape[1]
    chunks = max(1, -(-m // d))
    pad = indicator.new_zeros(indicator.shape[0], chunks * d)
    pad[:, :m] = indicator
    h = q.shape[1]
    outs = [F.scaled_dot_product_attention(
                q[:1], k[:1], pad[:, c * d:(c + 1) * d][None, None].expand(1, h, -1, -1),
                attn_mask=mask)
            for c in range(chunks)]
    return torch.cat(outs, dim=-1)[0, :, :, :m].mean(0)


# ----------------------------------------------------------------------------- backend


@dataclass
class KVStore:
    """Per-block K/V of the region tokens, each token's from its last execution.

    ``k``/``v`` ``[L, Bc, H, n, D]`` (blocks, guidance branches, heads, tokens, head dim).
    """

    k: torch.Tensor
    v: torch.Tensor

    def write(self, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[:, :, :, idx] = k.to(self.k.dtype)
        self.v[:, :, :, idx] = v.to(self.v.dtype)

    def clone(self) -> KVStore:
        return KVStore(self.k.clone(), self.v.clone())

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class FullResult:
    """A whole-region step: guided velocity ``[n, C]``, the K/V of every region token, and
    (when probed) the attention mass of every image query on each text token ``[n, T]``
    (cond branch, mean over heads and probe blocks)."""

    velocity: torch.Tensor
    kv: KVStore | None = None
    text_attn: torch.Tensor | None = None
    img_keys: int = 0  # image keys each query could see (region + template cache)
    probe_macs: float = 0.0  # modelled extra compute of the saliency probe


@dataclass
class PatchResult:
    """One patch's step: velocity ``[n_p, C]``, K/V ``[L, Bc, H, n_p, D]``, and the
    mean attention mass its queries put on its own tokens (``self_mass``, with
    ``img_keys`` image keys visible; NaN when the call did not measure it)."""

    velocity: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    self_mass: float
    img_keys: int
    probe_macs: float = 0.0  # modelled extra compute of measuring self_mass


class ProbeDone(Exception):
    """Raised by a probing attention hook once it has what it needs: the rest of the
    forward is not computed."""


@dataclass
class ProbeResult:
    """A probe of every patch on the current latents: ``mass[p]`` = attention mass the
    queries of patch ``p`` put on its own tokens, summed over the patch's queries (cond
    branch, mean over heads and the probed blocks); ``img_keys`` image keys were visible;
    ``macs`` = the probe's modelled multiply-accumulates."""

    mass: torch.Tensor
    img_keys: int
    macs: float = 0.0

    def lift(self, sizes: list[int]) -> torch.Tensor:
        """Per-patch mean self mass over what uniform attention would give (1 = none)."""
        s = torch.tensor(sizes, dtype=torch.float64)
        return (self.mass.double() / s) / (s / max(1, self.img_keys))


class RegionalBackend(Protocol):
    """What regional execution needs from a model (the default MMDiT and the diffusers
    adapters implement it).

    The region is ``n`` image tokens with ``coords`` ``[n, 2]`` (row, column). Velocities
    are already guided (classifier-free guidance is the backend's business).
    """

    coords: torch.Tensor
    text_tokens: int

    def run_full(self, step: int, t: float, x: torch.Tensor, probe: bool,
                 want_kv: bool) -> FullResult:
        """All region tokens ``x [n, C]`` at timestep ``t``."""
        ...

    def run_patches(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
                    context: KVStore | None, joint: bool = False,
                    measure: bool = True) -> list[PatchResult]:
        """The given patches at timestep ``t``; ``x`` holds the whole region.

        ``joint=False``: each patch separately (its tokens + text fresh, ``context`` minus
        its own tokens visible), possibly packed into one call. ``joint=True``: the
        patches together in one call (fresh among themselves, the text computed once,
        ``context`` of the tokens that do not run). ``measure``: report ``self_mass``."""
        ...

    def probe(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
              depth: int | None = None) -> ProbeResult:
        """Self-attention importance of every patch on ``x``: every region token fresh
        (cond branch only), the forward stopped after the first ``depth`` probe blocks
        (None: every probe block)."""
        ...

    def cost(self, queries: int, keys: int) -> float:
        """Multiply-accumulates of one call with ``queries`` fresh rows and ``keys`` keys."""
        ...


# ----------------------------------------------------------------------------- state


@dataclass
class RegionalConfig:
    """Knobs of regional execution (defaults: ``dit/REGIONAL.md``)."""

    warmup: int = 4
    gate: str = "importance"            # "importance" (paper) | "drift" | "periodic"
    eps: float | None = None            # gate threshold; None: DEFAULT_EPS[gate]
    max_skips: int = 3
    partition: str = "otsu"             # "otsu" (paper) | "cuts" | "grid"
    patches: int | None = None          # R; None: DEFAULT_PATCHES ("cuts": bounded search)
    probe_depth: int = 1                # probe blocks the importance gate's probe runs
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
        if self.patches is not None and self.patches < 1:
            raise ValueError("patches must be >= 1")
        if self.probe_depth < 1:
            raise ValueError("probe_depth must be >= 1")
        if not 0 <= self.skip_fraction < 1:
            raise ValueError("skip_fraction must be in [0, 1)")


@dataclass
class RegionalStats:
    """What happened: patch-steps run/skipped, modelled compute (probes included), the
    partition, and the reuse error (the online quality signal: relative difference
    between a re-run patch's fresh velocity and the one it reused while skipped)."""

    steps: int
    warmup: int
    patches: int = 0
    focus_patches: int = 0
    patch_sizes: list[int] = field(default_factory=list)
    executed_patch_steps: int = 0
    skipped_patch_steps: int = 0
    forced_patch_steps: int = 0
    macs: float = 0.0
    full_macs: float = 0.0
    probe_macs: float = 0.0
    saliency_macs: float = 0.0
    probes: int = 0
    probe_steps: int = 0
    explained: float = float("nan")
    reuse_error_sum: float = 0.0
    reuse_error_weight: int = 0
    active_log: list[list[int]] = field(default_factory=list)

    @property
    def skipped_fraction(self) -> float:
        total = self.executed_patch_steps + self.skipped_patch_steps
        return self.skipped_patch_steps / total if total else 0.0

    @property
    def compute_fraction(self) -> float:
        return self.macs / self.full_macs if self.full_macs else 1.0

    @property
    def probe_fraction(self) -> float:
        """Share of the modelled compute spent on saliency and gating probes."""
        return (self.probe_macs + self.saliency_macs) / self.macs if self.macs else 0.0

    @property
    def reuse_error(self) -> float:
        return self.reuse_error_sum / self.reuse_error_weight if self.reuse_error_weight else 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "warmup": self.warmup, "patches": self.patches,
                "focus_patches": self.focus_patches,
                "patch_sizes": self.patch_sizes, "executed_patch_steps": self.executed_patch_steps,
                "skipped_patch_steps": self.skipped_patch_steps,
                "forced_patch_steps": self.forced_patch_steps,
                "skipped_fraction": self.skipped_fraction,
                "compute_fraction": self.compute_fraction, "probe_fraction": self.probe_fraction,
                "probes": self.probes, "probe_steps": self.probe_steps,
                "reuse_error": self.reuse_error,
                "explained": self.explained}


class RegionalState:
    """One request's regional execution, step by step, independent of who computes.

    The single-process sampler (:func:`run_regional`) and the cloud render engine drive
    the same state: ask :meth:`phase`, get the work done by a backend, hand back the
    results with :meth:`apply_full` / :meth:`apply_probes` / :meth:`apply_patches`.
    Results are keyed by (step, patch); applying a step twice is refused, so outputs are
    applied exactly once.

    A patch step whose gate needs probes (:meth:`probe_inputs` not empty) is decided only
    after :meth:`apply_probes` got them: the importance gate probes every step (and, at
    the first patch step, the last warm-up step's latents as every patch's reference);
    the drift gate probes the last warm-up step once (the patches' first importance).
    """

    def __init__(self, cfg: RegionalConfig, coords: torch.Tensor, timesteps: torch.Tensor,
                 x: torch.Tensor, text_tokens: int, salient: torch.Tensor | None = None,
                 cost=None, patches: int | None = None):
        self.steps = len(timesteps) - 1
        cfg.validate(self.steps)
        self.cfg, self.coords, self.ts = cfg, coords, timesteps
        self.x = x.clone()
        self.n = x.shape[0]
        self.text_tokens = text_tokens
        self.salient = salient
        self.cost = cost
        self.patch_count = patches if patches is not None else cfg.patches
        self.step = 0
        self.store: KVStore | None = None
        self.partition: Partition | None = None
        self.gate: PatchGate | ImportanceGate | PeriodicGate | None = None
        self.eps = cfg.threshold        # the engine may change it between steps
        self.v_last = torch.zeros_like(self.x)
        self.v_prev: torch.Tensor | None = None
        self.importance: torch.Tensor | None = None
        self.rate: torch.Tensor | None = None
        self.last_exec: torch.Tensor | None = None
        self.decisions: dict[int, GateDecision] = {}
        self.stats = RegionalStats(self.steps, min(cfg.warmup, self.steps))
        self.img_keys_full = 0
        self._x_warm: torch.Tensor | None = None  # last warm-up step's input (reference probe)
        self._probes: dict[int, dict[str, ProbeResult]] = {}

    # -- queries ----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    def phase(self, step: int | None = None) -> str:
        step = self.step if step is None else step
        return "full" if step < self.cfg.warmup or self.partition is None else "patches"

    def wants_probe(self, step: int) -> bool:
        """The last warm-up step is probed (it builds the partition)."""
        return step == self.cfg.warmup - 1 and step < self.steps - 1

    @property
    def measures(self) -> bool:
        """Whether patch calls measure their self mass (the drift gate's importance)."""
        return self.cfg.gate == "drift"

    @property
    def joint(self) -> bool:
        """Whether the active patches of a step run as one unit (``execution="joint"``);
        the naive baseline always runs its patches separately."""
        return self.cfg.execution == "joint" and self.cfg.context == "stale"

    def wants_kv(self, step: int) -> bool:
        return self.wants_probe(step) and self.cfg.context == "stale"

    def dt(self, step: int) -> float:
        return float(self.ts[step + 1] - self.ts[step])

    def t(self, step: int) -> float:
        return float(self.ts[step])

    # -- full steps -------------------------------------------------------------------

    def apply_full(self, step: int, res: FullResult) -> None:
        if step != self.step or self.phase(step) != "full":
            raise RuntimeError(f"full result for step {step} does not fit (at {self.step})")
        v = res.velocity.to(self.x.dtype)
        self.v_prev, self.v_last = self.v_last if step > 0 else None, v.clone()
        self._account(self.n + self.text_tokens, self.n + self.text_tokens + self._extra_keys(res))
        if self.wants_probe(step):
            self._build_partition(res)
            self._x_warm = self.x.clone()
        self.x = self.x + self.dt(step) * v
        self.step += 1

    def _extra_keys(self, res: FullResult) -> int:
        if res.img_keys:
            self.img_keys_full = res.img_keys
        return max(0, self.img_keys_full - self.n)

    def _build_partition(self, res: FullResult) -> None:
        if res.text_attn is None:
            raise RuntimeError("the last warm-up step must be probed")
        ta = res.text_attn.double()
        sal = ta[:, self.salient].sum(-1) if self.salient is not None else ta.sum(-1)
        cfg = self.cfg
        part = make_partition(cfg.partition, self.coords, sal, self.patch_count, cfg,
                              self.text_tokens)
        self.partition = part
        if cfg.gate == "importance":
            self.gate = ImportanceGate(part.count, self.eps, cfg.max_skips)
        elif cfg.gate == "periodic":
            self.gate = PeriodicGate(part.count, cfg.skip_fraction, cfg.max_skips)
        else:
            self.gate = PatchGate(part.count, self.eps, cfg.max_skips, cfg.normalize)
        self.store = res.kv
        rate = torch.ones(part.count)
        if self.v_prev is not None:
            for i, p in enumerate(part.patches):
                rate[i] = self._drift(self.v_last[p], self.v_prev[p])
        self.rate = rate
        self.importance = torch.ones(part.count, dtype=torch.float64)
        self.last_exec = torch.full((part.count,), self.step, dtype=torch.long)
        self.stats.patches = part.count
        self.stats.focus_patches = part.focus
        self.stats.patch_sizes = part.sizes()
        self.stats.explained = part.explained
        self.stats.saliency_macs += res.probe_macs
        self.stats.macs += res.probe_macs

    # -- probes -----------------------------------------------------------------------

    def probe_inputs(self, step: int) -> list[tuple[str, float, torch.Tensor, int | None]]:
        """The probes step ``step`` needs before its gate decision, not yet applied:
        ``(label, t, x, depth)``; ``label`` ``"ref"`` = the last warm-up step's latents,
        ``"now"`` = this step's."""
        if self.phase(step) != "patches" or step in self.decisions or step in self._probes:
            return []
        out = []
        gate = self.cfg.gate
        warm = self.cfg.warmup - 1
        if step == self.cfg.warmup and gate in ("importance", "drift"):
            depth = self.cfg.probe_depth if gate == "importance" else None
            out.append(("ref", self.t(warm), self._x_warm, depth))
        if gate == "importance" and self.eps > 0:  # eps = 0: every patch runs, no probe
            out.append(("now", self.t(step), self.x, self.cfg.probe_depth))
        return out

    def apply_probes(self, step: int, results: dict[str, ProbeResult]) -> None:
        want = {label for label, *_ in self.probe_inputs(step)}
        if step != self.step or set(results) != want:
            raise RuntimeError(f"step {step}: probes {sorted(results)}, need {sorted(want)}")
        self.stats.probe_steps += 1
        for r in results.values():
            self.stats.probe_macs += r.macs
            self.stats.macs += r.macs
            self.stats.probes += 1
        ref = results.get("ref")
        if ref is not None:
            if isinstance(self.gate, ImportanceGate):
                self.gate.start(ref.mass)
            else:
                self.importance = ref.lift(self.partition.sizes())
            self._x_warm = None
        self._probes[step] = results

    # -- patch steps ------------------------------------------------------------------

    def decide(self, step: int) -> GateDecision:
        """The gate decision for ``step`` (computed once; later calls return it)."""
        if step in self.decisions:
            return self.decisions[step]
        if step != self.step or self.phase(step) != "patches":
            raise RuntimeError(f"no patch step {step} now (at {self.step})")
        if self.probe_inputs(step):
            raise RuntimeError(f"step {step} needs its probes first")
        self.gate.eps = self.eps if not isinstance(self.gate, PeriodicGate) else 0.0
        if isinstance(self.gate, ImportanceGate):
            now = self._probes.get(step, {}).get("now")
            d = self.gate.decide(None if now is None else now.mass)
        elif isinstance(self.gate, PeriodicGate):
            d = self.gate.decide()
        else:
            change = self.rate * (step - self.last_exec).double()
            imp = self.importance.clamp_min(0) ** self.cfg.importance_power
            d = self.gate.decide(imp, change)
        self._probes.pop(step, None)
        self.decisions[step] = d
        return d

    def apply_patches(self, step: int, results: dict[int, PatchResult]) -> None:
        if step != self.step:
            raise RuntimeError(f"patch results for step {step} do not fit (at {self.step})")
        d = self.decide(step)
        want = set(d.active_ids())
        if set(results) != want:
            raise RuntimeError(f"step {step}: results for {sorted(results)}, need {sorted(want)}")
        parts = self.partition.patches
        v = self.v_last.clone()
        for p, r in results.items():
            idx = parts[p]
            new = r.velocity.to(v.dtype)
            gap = max(1, step - int(self.last_exec[p]))
            drift = self._drift(new, self.v_last[idx])
            if gap > 1:  # it reused v_last[idx] for gap - 1 steps
                self.stats.reuse_error_sum += _rel_change(new, self.v_last[idx]) * (gap - 1)
                self.stats.reuse_error_weight += gap - 1
            self.rate[p] = drift / gap
            v[idx] = new
            if r.self_mass == r.self_mass:  # measured in this call
                self.importance[p] = r.self_mass / (len(idx) / max(1, r.img_keys))
            self.last_exec[p] = step
        if self.store is not None:  # deferred writes: order-independent
            for p in sorted(results):
                self.store.write(parts[p], results[p].k, results[p].v)
        self.v_last = v
        self._account_patches([len(parts[p]) for p in sorted(results)])
        extra = sum(r.probe_macs for r in results.values())
        self.stats.probe_macs += extra
        self.stats.macs += extra
        self.stats.executed_patch_steps += len(results)
        self.stats.skipped_patch_steps += len(parts) - len(results)
        self.stats.forced_patch_steps += int(d.forced.sum())
        self.stats.active_log.append(sorted(results))
        self.x = self.x + self.dt(step) * v
        self.step += 1

    def _drift(self, new: torch.Tensor, old: torch.Tensor) -> float:
        if self.cfg.change == "absolute":
            return float((new.double() - old.double()).pow(2).mean().sqrt())
        return _rel_change(new, old)

    # -- compute accounting -----------------------------------------------------------

    def _account(self, queries: int, keys: int) -> None:
        if self.cost is None:
            return
        full = self.cost(self.n + self.text_tokens,
                         self.n + self.text_tokens + max(0, self.img_keys_full - self.n))
        self.stats.full_macs += full
        self.stats.macs += self.cost(queries, keys)

    def _account_patches(self, sizes: list[int]) -> None:
        if self.cost is None:
            return
        t = self.text_tokens
        extra = max(0, self.img_keys_full - self.n)
        stale = self.cfg.context == "stale"
        if self.joint:
            q = sum(sizes) + t
            keys = q + extra + (self.n - sum(sizes) if stale else 0)
        else:
            q = sum(s + t for s in sizes)
            keys = q + extra + (self.n if stale else 0)
        self.stats.full_macs += self.cost(self.n + t, self.n + t + extra)
        self.stats.macs += self.cost(q, keys) if sizes else 0.0


def _rel_change(new: torch.Tensor, old: torch.Tensor) -> float:
    den = float(new.double().norm())
    return float((new.double() - old.double()).norm()) / max(den, 1e-12)


def run_probes(backend: RegionalBackend, state: RegionalState, step: int,
               timer: dict | None = None) -> None:
    """Run and apply the probes ``step`` needs (``timer["probe_s"]`` accumulates their
    wall time when given)."""
    import time

    inputs = state.probe_inputs(step)
    if not inputs:
        return
    t0 = time.perf_counter()
    patches = list(state.partition.patches)
    res = {label: backend.probe(step, t, x, patches, depth) for label, t, x, depth in inputs}
    if timer is not None:
        timer["probe_s"] = timer.get("probe_s", 0.0) + time.perf_counter() - t0
    state.apply_probes(step, res)


def run_regional(backend: RegionalBackend, state: RegionalState,
                 timer: dict | None = None) -> RegionalState:
    """Drive ``state`` to the end with ``backend`` in this process."""
    while not state.done:
        s = state.step
        if state.phase(s) == "full":
            res = backend.run_full(s, state.t(s), state.x, probe=state.wants_probe(s),
                                   want_kv=state.wants_kv(s))
            state.apply_full(s, res)
        else:
            run_probes(backend, state, s, timer)
            d = state.decide(s)
            ids = d.active_ids()
            outs = backend.run_patches(s, state.t(s), state.x,
                                       [state.partition.patches[p] for p in ids],
                                       state.store if state.cfg.context == "stale" else None,
                                       joint=state.joint, measure=state.measures)
            state.apply_patches(s, dict(zip(ids, outs)))
    return state


__all__ = [
    "DEFAULT_EPS", "DEFAULT_PATCHES", "FUNCTION_WORDS", "FullResult", "GATES", "GateDecision",
    "ImportanceGate", "KVStore", "PARTITIONS", "Partition", "PatchGate", "PatchResult",
    "PeriodicGate", "ProbeDone", "ProbeResult", "RegionalBackend", "RegionalConfig", "RegionalState",
    "RegionalStats", "Split", "balanced_bisection", "choose_partition", "explained_variance",
    "focus_context_partition", "fused_masses", "grid_partition", "make_partition", "otsu_partition",
    "otsu_split", "otsu_threshold", "run_probes", "run_regional", "salient_token_mask",
]
