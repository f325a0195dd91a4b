"""The patch partition (FlashDiff step 2, second half): the region split into patches
from the saliency of its tokens.

Default (the paper's, ``partition="otsu"``): Otsu's threshold of the saliency values
splits the region into a focus and a context set, the patches shared between them in
proportion to their sizes, each set cut into compact equal-size patches
(:func:`focus_context_partition`). Alternatives: ``"cuts"`` (recursive axis-aligned Otsu
cuts under a size balance, :func:`otsu_partition`, with the bounded search over R of
:func:`choose_partition`) and ``"grid"`` (a uniform grid, the paper's baseline).
:func:`make_partition` picks one by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sakura.dit.regional.config import DEFAULT_PATCHES, PARTITIONS, RegionalConfig


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
