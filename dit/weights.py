"""Saving and loading model weights (safetensors with the config in the metadata).

The shipped default model lives at ``dit/weights/sakura-mmdit.safetensors``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file
from sakura.dit.errors import WeightsError
from sakura.dit.model import MMDiT, MMDiTConfig

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


__all__ = ["DEFAULT_WEIGHTS", "WeightsError", "load_model", "save_model", "metadata", "torch"]
