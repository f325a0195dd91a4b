"""One interface for the callers (``sakura build``, ``sakura edit``, benches) over the default
SAKURA model and every diffusers adapter.

An :class:`EditEngine` takes what a catalog entry holds (pixel image ``[3, H, W]`` in
[-1, 1], pixel mask ``[H, W]``, prompt strings, seeds, steps, guidance) and returns pixel
images, so a caller never touches latents, text encoders or model-specific types:

    engine = load_engine(None)                                  # the shipped SAKURA model
    engine = load_engine("flux2-klein-4b", "/models/klein")     # a local diffusers checkpoint
    prep = engine.prepare(image, mask, prompt, seed, steps, guidance)
    run = engine.template_run(prep)                  # run.cache: a dit.cache.TemplateCache
    engine.profile_importance(prep, run, [engine.request(p, seed) for p, seed in ...])
    image = engine.edit(prep, provider, engine.request(user_prompt, seed), on_step=...)

``model_info()`` is the manifest's ``model`` entry, ``block_costs()`` the relative compute
of each cache block (a shard's ``compute_cost`` is the sum over its blocks) and
``rope_option(prep)`` the ``rope`` option of the low-rank codecs (None without RoPE).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from sakura.dit.adapters.base import ModelAdapter
from sakura.dit.adapters.errors import InputError, ModelPathError
from sakura.dit.adapters.inputs import LatentRequest, LatentTemplate
from sakura.dit.adapters.latents import (
    ImageLatents,
    encode_prompt,
    family_of,
    load_image_latents,
    load_pipeline,
)
from sakura.dit.adapters.registry import MODELS, ModelSpec, load_adapter, read_checkpoint
from sakura.dit.cache import KVProvider
from sakura.dit.editing import (
    EditRequest,
    Geometry,
    RecomputedKV,
    Template,
    cached_edit,
    full_edit,
    profile_importance,
    template_run,
)
from sakura.dit.rope import rope_option
from sakura.dit.text import TextEncoder
from sakura.dit.weights import DEFAULT_WEIGHTS, load_model


@dataclass
class Prepared:
    """A template ready for one engine: the engine's template object and its geometry."""

    template: Any
    geometry: Any
    prompt: str

    @property
    def token_mask_ratio(self) -> float:
        g = self.geometry
        return len(g.masked) / (len(g.masked) + len(g.unmasked))


class EditEngine(ABC):
    """What build and edit need from a model (see the module doc)."""

    name: str
    default_steps: int = 20
    default_guidance: float = 3.0
    # whether edit() computes a step with every token when its provider raises
    # dit.cache.StepLate (the device's local fallback; dit.editing.cached_edit does)
    computes_late_steps: bool = False

    def recomputes_late_steps(self, prep: Prepared) -> bool:
        """Whether that step is a recompute step for this template (exact K/V: the
        template's own, recomputed; ``dit.editing.RecomputedKV``)."""
        return False

    @abstractmethod
    def prepare(self, image: torch.Tensor, mask: torch.Tensor, prompt: str, seed: int,
                steps: int | None = None, guidance: float | None = None,
                strength: float = 1.0) -> Prepared: ...

    def device_prepare(self, template: Any) -> Prepared:
        """The device's view of a published template (a ``dit.editing.Template`` built from
        the catalog entry's pixels, mask, seed, steps, guidance, strength and prompt)."""
        return self.prepare(template.image, template.mask, template.prompt, template.seed,
                            template.steps, template.guidance, template.strength)

    @property
    def weights_id(self) -> str | None:
        """What identifies the weights (a manifest's ``model.weights_sha256`` or
        ``model.weights_fingerprint``): a pack built with other weights does not fit."""
        return None

    @abstractmethod
    def request(self, prompt: str, seed: int, negative: str = "",
                references: torch.Tensor | None = None) -> Any: ...

    @abstractmethod
    def template_run(self, prep: Prepared) -> Any:
        """The template run; the result's ``cache`` is a ``TemplateCache``."""

    @abstractmethod
    def profile_importance(self, prep: Prepared, run: Any, requests: list[Any]) -> torch.Tensor: ...

    @abstractmethod
    def edit(self, prep: Prepared, provider: KVProvider, req: Any, on_step=None) -> torch.Tensor:
        """Cached masked edit -> image ``[3, H, W]`` in [-1, 1]."""

    @abstractmethod
    def local_edit(self, prep: Prepared, req: Any) -> torch.Tensor:
        """``local``: the whole model on the device, no cache -> image."""

    @abstractmethod
    def model_info(self) -> dict[str, Any]: ...

    @abstractmethod
    def block_costs(self) -> list[float]: ...

    @abstractmethod
    def rope_option(self, prep: Prepared) -> dict[str, Any] | None: ...

    @abstractmethod
    def cache_geometry(self, prep: Prepared) -> dict[str, int]:
        """``steps, blocks, tokens, channels, heads`` of the template's cache (what a pack
        manifest's ``geometry`` must say)."""


class DefaultEngine(EditEngine):
    """The shipped SAKURA MMDiT with its MiniLM text encoder (``dit.editing``)."""

    name = "sakura-mmdit"
    computes_late_steps = True

    def recomputes_late_steps(self, prep: Prepared) -> bool:
        return RecomputedKV.possible(prep.template)

    def __init__(self, model, encoder=None, weights_sha256: str | None = None,
                 name: str | None = None):
        self.model, self._encoder = model, encoder
        self.weights_sha256 = weights_sha256
        if name is not None:  # a trained model of another class in the MMDiT's form
            self.name = name

    @property
    def encoder(self):
        if self._encoder is None:  # MiniLM loads in seconds: only when a prompt is encoded
            self._encoder = TextEncoder(self.model.cfg.text_tokens)
        return self._encoder

    @property
    def weights_id(self):
        return self.weights_sha256

    def device_prepare(self, template) -> Prepared:
        # the device's template comes without prompt embeddings: the cached edit never needs
        # them, the local fallback's recompute step does (dit.editing.RecomputedKV), so the
        # device encodes the template's public prompt once
        if not RecomputedKV.possible(template) and template.prompt:
            template = replace(template, txt=self.encoder.encode([template.prompt]))
        return Prepared(template, Geometry.of(self.model, template), template.prompt)

    def prepare(self, image, mask, prompt, seed, steps=None, guidance=None,
                strength=1.0) -> Prepared:
        tpl = Template(image=image, mask=mask, txt=self.encoder.encode([prompt]), seed=seed,
                       steps=steps or self.default_steps,
                       guidance=self.default_guidance if guidance is None else guidance,
                       strength=strength)
        return Prepared(tpl, Geometry.of(self.model, tpl), prompt)

    def request(self, prompt, seed, negative="", references=None):
        return EditRequest(txt=self.encoder.encode([prompt]),
                           txt_uncond=self.encoder.encode([negative]), seed=seed,
                           ref_images=references)

    def template_run(self, prep):
        return template_run(self.model, prep.template)

    def profile_importance(self, prep, run, requests):
        return profile_importance(self.model, prep.template, run, requests)

    def edit(self, prep, provider, req, on_step=None):
        return cached_edit(self.model, prep.template, prep.geometry, provider, req,
                           on_step=on_step)

    def local_edit(self, prep, req):
        return full_edit(self.model, prep.template, req)

    def model_info(self):
        info = {"name": self.name, "config": self.model.cfg.to_dict()}
        if self.weights_sha256:
            info["weights_sha256"] = self.weights_sha256
        return info

    def block_costs(self):
        return [2.0 if b < self.model.cfg.double_blocks else 1.0
                for b in range(self.model.cfg.num_blocks)]

    def cache_geometry(self, prep):
        cfg = self.model.cfg
        return {"steps": prep.template.steps, "blocks": cfg.num_blocks,
                "tokens": len(prep.geometry.unmasked), "channels": cfg.hidden_size,
                "heads": cfg.num_heads}

    def rope_option(self, prep):
        cfg, geo = self.model.cfg, prep.geometry
        return rope_option(geo.pos[geo.unmasked], cfg.rope_axes, cfg.rope_theta, cfg.num_heads)


class DiffusersEngine(EditEngine):
    """A diffusers adapter with its checkpoint's VAE and text encoding (``encode``)."""

    def __init__(self, adapter: ModelAdapter, latents: ImageLatents,  # (or PixelLatents)
                 encode: Callable[[str], Any], default_steps: int = 28,
                 default_guidance: float = 1.0, fingerprint: str | None = None):
        self.adapter, self.latents = adapter, latents
        self.encode = lru_cache(maxsize=256)(encode)
        self.name = adapter.name
        self.default_steps, self.default_guidance = default_steps, default_guidance
        self.fingerprint = fingerprint

    @property
    def weights_id(self):
        return self.fingerprint

    def prepare(self, image, mask, prompt, seed, steps=None, guidance=None,
                strength=1.0) -> Prepared:
        if strength != 1.0:
            raise InputError(f"strength {strength}: edits of {self.name} models start from "
                             "pure noise (strength 1); strength < 1 is implemented for the "
                             "sakura MMDiT")
        lat = self.latents.encode(image)
        tmask = self.adapter.token_mask(mask)
        if tmask.numel() != lat.grid[0] * lat.grid[1]:
            raise InputError(f"mask {tuple(mask.shape)} gives {tmask.numel()} tokens, the image "
                             f"{lat.grid[0]}x{lat.grid[1]}: sizes must be multiples of "
                             f"{self.adapter.pixels_per_token} pixels")
        tpl = LatentTemplate(lat.tokens, lat.grid, tmask, self.encode(prompt), seed=seed,
                             steps=steps or self.default_steps,
                             guidance=self.default_guidance if guidance is None else guidance)
        return Prepared(tpl, self.adapter.geometry(tpl), prompt)

    def request(self, prompt, seed, negative="", references=None) -> LatentRequest:
        refs = [self.latents.encode(r) for r in references] if references is not None else []
        return LatentRequest(self.encode(prompt), self.encode(negative), seed, refs)

    def template_run(self, prep):
        return self.adapter.template_run(prep.template)

    def profile_importance(self, prep, run, requests):
        return self.adapter.profile_importance(prep.template, run, requests)

    def _image(self, prep, tokens):
        return self.latents.decode(tokens, prep.template.grid)

    def edit(self, prep, provider, req, on_step=None):
        out = self.adapter.cached_edit(prep.template, prep.geometry, provider, req,
                                       on_step=on_step)
        return self._image(prep, out)

    def local_edit(self, prep, req):
        return self._image(prep, self.adapter.full_edit(prep.template, req))

    def model_info(self):
        info = self.adapter.model_info()
        if self.fingerprint:
            info["weights_fingerprint"] = self.fingerprint
        return info

    def block_costs(self):
        return self.adapter.block_costs()

    def cache_geometry(self, prep):
        geo = prep.geometry
        return {"steps": prep.template.steps, "blocks": len(geo.blocks),
                "tokens": len(geo.unmasked), "channels": geo.channels, "heads": geo.heads}

    def rope_option(self, prep):
        from sakura.dit.adapters.qwenimage21 import QwenImage21Adapter  # lazy: diffusers

        if isinstance(self.adapter, QwenImage21Adapter):
            return self.adapter.rope_option(prep.geometry,
                                            frame=self.adapter.frame_of(prep.template.cond))
        return self.adapter.rope_option(prep.geometry)


def _mmdit_form_engine(spec: ModelSpec, model_path: str | Path) -> DefaultEngine:
    """SAKURA's trained FLUX.2 (``sakura-flux2``): its diffusers checkpoint folder, checked
    against the registry's config like any adapter checkpoint, converted exactly into the
    MMDiT's form (``dit.flux2_native``: velocity within 2.2e-6 of diffusers' forward), so
    that every path of the shipped model runs it, the native runtime's compiled shard
    graphs included, with the MMDiT's sampler it was trained and evaluated with. Its
    identity in manifests is the checkpoint fingerprint, its name the registry's."""
    from sakura.dit.flux2_native import mmdit_form  # lazy: diffusers, this model only
    from sakura.dit.flux2_pixel import load_flux2  # lazy: diffusers, this model only

    read_checkpoint(spec.name, model_path)  # the registry's checks of the folder's config
    net = mmdit_form(load_flux2(model_path))
    return DefaultEngine(net, TextEncoder(net.cfg.text_tokens),
                         checkpoint_fingerprint(model_path), name=spec.name)


def load_engine(model: str | None = None, model_path: str | Path | None = None, *,
                weights: str | Path | None = None, dtype: torch.dtype | None = None,
                device: str | torch.device = "cpu") -> EditEngine:
    """``model=None``: the shipped SAKURA model (``weights`` or the default); else the diffusers
    checkpoint folder ``model_path`` (transformer, VAE and text encoders) as ``model``."""
    if model is None:
        if model_path is not None:
            raise ModelPathError("--model-path needs --model (the checkpoint's model name)")

        path = Path(weights) if weights else DEFAULT_WEIGHTS
        net = load_model(path)
        return DefaultEngine(net, TextEncoder(net.cfg.text_tokens), _sha256(path))
    from functools import partial

    spec = MODELS.get(model)
    if spec is not None and spec.mmdit_form:  # SAKURA's own FLUX.2 (dit/flux2_pixel.py)
        return _mmdit_form_engine(spec, model_path if model_path is not None
                                  else spec.default_path)
    if model_path is None:
        raise ModelPathError(f"--model {model} needs --model-path (a local checkpoint folder)")
    adapter = load_adapter(model, model_path, dtype=dtype, device=device)
    latents = load_image_latents(adapter, model_path, dtype=dtype)
    pipe = load_pipeline(adapter, model_path, dtype=dtype)
    spec = MODELS[model]
    return DiffusersEngine(adapter, latents, partial(encode_prompt, pipe, family_of(adapter)),
                           spec.default_steps, spec.default_guidance,
                           checkpoint_fingerprint(model_path))


def _sha256(path: Path) -> str | None:
    import hashlib

    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def checkpoint_fingerprint(path: str | Path) -> str:
    """A cheap identity of a diffusers checkpoint folder: sha256 over every config file and,
    for each weight file, its name, size, safetensors header (tensor names, shapes, dtypes,
    offsets) and first and last MiB. Hashing all of a multi-GB checkpoint at every
    ``sakura edit`` would take tens of seconds; this catches another checkpoint, another
    variant or a re-saved file, not a deliberate in-place edit of weights in the middle."""
    import hashlib

    root = Path(path).expanduser()
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        size = f.stat().st_size
        h.update(f"{rel}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if f.suffix in (".json", ".txt", ".jinja", ".model") or size <= 2 << 20:
                h.update(fh.read())
                continue
            h.update(fh.read(1 << 20))
            fh.seek(size - (1 << 20))
            h.update(fh.read(1 << 20))
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if 0 < n < (100 << 20):
                    h.update(fh.read(n))
    return h.hexdigest()


__all__ = ["DefaultEngine", "DiffusersEngine", "EditEngine", "Prepared", "checkpoint_fingerprint",
           "load_engine"]
