"""The adapter interface: SAKURA's masked editing and KV reuse on diffusers transformers.

A :class:`ModelAdapter` wraps one diffusers transformer (not a fork of it: the model's own
modules, forward and scheduler run) and installs SAKURA attention processors on every
attention module. While SAKURA runs a forward, the processors hand the query/key/value of the
tokens they compute to a :class:`dit.attention.AttentionHook` in SAKURA's layout
``[text, image, reference]`` (heads first), exactly as the default model's blocks do; outside
such a run they behave like the stock diffusers processors. So every hook of ``dit`` works on
every adapter, and the editing algorithms below are written once for all models:

* :meth:`ModelAdapter.template_run` - the template run on the forward-noised trajectory,
  capturing K/V of the unmasked image tokens (after QK-norm and RoPE) for every step and
  attention layer into a :class:`dit.cache.TemplateCache`;
* :meth:`ModelAdapter.cached_edit` - the device path: only text, masked (and uncached
  reference) tokens are computed, the template cache comes from a ``KVProvider``;
* :meth:`ModelAdapter.pinned_reference_edit` - the slow reference: every token computed, the
  unmasked hidden states pinned to the template run at the input of every block;
* :meth:`ModelAdapter.full_edit` (``local``) and :meth:`ModelAdapter.profile_importance`.

Each runs ``dit.sampler.denoise`` (the one denoising loop) with the pipeline's own scheduler
as its step rule (``SchedulerSteps``) and a model step that builds the step's
:class:`AdapterHook` per guidance branch.

Everything works in the model's latent token space (row-major token grid, ``[N, C]`` with
C = the transformer's input channels); VAEs and text encoders stay outside (see
``dit.adapters.pipeline``). The K/V of one attention call are one cache "block"; SD3.5's
dual-attention layers therefore contribute two blocks (``layer.i.attn``, ``layer.i.attn2``).
An adapter runs one forward at a time (it is not thread-safe).

The types are in ``dit.adapters.inputs`` (what the algorithms take and give),
``dit.adapters.processors`` (what the processors see of a running forward) and
``dit.adapters.hook`` (:class:`AdapterHook`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from sakura.dit.adapters.errors import AdapterError, InputError, UnsupportedError
from sakura.dit.adapters.hook import AdapterHook
from sakura.dit.adapters.inputs import (
    AdapterGeometry,
    AdapterRun,
    Conditioning,
    LatentImage,
    LatentRequest,
    LatentTemplate,
    token_mask,
)
from sakura.dit.adapters.processors import Branch, Channel, Pins, RunContext
from sakura.dit.attention import AttentionHook
from sakura.dit.cache import KVProvider, StepMemo, TemplateCache
from sakura.dit.sampler import SchedulerSteps, Trajectory, denoise, noise_like
from torch import nn

EDIT_SEED_OFFSET = 1_000_003  # same convention as dit.editing.edit_noise


class ModelAdapter(ABC):
    """One diffusers transformer with SAKURA processors installed (see the module doc)."""

    name: str = "adapter"
    supports_references: bool = False
    supports_prefix: bool = False

    def __init__(self, model: nn.Module, scheduler_config: dict[str, Any] | None = None,
                 name: str | None = None, pixels_per_token: int = 16):
        self.model = model.eval()
        self.name = name or self.name
        self.scheduler_config = dict(scheduler_config or self.default_scheduler_config())
        self.pixels_per_token = pixels_per_token
        self._channel = Channel()
        self._stock: dict[str, Any] = {}
        self.install()

    # -- model-specific --------------------------------------------------------------------

    @abstractmethod
    def install(self) -> None:
        """Install SAKURA processors on every attention module (keeping the stock ones)."""

    @abstractmethod
    def layers(self) -> list[nn.Module]:
        """The transformer blocks in execution order (pins and hidden capture hook them)."""

    @property
    @abstractmethod
    def block_names(self) -> list[str]:
        """One name per attention call of a forward (= one cache block), in order."""

    # every supported diffusers transformer names these config fields alike
    @property
    def heads(self) -> int:
        return int(self.model.config.num_attention_heads)

    @property
    def head_dim(self) -> int:
        return int(self.model.config.attention_head_dim)

    @property
    def latent_channels(self) -> int:
        """Channels of one latent token (the transformer's input)."""
        return int(self.model.config.in_channels)

    @abstractmethod
    def default_scheduler_config(self) -> dict[str, Any]:
        """The pipeline's scheduler config, used when the checkpoint ships none."""

    @abstractmethod
    def set_timesteps(self, scheduler, steps: int, tokens: int) -> None:
        """Set the scheduler's timesteps exactly as the model's pipeline does."""

    @abstractmethod
    def _velocity(self, x: torch.Tensor, rows: torch.Tensor, grid: tuple[int, int],
                  timestep: torch.Tensor, branch: Branch, hook: AttentionHook, *,
                  pins: Pins | None = None, keep: dict[int, torch.Tensor] | None = None
                  ) -> torch.Tensor:
        """The model-specific forward behind :meth:`velocity`."""

    def image_offset(self, layer: int, ctx: RunContext) -> int:
        """Row of the first target image token in ``layer``'s ``hidden_states`` input."""
        return 0

    def rope_option(self, geo: AdapterGeometry) -> dict[str, Any] | None:
        """``codec.lowrank`` ``rope`` option for the cached keys (None: no RoPE)."""
        return None

    def combine_guidance(self, v_cond: torch.Tensor, v_uncond: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """Classifier-free guidance as the model's pipeline combines it."""
        return v_uncond + scale * (v_cond - v_uncond)

    def prepare_branch(self, cond: Conditioning, refs: list[LatentImage] | None = None,
                       cache_refs: bool = True, embedded_guidance: float | None = None,
                       template: LatentTemplate | None = None) -> Branch:
        """Per-prompt state (references / prefix extracted once here when cached)."""
        if refs:
            raise UnsupportedError(f"{self.name} has no exact reference-image KV caching")
        return Branch(cond=cond, embedded_guidance=embedded_guidance)

    # -- shared ----------------------------------------------------------------------------

    @torch.inference_mode()
    def velocity(self, x: torch.Tensor, rows: torch.Tensor, grid: tuple[int, int],
                 timestep: torch.Tensor, branch: Branch, hook: AttentionHook, *,
                 pins: Pins | None = None, keep: dict[int, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """Velocity ``[1, M, C]`` (float32) of the image tokens ``x [1, M, C]`` at grid
        ``rows`` (``[M]``, row-major), at the scheduler ``timestep`` (``sigma * 1000``),
        under ``branch``'s prompt, with every attention call going through ``hook``.

        The primitive of everything else, and of regional execution: ``rows`` may be any
        subset (a patch), with the K/V of the other tokens supplied by ``hook``.
        """
        if x.shape[:2] != (1, len(rows)) or x.shape[-1] != self.latent_channels:
            raise InputError(f"x {tuple(x.shape)} does not fit {len(rows)} rows x "
                             f"{self.latent_channels} channels")
        return self._velocity(x, rows, grid, timestep, branch, hook, pins=pins, keep=keep)

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def restore_processors(self) -> None:
        """Put the stock diffusers processors back (the adapter is unusable afterwards)."""
        for name, module in self.model.named_modules():
            if name in self._stock:
                module.set_processor(self._stock[name])

    def model_info(self) -> dict[str, Any]:
        """What a pack manifest records about the model."""
        return {"name": self.name, "class": type(self.model).__name__,
                "config": {k: v for k, v in dict(self.model.config).items()
                           if not k.startswith("_")}}

    def block_costs(self) -> list[float]:
        """Relative compute of each cache block (parameters touched, mean 1)."""
        costs = self._block_params()
        mean = sum(costs) / len(costs)
        return [c / mean for c in costs]

    def _block_params(self) -> list[float]:
        return [float(sum(p.numel() for p in m.parameters())) for m in self.layers()]

    def token_mask(self, pixel_mask: torch.Tensor) -> torch.Tensor:
        """Pixel mask of the image ``[H, W]`` -> token mask ``[N]``."""
        return token_mask(pixel_mask, self.pixels_per_token)

    def geometry(self, template: LatentTemplate) -> AdapterGeometry:
        self._check_template(template)
        m = template.mask.bool()
        return AdapterGeometry(template.grid, m.nonzero().flatten(), (~m).nonzero().flatten(),
                               self.heads, self.head_dim, list(self.block_names))

    def make_scheduler(self, steps: int, tokens: int):
        """The pipeline's own scheduler, with the pipeline's timesteps for this resolution."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        self.set_timesteps(sched, steps, tokens)
        sched.set_begin_index(0)
        return sched

    def template_noise(self, template: LatentTemplate) -> torch.Tensor:
        return noise_like((1, template.tokens, self.latent_channels), template.seed)

    def edit_noise(self, template: LatentTemplate, seed: int) -> torch.Tensor:
        return noise_like((1, template.tokens, self.latent_channels), seed + EDIT_SEED_OFFSET)

    def compose(self, template: LatentTemplate, geo: AdapterGeometry,
                x_masked: torch.Tensor) -> torch.Tensor:
        """Template latents outside the mask, edited tokens inside -> ``[N, C]``."""
        out = template.latents.float().clone()
        out[geo.masked] = x_masked.reshape(-1, out.shape[-1]).to(out.dtype)
        return out

    @contextmanager
    def running(self, ctx: RunContext) -> Iterator[RunContext]:
        """Make ``ctx`` visible to the processors (and pin / capture hidden states) for one
        forward; always restored."""
        if self._channel.active is not None:
            raise AdapterError(f"{self.name}: one forward at a time per adapter")
        handles = []
        if ctx.pins is not None or ctx.keep is not None:
            for i, layer in enumerate(self.layers()):
                handles.append(layer.register_forward_pre_hook(partial(self._pre_block, i),
                                                               with_kwargs=True))
        self._channel.active = ctx
        try:
            yield ctx
        finally:
            self._channel.active = None
            for h in handles:
                h.remove()

    def _pre_block(self, layer: int, module: nn.Module, args, kwargs):
        ctx = self._channel.active
        if ctx is None:
            return None
        hidden = kwargs["hidden_states"]
        off = self.image_offset(layer, ctx)
        if ctx.keep is not None:
            n = len(ctx.rows)
            ctx.keep[layer] = hidden[0, off:off + n].float().cpu().clone()
        if ctx.pins is not None:
            rows = ctx.pins.rows.to(hidden.device)
            pinned = ctx.pins.hidden[layer].to(hidden.device, hidden.dtype)
            hidden = hidden.clone()
            hidden[:, off + rows] = pinned[rows]
            kwargs["hidden_states"] = hidden
            self.on_pinned(layer, module, hidden, off, ctx)
        return args, kwargs

    def on_pinned(self, layer: int, module: nn.Module, hidden: torch.Tensor, off: int,
                  ctx: RunContext) -> None:
        """After pinning ``layer``'s input (SD3.5 re-modulates the pinned rows here)."""
        return None

    def _check_template(self, template: LatentTemplate) -> None:
        n = template.tokens
        if template.latents.shape != (n, self.latent_channels):
            raise InputError(f"template latents {tuple(template.latents.shape)} do not fit grid "
                             f"{template.grid} x {self.latent_channels} channels of {self.name}")
        if template.mask.shape != (n,):
            raise InputError(f"token mask {tuple(template.mask.shape)} does not fit {n} tokens")

    def _branches(self, template: LatentTemplate, req: LatentRequest, cache_refs: bool
                  ) -> list[Branch]:
        out = [self.prepare_branch(req.cond, req.references, cache_refs,
                                   template.embedded_guidance, template)]
        if template.guidance != 1.0:
            if req.uncond is None:
                raise InputError(f"guidance {template.guidance} needs a negative prompt (uncond)")
            out.append(self.prepare_branch(req.uncond, req.references, cache_refs,
                                           template.embedded_guidance, template))
        return out

    def _guided(self, vs: list[torch.Tensor], scale: float) -> torch.Tensor:
        return vs[0] if len(vs) == 1 else self.combine_guidance(vs[0], vs[1], scale)

    def _steps(self, template: LatentTemplate) -> SchedulerSteps:
        """The pipeline's scheduler as the step rule of :func:`dit.sampler.denoise`."""
        return SchedulerSteps(self.make_scheduler(template.steps, template.tokens),
                              template.steps)

    def _guide(self, template: LatentTemplate) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        return partial(self._guided, scale=template.guidance)

    # -- the algorithms --------------------------------------------------------------------

    @torch.inference_mode()
    def template_run(self, template: LatentTemplate, keep_hidden: bool = False) -> AdapterRun:
        """Run the model on the template's forward-noised trajectory; capture K/V."""
        geo = self.geometry(template)
        steps = self._steps(template)
        x0 = template.latents.float()[None]
        e = self.template_noise(template)
        branch = self.prepare_branch(template.cond, None, True, template.embedded_guidance,
                                     template)
        rows = torch.arange(template.tokens)
        keys, values, hidden = [], [], []

        def capture(s: int, t: torch.Tensor, xt: torch.Tensor) -> None:
            hook = AdapterHook(heads=self.heads, extra=branch.extra, capture=geo.unmasked)
            keep: dict[int, torch.Tensor] | None = {} if keep_hidden else None
            self.velocity(xt, rows, template.grid, t, branch, hook, keep=keep)
            keys.append(torch.stack([hook.keys[b] for b in range(self.num_blocks)]))
            values.append(torch.stack([hook.values[b] for b in range(self.num_blocks)]))
            if keep is not None:
                hidden.append(keep)

        denoise(x0, steps, capture, pinned=Trajectory(x0, e), integrate=False)
        sched = steps.scheduler
        k, v = torch.stack(keys), torch.stack(values)
        cache = TemplateCache(keys=k, values=v, importance=torch.zeros(k.shape[:3]),
                              token_index=geo.unmasked.clone(),
                              timesteps=sched.sigmas[:-1].float().clone(), num_heads=self.heads)
        return AdapterRun(cache, geo, hidden)

    @torch.inference_mode()
    def cached_edit(self, template: LatentTemplate, geo: AdapterGeometry, provider: KVProvider,
                    req: LatentRequest, *, cache_refs: bool = True, hook_factory=None,
                    on_step=None) -> torch.Tensor:
        """The device path: text + masked (+ uncached reference) tokens are computed, the
        template cache of the unmasked tokens comes from ``provider`` step by step, block by
        block. Returns the composed latents ``[N, C]``.

        ``hook_factory(step, branch) -> AttentionHook`` replaces the default cached hook
        (importance profiling, regional execution).
        """
        branches = self._branches(template, req, cache_refs)
        if len(branches) > 1:  # the branches run one after the other: one fetch per block
            provider = StepMemo(provider)

        def model_step(s: int, t: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
            vs = []
            for br in branches:
                hook = (hook_factory(s, br) if hook_factory else
                        AdapterHook(heads=self.heads, extra=br.extra, provider=provider, step=s,
                                    key_shift=br.key_shift))
                vs.append(self.velocity(x, geo.masked, template.grid, t, br, hook))
            return vs

        x = denoise(self.edit_noise(template, req.seed)[:, geo.masked], self._steps(template),
                    model_step, guide=self._guide(template), after_step=on_step)
        return self.compose(template, geo, x[0])

    @torch.inference_mode()
    def pinned_reference_edit(self, template: LatentTemplate, run: AdapterRun,
                              req: LatentRequest) -> torch.Tensor:
        """Slow reference: every token computed (references recomputed every step), the
        unmasked hidden states pinned to the template run's at every block input."""
        if not run.hidden:
            raise InputError("template_run(..., keep_hidden=True) is needed for the reference")
        geo = run.geometry
        branches = self._branches(template, req, cache_refs=False)
        x0 = template.latents.float()[None]
        rows = torch.arange(template.tokens)

        def model_step(s: int, t: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
            pins = Pins(run.hidden[s], geo.unmasked, template.cond)
            return [self.velocity(x, rows, template.grid, t, br,
                                  AdapterHook(heads=self.heads, extra=br.extra), pins=pins)
                    for br in branches]

        x = denoise(self.edit_noise(template, req.seed), self._steps(template), model_step,
                    guide=self._guide(template),
                    pinned=Trajectory(x0, self.template_noise(template), geo.unmasked))
        return self.compose(template, geo, x[0, geo.masked])

    @torch.inference_mode()
    def full_edit(self, template: LatentTemplate, req: LatentRequest) -> torch.Tensor:
        """``local``: no cache. Every token computed each step; the unmasked ones re-noised to
        the template trajectory (the same masked-editing rule, computed locally)."""
        geo = self.geometry(template)
        branches = self._branches(template, req, cache_refs=True)
        x0 = template.latents.float()[None]
        rows = torch.arange(template.tokens)

        def model_step(s: int, t: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
            return [self.velocity(x, rows, template.grid, t, br,
                                  AdapterHook(heads=self.heads, extra=br.extra))
                    for br in branches]

        x = denoise(self.edit_noise(template, req.seed), self._steps(template), model_step,
                    guide=self._guide(template),
                    pinned=Trajectory(x0, self.template_noise(template), geo.unmasked))
        return self.compose(template, geo, x[0, geo.masked])

    @torch.inference_mode()
    def profile_importance(self, template: LatentTemplate, run: AdapterRun,
                           requests: list[LatentRequest]) -> torch.Tensor:
        """Attention mass of masked queries on each cached token, ``[S, B, U]``, summed over
        heads, queries, guidance branches and requests; stored into the cache."""
        cache = run.cache
        imp = torch.zeros(cache.steps, cache.blocks, cache.tokens)
        for req in requests:
            self.cached_edit(template, run.geometry, cache, req, hook_factory=lambda s, br: (
                AdapterHook(heads=self.heads, extra=br.extra, provider=cache, step=s,
                            key_shift=br.key_shift, importance=imp[s])))
        cache.importance = imp
        return imp



__all__ = ["EDIT_SEED_OFFSET", "ModelAdapter"]
