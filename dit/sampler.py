"""Rectified-flow sampling: the timestep schedule, the re-noise rule and the one denoising
loop that every sampler of SAKURA runs (issue 30 item 1).

Convention: ``x_t = (1 - t) x_0 + t e`` with ``t`` from 1 (noise) to 0 (image)
(:func:`renoise`, the only place the rule is written in Python; the C++ twin is
``native/src/sakura/edit.cpp`` ``StepRunner::step``); the model predicts the velocity
``v = e - x_0``; an Euler step is ``x_{t'} = x_t + (t' - t) v``.

:func:`denoise` is the loop, in the diffusers style: it knows the step schedule and the
update, and takes the model step as a callable ``model_step(s, timestep, x) -> v``. What is
model specific (the forward, the attention hooks that capture K/V, inject the template
cache, pin hidden states, profile importance or run regional patches) is built by that
callable, per step, as diffusers keeps it in the transformer and its attention processors.
The step rule is a :class:`Steps`: :class:`EulerSteps` over a timestep tensor (the default
MMDiT) or :class:`SchedulerSteps` over a diffusers scheduler (the adapters, whose own
``scheduler.step`` runs). The loop's hooks, and who uses them:

========================  ====================================================================
hook                      callers
========================  ====================================================================
``guide(v) -> v``         classifier-free guidance of the model step's output: every edit of
                          ``dit.editing`` and ``dit.adapters.base``, ``edge.backends.executor``
``pinned`` (Trajectory)   tokens held on the template's forward-noised trajectory, re-noised
                          at every step: ``rows`` = the unmasked tokens in ``full_edit`` and
                          ``pinned_reference_edit``; every token (``rows=None``) with
                          ``integrate=False`` in ``template_run`` (capture only, no update)
``before_step(s, x)``     ``dit.editing.cached_edit``'s ``on_latent`` (output-PSNR profiling)
``after_step(s)``         ``on_step`` of the two ``cached_edit`` and of ``ShardExecutor.edit``
``start``                 ``dit.editing.cached_edit``'s ``start_step`` (resume at a step)
========================  ====================================================================

Everything else rides in the model step's attention hook (``dit.editing``: ``CaptureHook``,
``CachedHook``, ``ImportanceHook``, ``PinHook``; ``dit.adapters``: ``AdapterHook`` and
``Pins``; regional execution: ``cached_edit(hook_factory=...)``). Regional execution's own
step-skipping loop (``dit.regional.run_regional``) decides per patch which tokens run and
keeps its own update; it is not a plain denoising loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from sakura.dit.model import MMDiT, TokenBatch, grid_positions, patchify, unpatchify


def schedule(steps: int, shift: float = 1.0) -> torch.Tensor:
    """``steps + 1`` timesteps from 1 to 0 (time-shifted as in SD3/Flux when shift != 1)."""
    t = torch.linspace(1.0, 0.0, steps + 1)
    return shift * t / (1 + (shift - 1) * t)


def renoise(x0: torch.Tensor, noise: torch.Tensor, t: Any) -> torch.Tensor:
    """The forward-noised latent ``x_t = (1 - t) x_0 + t e`` (``t`` a float or a tensor that
    broadcasts against ``x0``)."""
    return (1 - t) * x0 + t * noise


def noise_like(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(int(seed)))


def cfg_velocity(model: MMDiT, batch: TokenBatch, txt_uncond: torch.Tensor | None,
                 guidance: float, hook=None) -> torch.Tensor:
    """Velocity with classifier-free guidance (one batched call for cond + uncond)."""
    if txt_uncond is None or guidance == 1.0:
        return model(batch, hook)
    b = batch.img.shape[0]
    both = TokenBatch(
        img=torch.cat([batch.img, batch.img]), img_pos=batch.img_pos,
        txt=torch.cat([batch.txt, txt_uncond.expand_as(batch.txt)]),
        t=torch.cat([batch.t, batch.t]),
        ref=None if batch.ref is None else torch.cat([batch.ref, batch.ref]),
        ref_pos=batch.ref_pos,
    )
    v = model(both, hook)
    cond, uncond = v[:b], v[b:]
    return uncond + guidance * (cond - uncond)


# ----------------------------------------------------------------------------- the loop


class Steps(Protocol):
    """A step rule of :func:`denoise`."""

    @property
    def steps(self) -> int: ...

    def timestep(self, s: int) -> Any:
        """What the model is conditioned on at step ``s``."""

    def sigma(self, s: int) -> Any:
        """The noise level ``t`` of the latent entering step ``s`` (for :func:`renoise`)."""

    def step(self, s: int, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The latent after step ``s``."""


@dataclass(frozen=True)
class EulerSteps:
    """Euler steps over ``ts`` (``steps + 1`` timesteps, e.g. :func:`schedule`); the model
    sees ``t`` itself."""

    ts: torch.Tensor

    @property
    def steps(self) -> int:
        return len(self.ts) - 1

    def timestep(self, s: int) -> torch.Tensor:
        return self.ts[s]

    def sigma(self, s: int) -> torch.Tensor:
        return self.ts[s]

    def step(self, s: int, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + (self.ts[s + 1] - self.ts[s]) * v


@dataclass(frozen=True)
class SchedulerSteps:
    """A diffusers flow-matching scheduler (``set_timesteps`` done) as the step rule: the
    model sees ``scheduler.timesteps[s]`` (``sigma * 1000``), the update is the scheduler's
    own ``step`` (in float32)."""

    scheduler: Any
    steps: int

    def timestep(self, s: int) -> torch.Tensor:
        return self.scheduler.timesteps[s]

    def sigma(self, s: int) -> float:
        return float(self.scheduler.sigmas[s])

    def step(self, s: int, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = self.scheduler.timesteps[s]
        return self.scheduler.step(v, t, x, return_dict=False)[0].float()


@dataclass(frozen=True)
class Trajectory:
    """The template's forward-noised trajectory ``renoise(x0, noise, t)``; ``rows`` the
    token indices held on it (dim 1 of the latent), None for every token."""

    x0: torch.Tensor
    noise: torch.Tensor
    rows: torch.Tensor | None = None

    def at(self, t: Any) -> torch.Tensor:
        return renoise(self.x0, self.noise, t)


def denoise(x: torch.Tensor, steps: Steps,
            model_step: Callable[[int, Any, torch.Tensor], Any], *,
            guide: Callable[[Any], torch.Tensor] | None = None,
            pinned: Trajectory | None = None, integrate: bool = True, start: int = 0,
            before_step: Callable[[int, torch.Tensor], None] | None = None,
            after_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """The denoising loop: for ``s`` in ``start .. steps.steps - 1``, hold the ``pinned``
    tokens on their trajectory at ``steps.sigma(s)``, call ``before_step(s, x)``, get ``v =
    model_step(s, steps.timestep(s), x)``, then (``integrate``) ``x = steps.step(s,
    guide(v), x)``, then ``after_step(s)``. Returns the last latent.

    ``integrate=False`` runs the model step for its side effects only (the template run,
    whose latent is the trajectory itself: ``pinned`` with ``rows=None``). ``x`` is not
    modified in place (pinned rows are written into a copy).
    """
    if pinned is not None and pinned.rows is not None:
        x = x.clone()
    for s in range(start, steps.steps):
        if pinned is not None:
            xt = pinned.at(steps.sigma(s))
            if pinned.rows is None:
                x = xt
            else:
                x[:, pinned.rows] = xt[:, pinned.rows]
        if before_step is not None:
            before_step(s, x)
        v = model_step(s, steps.timestep(s), x)
        if integrate:
            x = steps.step(s, v if guide is None else guide(v), x)
        if after_step is not None:
            after_step(s)
    return x


@torch.inference_mode()
def generate(model: MMDiT, txt: torch.Tensor, txt_uncond: torch.Tensor | None, size: int,
             seed: int, steps: int = 20, guidance: float = 3.0,
             ref_images: torch.Tensor | None = None) -> torch.Tensor:
    """Full generation: ``txt [B, T, 384]`` -> images ``[B, 3, size, size]`` in [-1, 1]."""
    cfg = model.cfg
    b = txt.shape[0]
    grid = size // cfg.patch_size
    pos = model.image_positions(grid)
    x = noise_like((b, grid * grid, cfg.patch_dim), seed)
    ref = ref_pos = None
    if ref_images is not None:
        ref = patchify(ref_images, cfg.patch_size)
        ref_pos = grid_positions(ref_images.shape[-1] // cfg.patch_size, cfg.pos_span, 1.0)

    def model_step(s: int, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        batch = TokenBatch(img=x, img_pos=pos, txt=txt, t=t.expand(b), ref=ref, ref_pos=ref_pos)
        return cfg_velocity(model, batch, txt_uncond, guidance)

    x = denoise(x, EulerSteps(schedule(steps)), model_step)
    return unpatchify(x, cfg.patch_size, cfg.in_channels, size).clamp(-1, 1)
