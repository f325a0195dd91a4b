"""Saving and loading model weights (safetensors with the config in the metadata).

The shipped default model lives at ``dit/weights/sakura-mmdit.safetensors``, with its card
``sakura-mmdit.card.json`` beside it: the measured prompt accuracy (``sakura bench model``)
of exactly those weights (the file's sha256), which :func:`model_card` joins to what the
weights say of themselves (architecture class, parameter count, train step) for reports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, safe_open, save_file
from sakura.dit.errors import WeightsError
from sakura.dit.model import MMDiT, MMDiTConfig

from sakura.digest import file_sha256

DEFAULT_WEIGHTS = Path(__file__).parent / "weights" / "sakura-mmdit.safetensors"



def save_model(model: MMDiT, path: str | Path, meta: dict[str, str] | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"config": json.dumps(model.cfg.to_dict()), **(meta or {})}
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def load_model(path: str | Path | None = None) -> MMDiT:
    """Load a trained model (default: the shipped weights) in eval mode, fp32."""
    path = Path(path) if path else DEFAULT_WEIGHTS
    if not path.exists():
        raise WeightsError(
            f"model weights not found at {path}; train them with `sakura train` "
            "(see dit/MODEL_CARD.md)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        cfg = MMDiTConfig.from_dict(json.loads(meta["config"]))
        model = MMDiT(cfg)
        model.load_state_dict(load_file(str(path)))
    except (KeyError, RuntimeError, ValueError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path} is not a SAKURA MMDiT checkpoint: {exc}") from exc
    model.weights_meta = meta
    return model.eval().requires_grad_(False).float()


def metadata(path: str | Path | None = None) -> dict[str, str]:
    with safe_open(str(Path(path) if path else DEFAULT_WEIGHTS), "pt") as f:
        return dict(f.metadata() or {})


def card_path(path: str | Path | None = None) -> Path:
    """The card beside a weights file: ``NAME.card.json`` for ``NAME.safetensors`` (or for
    the weights folder ``NAME`` of the second model, dit/flux2_pixel.py)."""
    p = Path(path) if path else DEFAULT_WEIGHTS
    return p.with_name(p.name.removesuffix(".safetensors") + ".card.json")


#: the weights file inside a diffusers transformer folder (the second model's)
FOLDER_WEIGHTS = "diffusion_pytorch_model.safetensors"


def _describe(p: Path) -> tuple[str, int, dict[str, str], Path]:
    """(class, parameters, metadata, the weights file) of a weights file or folder, without
    loading a tensor."""
    if p.is_dir():  # a diffusers transformer folder: the class from its config.json
        f = p / FOLDER_WEIGHTS
        try:
            cls = json.loads((p / "config.json").read_text())["_class_name"]
            with safe_open(str(f), "pt") as st:
                params = sum(int(torch.Size(st.get_slice(k).get_shape()).numel())
                             for k in st.keys())
                meta = dict(st.metadata() or {})
        except (OSError, KeyError, ValueError) as exc:
            raise WeightsError(f"{p} is not a diffusers transformer folder: {exc}") from exc
        return f"diffusers.{cls}", params, meta, f
    meta = metadata(p)
    try:
        cfg = MMDiTConfig.from_dict(json.loads(meta["config"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise WeightsError(f"{p} is not a SAKURA MMDiT checkpoint: {exc}") from exc
    with torch.device("meta"):
        params = sum(t.numel() for t in MMDiT(cfg).parameters())
    return f"{MMDiT.__module__}.{MMDiT.__qualname__}", int(params), meta, p


def model_card(path: str | Path | None = None) -> dict[str, Any]:
    """One model as reports name it: ``{name, class, params, train_step, prompt_accuracy,
    chance_level, weights_file_sha256, source}``. Class, parameter count and train step come
    from the weights file (its config, counted on the meta device: nothing is allocated);
    the prompt accuracy and chance level from its card, and only when the card names this
    file's sha256 (a card of other weights, or none: both None, ``source`` says why)."""
    p = Path(path) if path else DEFAULT_WEIGHTS
    if not p.exists():
        raise WeightsError(f"model weights not found at {p}")
    cls, params, meta, weights_file = _describe(p)
    sha = file_sha256(weights_file)
    step = meta.get("train_step")
    out: dict[str, Any] = {
        "name": p.name.removesuffix(".safetensors"), "class": cls,
        "params": int(params), "train_step": int(step) if step and step.isdigit() else step,
        "prompt_accuracy": None, "chance_level": None, "weights_file_sha256": sha,
        "source": None}
    cp = card_path(p)
    try:
        card = json.loads(cp.read_text())
    except FileNotFoundError:
        out["source"] = f"no card ({cp.name}): run `sakura bench model` on these weights"
        return out
    except ValueError as exc:
        raise WeightsError(f"{cp} is not JSON: {exc}") from exc
    if card.get("weights_file_sha256") != sha:
        out["source"] = f"{cp.name} is the card of other weights: its figures are not used"
        return out
    out.update({k: card.get(k) for k in ("prompt_accuracy", "chance_level")})
    out["source"] = card.get("source")
    return out


__all__ = ["DEFAULT_WEIGHTS", "FOLDER_WEIGHTS", "WeightsError", "card_path", "load_model", "metadata",
           "model_card", "save_model", "torch"]
