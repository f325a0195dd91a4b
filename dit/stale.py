"""Stale reuse: a late step runs on the template K/V each block last received.

When a step's cache cannot arrive in time (the provider raises :class:`~dit.cache.StepLate`),
the loop has two ways to go on without it:

* **a local step** (``dit.editing.cached_edit``'s ``local_step``): since 2026-12-06 a
  recompute step (``dit.editing.RecomputedKV``: the template's own K/V recomputed, then the
  cached step), exact but about a full step's cost (~3x a cached one on the demo model);
  without the template's prompt embeddings, every token computed, the unmasked ones
  re-noised from the template image, which follows the full-token trajectory, not the
  cached one (the case the measurement below was made against);
* **a stale step** (this module): the cached step, with each block's K/V from the last step
  that block received. Consecutive steps' K/V are close (the premise of step-caching methods
  such as FORA and DeepCache), so for a few steps this stays near the cached trajectory, at a
  cached step's cost.

Measured on the shipped model (face swap, try-on and instruction templates, each edit
against ``exact``; ``scripts/stale_reuse.py``, ``docs/bench/stale-reuse.json``), with late
runs of 2, 3, 6 and 10 steps, the late half, or every step but the first: reusing K/V up to
:data:`STALE_MAX_AGE` = 3 steps old (older: a local step) beat local steps alone in all 18
cases, by +0.6 to +15.0 dB (mean +5.0; e.g. try-on, steps 5-7 late: 51.3 against 36.3 dB).
A cap of 4 has the same mean (+5.1) but lost 0.6 dB to local steps once (face swap, late
half); 2 gains +4.5 on average, 6 less than 3, and no cap (reusing step 0's K/V for every
later step) is worse than local steps on all three templates.

Against recompute steps (exact) a stale step only saves time, and the cap stays 3: with it
the same 18 cases give 39.4-52.4 dB (mean 48.9) where full-token steps gave 29.5-52.6
(``scripts/recompute_step.py``, ``docs/bench/recompute-step.json``). A recomputed step's
K/V are kept as that step's (:meth:`StaleReuse.put`), so the next late steps reuse them.

The native runtime's ``run_edit`` applies the same rule with the same constant
(``kStaleMaxAge``, ``native/src/sakura/edit.hpp``).
"""

from __future__ import annotations

import torch
from sakura.dit.cache import ShardSkipped, StepLate

STALE_MAX_AGE = 3
"""Oldest K/V (in steps) a late step may reuse; beyond it the step is computed locally."""


class StaleReuse:
    """A ``KVProvider`` wrapper that keeps each block's last received K/V and its step.

    ``get`` passes through (keeping what it returns); :meth:`source` says whether step
    ``step`` may run stale (every block kept, none older than ``max_age`` steps), and
    :meth:`kept` is the provider of that stale step. A block whose shard the provider chose
    not to fetch (it raises :class:`~dit.cache.ShardSkipped`: the stale plan,
    ``edge.stale_plan``) gets its kept K/V when they are at most ``max_age`` steps old, and the
    provider hears which step they came from (``stale_shard(step, block, source)``; source
    None: too old or none kept, and the step is late).
    """

    def __init__(self, inner, num_blocks: int, max_age: int = STALE_MAX_AGE) -> None:
        self.inner, self.num_blocks, self.max_age = inner, int(num_blocks), int(max_age)
        self._kv: dict[int, tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            kv = self.inner.get(step, block)
        except ShardSkipped:
            kept = self._kv.get(block)
            source = kept[0] if kept is not None and step - kept[0] <= self.max_age else None
            told = getattr(self.inner, "stale_shard", None)
            if told is not None:
                told(step, block, source)
            if source is None:
                raise StepLate(step) from None
            return kept[1]
        self._kv[block] = (step, kv)
        return kv

    def sources(self, step: int) -> dict[int, int] | None:
        """Block -> the step whose K/V it would reuse at ``step``; None when a stale step is
        not allowed (reuse off, a block never received, or K/V older than ``max_age``)."""
        if self.max_age <= 0 or len(self._kv) < self.num_blocks:
            return None
        src = {b: s for b, (s, _) in self._kv.items()}
        return src if step - min(src.values()) <= self.max_age else None

    def put(self, step: int, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep ``kv`` (block -> K/V) as step ``step``'s: a step whose K/V the device
        recomputed (``dit.editing.RecomputedKV``) is a fresh source for later late steps."""
        for b, pair in kv.items():
            self._kv[b] = (step, pair)

    def kept(self, step: int) -> _Kept:
        return _Kept(self._kv)


class _Kept:
    """The provider of a stale step: each block's kept K/V, whatever step is asked."""

    def __init__(self, kv: dict[int, tuple[int, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        self._kv = kv

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[block][1]
