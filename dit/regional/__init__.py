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
3. **Gate.** Default (the paper's rule, ``gate="paper"``): before every later step a
   cheap *probe* (the first attention block over all region tokens, fused kernel plus a
   reduction: :class:`ProbeResult`) measures each patch's self-attention importance
   ``A_p`` (attention mass its queries put on its own tokens). ``Delta_p`` = the change
   of ``A_p`` between the patch's last two executions, frozen while it is skipped;
   ``w_p = Delta_p / sum_q Delta_q``; a patch is skipped when ``w_p < eps``, forced to run
   after ``max_skips`` consecutive skips, and the heaviest patch runs when no other would
   (at least one per gated step: :class:`PaperGate`). Alternatives: ``"importance"``
   (the earlier default: ``|A_p - A_p(last run)| / sum_q A_q < eps``, fresh every step,
   every patch may skip: :class:`ImportanceGate`), ``"drift"`` (the score
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

Each mechanism is one module of this package (``dit/REGIONAL.md`` maps them):

- ``saliency.py``: salient prompt tokens, attention mass from the fused kernel;
- ``partition.py``: the partitions (Otsu focus/context, recursive cuts, uniform grid);
- ``gate.py``: the gates (importance change, drift, periodic);
- ``config.py``: ``RegionalConfig`` and the gate/partition names;
- ``backend.py``: the backend interface, its results, ``KVStore``;
- ``state.py``: ``RegionalState`` (the per-request state machine), ``run_regional``.

Everything is re-exported here, so ``from sakura.dit.regional import X`` works for every
name the single module had.
"""

from __future__ import annotations

from sakura.dit.regional.backend import (
    FullResult,
    KVStore,
    PatchResult,
    ProbeDone,
    ProbeResult,
    RegionalBackend,
)
from sakura.dit.regional.config import (
    DEFAULT_EPS,
    DEFAULT_PARTITION,
    DEFAULT_PATCHES,
    GATES,
    PARTITIONS,
    RegionalConfig,
)
from sakura.dit.regional.gate import (
    GateDecision,
    ImportanceGate,
    PaperGate,
    PatchGate,
    PeriodicGate,
)
from sakura.dit.regional.partition import (
    Partition,
    Split,
    balanced_bisection,
    choose_partition,
    explained_variance,
    focus_context_partition,
    grid_partition,
    make_partition,
    otsu_partition,
    otsu_split,
    otsu_threshold,
)
from sakura.dit.regional.saliency import FUNCTION_WORDS, fused_masses, salient_token_mask
from sakura.dit.regional.state import RegionalState, RegionalStats, run_probes, run_regional

__all__ = [
    "DEFAULT_EPS", "DEFAULT_PARTITION", "DEFAULT_PATCHES", "FUNCTION_WORDS", "FullResult", "GATES", "GateDecision",
    "ImportanceGate", "KVStore", "PaperGate", "PARTITIONS", "Partition", "PatchGate", "PatchResult",
    "PeriodicGate", "ProbeDone", "ProbeResult", "RegionalBackend", "RegionalConfig", "RegionalState",
    "RegionalStats", "Split", "balanced_bisection", "choose_partition", "explained_variance",
    "focus_context_partition", "fused_masses", "grid_partition", "make_partition", "otsu_partition",
    "otsu_split", "otsu_threshold", "run_probes", "run_regional", "salient_token_mask",
]
