"""Images and prompts <-> the adapters' latent tokens and conditionings, as each pipeline
does it (its own VAE normalization and packing, its own ``encode_prompt``).

``ImageLatents`` wraps the checkpoint's VAE (``<model>/vae``): ``encode(image)`` ->
:class:`LatentImage` tokens on the transformer's row-major token grid, ``decode(tokens,
grid)`` -> image; both deterministic (the VAE's mode, as the pipelines' ``"argmax"``).
``to_tokens`` / ``from_tokens`` are the pure normalization + packing steps:

* FLUX.2: 2x2 patchify of the 32-channel latent, batch-norm statistics of the VAE, flatten;
* SD3.5: ``(z - shift_factor) * scaling_factor``; tokens are the transformer's patches;
* QwenImage: per-channel ``latents_mean`` / ``latents_std``, 2x2 packing (frame axis of 1);
* QwenImage 2.1: per-channel mean / std, no packing (patch size 1).

``encode_prompt(pipe, family, text)`` calls the pipeline's own text encoders (loaded from
the same checkpoint folder) and returns a :class:`Conditioning`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sakura.dit.adapters.errors import InputError, ModelPathError
from sakura.dit.adapters.inputs import Conditioning, LatentImage

FAMILIES = {
    "Flux2Transformer2DModel": "flux2",
    "SD3Transformer2DModel": "sd3",
    "QwenImageTransformer2DModel": "qwenimage",
    "QwenImage21Transformer2DModel": "qwenimage21",
}


def family_of(adapter) -> str:
    return FAMILIES[type(adapter.model).__name__]


@dataclass
class ImageLatents:
    """A model family's VAE with the pipeline's latent normalization and packing."""

    vae: Any
    family: str
    patch: int = 2  # SD3: the transformer's patch size

    # -- pure normalization + packing ------------------------------------------------------

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.vae.config
        if self.family == "flux2":
            mean = self.vae.bn.running_mean.view(1, -1, 1, 1)
            std = torch.sqrt(self.vae.bn.running_var.view(1, -1, 1, 1) + cfg.batch_norm_eps)
        elif self.family == "sd3":
            shift = float(cfg.shift_factor or 0.0)
            mean = torch.full((1, 1, 1, 1), shift)
            std = torch.full((1, 1, 1, 1), 1.0 / float(cfg.scaling_factor))
        else:
            mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1)
            std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1)
        return mean.to(z.device, z.dtype), std.to(z.device, z.dtype)

    def _fold(self) -> int:
        return {"flux2": 2, "sd3": self.patch, "qwenimage": 2, "qwenimage21": 1}[self.family]

    def to_tokens(self, z: torch.Tensor) -> LatentImage:
        """VAE latent ``[1, c, h, w]`` -> normalized tokens on the ``(h/f, w/f)`` grid."""
        f = self._fold()
        b, c, h, w = z.shape
        if h % f or w % f:
            raise InputError(f"latent {h}x{w} is not divisible by the packing factor {f}")
        x = z.reshape(b, c, h // f, f, w // f, f).permute(0, 1, 3, 5, 2, 4)
        x = x.reshape(b, c * f * f, h // f, w // f)
        if self.family == "flux2":  # statistics of the patchified channels
            mean, std = self._stats(x)
            x = (x - mean) / std
        else:
            mean, std = self._stats(z)
            zn = (z - mean) / std
            x = zn.reshape(b, c, h // f, f, w // f, f).permute(0, 1, 3, 5, 2, 4)
            x = x.reshape(b, c * f * f, h // f, w // f)
        tokens = x[0].flatten(1).transpose(0, 1).contiguous()
        return LatentImage(tokens, (h // f, w // f))

    def from_tokens(self, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Inverse of :meth:`to_tokens` -> VAE latent ``[1, c, h, w]``."""
        f = self._fold()
        gh, gw = grid
        x = tokens.transpose(0, 1).reshape(1, -1, gh, gw)
        c = x.shape[1] // (f * f)
        if self.family == "flux2":
            mean, std = self._stats(x)
            x = x * std + mean
        z = x.reshape(1, c, f, f, gh, gw).permute(0, 1, 4, 2, 5, 3).reshape(1, c, gh * f, gw * f)
        if self.family != "flux2":
            mean, std = self._stats(z)
            z = z * std + mean
        return z

    # -- through the VAE -------------------------------------------------------------------

    def _video(self) -> bool:
        return self.family in ("qwenimage", "qwenimage21")

    @torch.inference_mode()
    def encode(self, image: torch.Tensor) -> LatentImage:
        """Image ``[3, H, W]`` in [-1, 1] -> latent tokens."""
        dev, dt = next(self.vae.parameters()).device, next(self.vae.parameters()).dtype
        x = image[None].to(dev, dt)
        if self._video():
            x = x[:, :, None]
        z = self.vae.encode(x).latent_dist.mode()
        if self._video():
            z = z[:, :, 0]
        return self.to_tokens(z.float())

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Latent tokens -> image ``[3, H, W]`` in [-1, 1]."""
        dev, dt = next(self.vae.parameters()).device, next(self.vae.parameters()).dtype
        z = self.from_tokens(tokens.float(), grid).to(dev, dt)
        if self._video():
            z = z[:, :, None]
        img = self.vae.decode(z, return_dict=False)[0]
        if self._video():
            img = img[:, :, 0]
        return img[0].float().clamp(-1, 1).cpu()


def load_image_latents(adapter, path: str | Path, dtype: torch.dtype | None = None
                       ) -> ImageLatents:
    """The VAE of the pipeline folder ``path`` (``path/vae``) for ``adapter``'s family."""
    import diffusers

    vdir = Path(path).expanduser() / "vae"
    cfg_file = vdir / "config.json"
    if not cfg_file.is_file():
        raise ModelPathError(f"no VAE at {vdir} (a full pipeline folder is needed to encode "
                             "and decode images)")
    cls_name = json.loads(cfg_file.read_text()).get("_class_name", "")
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise ModelPathError(f"{cfg_file}: unknown VAE class {cls_name!r}")
    try:
        vae = cls.from_pretrained(vdir, torch_dtype=dtype, local_files_only=True,
                                  use_safetensors=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelPathError(f"cannot load the VAE from {vdir}: {exc}") from None
    vae = vae.to(adapter.device).eval()
    patch = int(getattr(adapter.model.config, "patch_size", 2))
    return ImageLatents(vae, family_of(adapter), patch)


@torch.inference_mode()
def encode_prompt(pipe, family: str, text: str) -> Conditioning:
    """The pipeline's own text encoding of ``text`` (unpadded where the model masks padding)."""
    if family == "flux2":
        embeds, _ = pipe.encode_prompt(prompt=text)
        return Conditioning(embeds.float().cpu())
    if family == "sd3":
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=text, prompt_2=None, prompt_3=None,
                                                  do_classifier_free_guidance=False)
        return Conditioning(embeds.float().cpu(), pooled.float().cpu())
    if family == "qwenimage":
        embeds, mask = pipe.encode_prompt(prompt=text)
        if mask is not None:
            embeds = embeds[:, mask[0].bool()]
        return Conditioning(embeds.float().cpu())
    if family == "qwenimage21":
        embeds, mask, slots = pipe.encode_prompt(image=None, prompt=text)
        if mask is not None:
            keep = mask[0].bool()
            embeds, slots = embeds[:, keep], slots[0][: keep.shape[0]][keep]
        else:
            slots = slots[0][: embeds.shape[1]]
        return Conditioning(embeds.float().cpu(), image_slots=slots.bool().cpu())
    raise InputError(f"unknown model family {family!r}")


def load_pipeline(adapter, path: str | Path, dtype: torch.dtype | None = None):
    """The checkpoint folder's diffusers pipeline, sharing the adapter's transformer (for
    :func:`encode_prompt`). Needs ``model_index.json`` and the text encoders."""
    from diffusers import DiffusionPipeline

    root = Path(path).expanduser()
    if not (root / "model_index.json").is_file():
        raise ModelPathError(f"{root} has no model_index.json: prompts need the full pipeline")
    try:
        index = json.loads((root / "model_index.json").read_text())
    except ValueError as exc:
        raise ModelPathError(f"{root / 'model_index.json'} is not valid JSON: {exc}") from None
    # components saved as [null, null] (e.g. SD3.5 without its T5 encoder) load as None
    absent = {k: None for k, v in index.items()
              if not k.startswith("_") and isinstance(v, list) and v == [None, None]}
    try:
        return DiffusionPipeline.from_pretrained(root, transformer=adapter.model,
                                                 torch_dtype=dtype, local_files_only=True,
                                                 **absent)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelPathError(f"cannot load the pipeline from {root}: {exc}") from None


__all__ = ["FAMILIES", "ImageLatents", "encode_prompt", "family_of", "load_image_latents",
           "load_pipeline"]
