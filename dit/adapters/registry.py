"""Model names for ``--model`` and loading a local diffusers checkpoint into an adapter.

``load_adapter(name, path)`` accepts either a full pipeline folder (``model_index.json`` with
``transformer/`` and optionally ``scheduler/``) or a bare transformer folder (``config.json``
+ weights). It checks that the checkpoint is the model ``name`` announces (class, and for the
named released checkpoints their architecture) before loading any weights, then loads with
``from_pretrained`` and wraps the model. Errors are :mod:`dit.adapters.errors` classes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from sakura.dit.adapters.base import ModelAdapter
from sakura.dit.adapters.errors import CheckpointMismatchError, ModelPathError, UnknownModelError


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` name: diffusers class, adapter, and (for a released checkpoint) the
    architecture keys its ``config.json`` must have."""

    name: str
    model_class: str
    adapter: str
    description: str
    config: dict[str, Any] = field(default_factory=dict)
    default_steps: int = 28
    default_guidance: float = 1.0  # true-CFG scale of the model's pipeline (1 = off)
    # pixel-space models (SAKURA's own FLUX.2, dit/flux2_pixel.py): pixels a token covers a
    # side, the image is its patches and prompts are MiniLM's; None: the checkpoint's VAE and
    # text encoders (dit/adapters/latents.py)
    pixels_per_token: int | None = None
    # where the weights are when --model-path is not given (None: it must be given)
    default_path: Path | None = None
    # True: a model trained here with the MMDiT's sampler whose checkpoint converts exactly
    # into the MMDiT's form (dit/flux2_native.py): it loads as that form and runs wherever
    # the shipped model runs, the native runtime's compiled graphs included
    mmdit_form: bool = False
    # whether an edit may carry reference images: not a model trained here without them
    # (sakura train --arch flux2 refuses references, dit/train.py)
    references: bool = True


FLUX2_KLEIN_4B = {"num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24,
                  "attention_head_dim": 128, "joint_attention_dim": 7680, "in_channels": 128,
                  "patch_size": 1, "guidance_embeds": False}
FLUX2_KLEIN_9B = {"num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32,
                  "attention_head_dim": 128, "joint_attention_dim": 12288, "in_channels": 128,
                  "patch_size": 1, "guidance_embeds": False}
FLUX2_DEV = {"num_layers": 8, "num_single_layers": 48, "num_attention_heads": 48,
             "attention_head_dim": 128, "joint_attention_dim": 15360, "in_channels": 128,
             "patch_size": 1, "guidance_embeds": True}
SD35_MEDIUM = {"num_layers": 24, "num_attention_heads": 24, "attention_head_dim": 64,
               "dual_attention_layers": list(range(13)), "in_channels": 16, "patch_size": 2,
               "joint_attention_dim": 4096, "pooled_projection_dim": 2048}
SD35_LARGE = {"num_layers": 38, "num_attention_heads": 38, "attention_head_dim": 64,
              "dual_attention_layers": [], "in_channels": 16, "patch_size": 2,
              "joint_attention_dim": 4096, "pooled_projection_dim": 2048}
QWENIMAGE_20B = {"num_layers": 60, "num_attention_heads": 24, "attention_head_dim": 128,
                 "in_channels": 64, "patch_size": 2, "joint_attention_dim": 3584}

#: SAKURA's second model (dit/flux2_pixel.py): a FLUX.2 transformer trained here on the emoji's
#: 4x4 pixel patches (48 channels) with MiniLM text (384), the MMDiT's layout of 2 double and 6
#: single blocks, 6 heads of 32
SAKURA_FLUX2 = {"patch_size": 1, "in_channels": 48, "num_layers": 2, "num_single_layers": 6,
                "attention_head_dim": 32, "num_attention_heads": 6, "joint_attention_dim": 384,
                "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
                "axes_dims_rope": (8, 8, 8, 8), "rope_theta": 100, "guidance_embeds": False}

SAKURA_FLUX2_DIR = Path(__file__).resolve().parents[1] / "weights" / "sakura-flux2"

_F2, _SD3 = "Flux2Transformer2DModel", "SD3Transformer2DModel"
_QI, _QI21 = "QwenImageTransformer2DModel", "QwenImage21Transformer2DModel"
_A_F2, _A_SD3 = "sakura.dit.adapters.flux2:Flux2Adapter", "sakura.dit.adapters.sd3:SD3Adapter"
_A_QI, _A_QI21 = "sakura.dit.adapters.qwenimage:QwenImageAdapter", "sakura.dit.adapters.qwenimage21:QwenImage21Adapter"

MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("flux2", _F2, _A_F2, "any Flux2Transformer2DModel checkpoint", default_steps=28,
              default_guidance=4.0),
    ModelSpec("flux2-dev", _F2, _A_F2, "FLUX.2 [dev] (32B, guidance-distilled)", FLUX2_DEV, 50),
    ModelSpec("flux2-klein-4b", _F2, _A_F2, "FLUX.2 [klein] 4B (step-distilled)", FLUX2_KLEIN_4B, 4),
    ModelSpec("flux2-klein-4b-kv", _F2, _A_F2, "FLUX.2 [klein] 4B, KV reference variant",
              FLUX2_KLEIN_4B, 4),
    ModelSpec("flux2-klein-9b", _F2, _A_F2, "FLUX.2 [klein] 9B (step-distilled)", FLUX2_KLEIN_9B, 4),
    ModelSpec("flux2-klein-9b-kv", _F2, _A_F2, "FLUX.2 [klein] 9B, KV reference variant",
              FLUX2_KLEIN_9B, 4),
    ModelSpec("sakura-flux2", _F2, _A_F2, "SAKURA's FLUX.2 model (pixel space, MiniLM text)",
              SAKURA_FLUX2, 20, 3.0, pixels_per_token=4, default_path=SAKURA_FLUX2_DIR,
              mmdit_form=True, references=False),
    ModelSpec("sd3", _SD3, _A_SD3, "any SD3Transformer2DModel checkpoint", default_guidance=4.5),
    ModelSpec("sd3.5-medium", _SD3, _A_SD3, "Stable Diffusion 3.5 Medium (dual attention)",
              SD35_MEDIUM, 40, 4.5),
    ModelSpec("sd3.5-large", _SD3, _A_SD3, "Stable Diffusion 3.5 Large", SD35_LARGE, 28, 3.5),
    ModelSpec("qwenimage", _QI, _A_QI, "any QwenImageTransformer2DModel checkpoint",
              default_steps=50, default_guidance=4.0),
    ModelSpec("qwenimage-20b", _QI, _A_QI, "Qwen-Image / Qwen-Image-Edit (20B)", QWENIMAGE_20B,
              50, 4.0),
    ModelSpec("qwenimage-2.1", _QI21, _A_QI21, "any QwenImage21Transformer2DModel (block-causal)",
              default_steps=50),
)}


def _norm(v: Any) -> Any:
    return [_norm(x) for x in v] if isinstance(v, (list, tuple)) else v


def find_checkpoint(path: str | Path) -> tuple[Path, Path | None]:
    """``(transformer folder, scheduler config file or None)`` of a local checkpoint."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ModelPathError(f"model path {root} does not exist")
    if not root.is_dir():
        raise ModelPathError(f"model path {root} is not a folder")
    for tdir in (root / "transformer", root):
        if (tdir / "config.json").is_file():
            sched = root / "scheduler" / "scheduler_config.json"
            return tdir, (sched if sched.is_file() else None)
    raise ModelPathError(f"no diffusers transformer under {root}: expected "
                         f"{root}/transformer/config.json or {root}/config.json")


def check_checkpoint(spec: ModelSpec, config: dict[str, Any], where: Path) -> None:
    """Raise :class:`CheckpointMismatchError` when ``config`` is not ``spec``'s model."""
    cls = config.get("_class_name")
    if cls != spec.model_class:
        raise CheckpointMismatchError(
            f"{where} holds a {cls or 'unknown'} checkpoint; --model {spec.name} needs "
            f"{spec.model_class}")
    wrong = [f"{k}={_norm(config.get(k))!r} (expected {_norm(v)!r})"
             for k, v in spec.config.items() if _norm(config.get(k)) != _norm(v)]
    if wrong:
        raise CheckpointMismatchError(
            f"{where} is not {spec.description}: " + ", ".join(wrong))


class CheckpointConfig(NamedTuple):
    """What a checkpoint folder says about itself, read before any weights."""

    spec: ModelSpec
    folder: Path  # the transformer folder (its config.json and weights)
    config: dict[str, Any]  # its config.json
    scheduler: dict[str, Any] | None  # scheduler_config.json without the ``_`` keys


def read_checkpoint(name: str, path: str | Path) -> CheckpointConfig:
    """The configs of the local checkpoint at ``path``, checked to be model ``name``; reads
    no weights (:func:`load_adapter` and the weightless ``regional.meta_adapter`` build on
    it). Raises :class:`UnknownModelError`, :class:`ModelPathError` or
    :class:`CheckpointMismatchError`."""
    if name not in MODELS:
        raise UnknownModelError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    spec = MODELS[name]
    tdir, sched_file = find_checkpoint(path)
    try:
        config = json.loads((tdir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelPathError(f"cannot read {tdir / 'config.json'}: {exc}") from None
    check_checkpoint(spec, config, tdir)
    sched = None
    if sched_file is not None:
        try:
            sched = {k: v for k, v in json.loads(sched_file.read_text()).items()
                     if not k.startswith("_")}
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelPathError(f"cannot read {sched_file}: {exc}") from None
    return CheckpointConfig(spec, tdir, config, sched)


def adapter_class(spec: ModelSpec) -> type[ModelAdapter]:
    import importlib

    module, cls = spec.adapter.split(":")
    return getattr(importlib.import_module(module), cls)


def load_adapter(name: str, path: str | Path, *, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> ModelAdapter:
    """Load the local checkpoint at ``path`` as model ``name`` (see :data:`MODELS`)."""
    import diffusers

    spec, tdir, _, sched = read_checkpoint(name, path)
    cls = getattr(diffusers, spec.model_class)
    try:
        model = cls.from_pretrained(tdir, torch_dtype=dtype, local_files_only=True,
                                    use_safetensors=True)
    except (OSError, ValueError, RuntimeError) as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        first = next((ln for ln in lines if "size mismatch" in ln), lines[0])
        if "size mismatch" in str(exc):
            raise CheckpointMismatchError(
                f"the weights in {tdir} do not match its config.json ({first})") from None
        raise ModelPathError(f"cannot load {spec.model_class} weights from {tdir}: {first}") from None
    model = model.to(device)
    kw = {"pixels_per_token": spec.pixels_per_token} if spec.pixels_per_token else {}
    return adapter_class(spec)(model, sched, name=name, **kw)


__all__ = ["MODELS", "CheckpointConfig", "ModelSpec", "adapter_class", "check_checkpoint",
           "find_checkpoint", "load_adapter", "read_checkpoint"]
