"""Stale reuse: a late step runs on the template K/V each block last received.

When a step's cache cannot arrive in time (the provider raises :class:`~dit.cache.StepLate`),
the loop has two ways to go on without it:

* **a local step** (``dit.editing.cached_edit``'s ``local_step``): every token computed, the
  unmasked ones re-noised from the template image. It follows the full-token trajectory,
  not the cached one, and costs a full step (about 3x a cached one on the demo model);
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

The native runtime's ``run_edit`` applies the same rule with the same constant
(``kStaleMaxAge``, ``native/src/sakura/edit.hpp``).
"""

from __future__ import annotations

import torch

STALE_MAX_AGE = 3
"""Oldest K/V (in steps) a late step may reuse; beyond it the step is computed locally."""


class StaleReuse:
    """A ``KVProvider`` wrapper that keeps each block's last received K/V and its step.

    ``get`` passes through (keeping what it returns); :meth:`source` says whether step
    ``step`` may run stale (every block kept, none older than ``max_age`` steps), and
    :meth:`kept` is the provider of that stale step.
    """

    def __init__(self, inner, num_blocks: int, max_age: int = STALE_MAX_AGE) -> None:
        self.inner, self.num_blocks, self.max_age = inner, int(num_blocks), int(max_age)
        self._kv: dict[int, tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.inner.get(step, block)
        self._kv[block] = (step, kv)
        return kv

    def sources(self, step: int) -> dict[int, int] | None:
        """Block -> the step whose K/V it would reuse at ``step``; None when a stale step is
        not allowed (reuse off, a block never received, or K/V older than ``max_age``)."""
        if self.max_age <= 0 or len(self._kv) < self.num_blocks:
            return None
        src = {b: s for b, (s, _) in self._kv.items()}
        return src if step - min(src.values()) <= self.max_age else None

    def kept(self, step: int) -> _Kept:
        return _Kept(self._kv)


class _Kept:
    """The provider of a stale step: each block's kept K/V, whatever step is asked."""

    def __init__(self, kv: dict[int, tuple[int, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        self._kv = kv

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[block][1]
