"""The render engine's interface: what a caller hands it (``RenderRequest``, the engine's
knobs ``EngineConfig``), what it gets back (``RenderResult``) and what a refusal raises
(``RenderError``), with the request checks that need no engine (``MODES``, ``size_problem``).

The engine itself is ``cloud.render.RenderEngine``; ``cloud.render_http`` and
``cloud.render_trace`` speak these types too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sakura.dit.regional import RegionalConfig

from sakura.errors import SakuraError

MODES = ("regional", "separate", "full", "naive")


class RenderError(SakuraError):
    """A render request is invalid or failed."""


def size_problem(size: int, unit: int, max_size: int) -> str | None:
    """What is wrong with an image size for a model of ``unit`` pixels per token and an
    engine of ``max_size``, or None."""
    if size % unit or not unit * 2 <= size <= max_size:
        return f"must be a multiple of {unit} in {2 * unit}..{max_size}"
    return None


@dataclass
class RenderRequest:
    """One text-to-image request. ``mode``: ``regional`` (FlashDiff, active patches of a
    step run jointly), ``separate`` (FlashDiff, every patch its own monotask), ``full``
    (every token every step) or ``naive`` (independent patches, no context).
    ``priority``: ``high``, ``normal`` or ``low`` (``cloud.render_sched``). ``patches``
    fixes R (else the engine's online search picks it)."""

    prompt: str = ""
    seed: int = 0
    steps: int = 20
    size: int = 64
    guidance: float = 3.0
    mode: str = "regional"
    priority: str = "normal"
    patches: int | None = None
    txt: torch.Tensor | None = None         # [1, T, D] text embeddings (else from prompt)
    txt_uncond: torch.Tensor | None = None
    salient: torch.Tensor | None = None     # [T] bool (else from the prompt's tokens)
    cond: object | None = None              # adapter models: dit.adapters Conditioning
    uncond: object | None = None


@dataclass
class RenderResult:
    rid: int
    image: torch.Tensor | None     # [3, size, size] in [-1, 1] (default model)
    arrival: float
    finish: float
    stats: dict
    mode: str
    latents: torch.Tensor | None = None   # [N, C] (adapter models)
    priority: str = "normal"

    @property
    def latency_s(self) -> float:
        return self.finish - self.arrival


@dataclass
class EngineConfig:
    """Engine knobs. Costs are in token rows (one token through the model, both guidance
    branches): ``capacity_rows`` = backlog per worker, ``group_overhead_rows`` = fixed
    cost of one forward call, ``transfer_weight`` = cost of shipping one token's K/V
    state relative to computing one row."""

    workers: int = 2
    weights: str | None = None
    model: str | None = None          # a dit.adapters model name (with model_path)
    model_path: str | None = None     # its local diffusers checkpoint folder
    regional: RegionalConfig = field(default_factory=RegionalConfig)
    capacity_rows: float = 600.0
    group_overhead_rows: float = 64.0
    transfer_weight: float = 0.1
    threads: int = 1
    device: str = "auto"
    respawn: bool = True
    priority: str = "warmup_first"   # or "fifo" (cloud.render_sched)
    preempt: str = "benefit"         # or "strict" (cloud.render_sched)
    reserve: float = 0.0             # lower-class backlog share while a higher class is open
                                     # (cloud/RENDER.md, "SLO": 0.5 met no deadline)
    patch_search: bool = True        # online R search (cloud.render_policy)
    patch_candidates: tuple[int, ...] = (2, 4, 6, 8)
    quality_eps: float | None = 0.0  # the gate's eps under low load (None: no quality mode)
    low_load: float = 0.5            # active requests per worker at or below = low load
    # patch parallelism (cloud.render): while fewer requests are open than workers, a joint
    # step's active patches are cut into up to this many gangs, which the placement rule
    # may send to different workers (each sees the other gangs' K/V as of their last
    # execution); 1 = one gang per step on one worker
    patch_split: int = 1
    start_timeout_s: float = 300.0
    pool: str = "process"            # "process" (spawned processes) | "ray" (cloud.render_ray)
    ray_address: str | None = None   # join this Ray cluster (None: start a local one)
    ray_object_store_bytes: int = 512 * 2**20   # a local Ray's object store
    task_deadline_s: float = 300.0   # a Ray actor silent this long on a call is hung
    max_size: int = 128
    max_steps: int = 100


__all__ = ["EngineConfig", "MODES", "RenderError", "RenderRequest", "RenderResult",
           "size_problem"]
