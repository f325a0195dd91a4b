"""The second model: a FLUX.2-architecture transformer trained here, in pixel space.

Issue 33 asks for a second trained model of another architecture class, on the
real-architecture path (``dit/adapters/``). No FLUX.2 checkpoint or VAE can be downloaded
here, so this is diffusers' own ``Flux2Transformer2DModel`` at a config of the same order as
the shipped MMDiT, trained from scratch on the same captioned emoji with the same recipe
(``sakura train --arch flux2``, :mod:`dit.train`).

* **Tokens.** The 4x4 pixel patches of ``dit.model.patchify`` (48 channels) are the
  transformer's "latent" tokens (its ``patch_size`` is 1, as FLUX.2's on packed latents):
  the emoji are 32-64 px, where a VAE's 8x downsampling would leave 4-8 tokens a side.
* **Text.** The MiniLM token embeddings the MMDiT uses (16 x 384,
  ``dit.text.TextEncoder``) are its ``encoder_hidden_states``.
* **Positions.** FLUX's own integer ids (``dit.adapters.flux2.image_ids`` / ``text_ids``:
  image ``(0, row, col, 0)``, text ``(0, 0, 0, l)``), so the adapter runs it unchanged.
  The MMDiT normalizes positions to one frame across resolutions; FLUX does not, and
  neither does this model (it trains at 8, 12 and 16 tokens a side).
* **Config** (:data:`FLUX2_CONFIG`): 2 double-stream and 6 single-stream blocks, 6 heads
  of 32 (hidden 192), MLP ratio 3, no guidance embedding, RoPE axes 8/8/8/8 at theta 100:
  the MMDiT's layout. 5,597,824 parameters against the MMDiT's 4,495,984 (FLUX.2's MLPs are
  SwiGLU with separate modulation per stream).
* **Not trained on references** (``ref_prob`` 0): no catalog template uses reference
  images. The architecture keeps FLUX.2-klein's KV reference semantics untrained.

Weights: a diffusers transformer folder (``config.json``,
``diffusion_pytorch_model.safetensors`` with ``train_step`` in its metadata) plus
``sakura.json`` (pixel patch, channels, text encoder), at :data:`DEFAULT_DIR`.

Where it runs: ``--model sakura-flux2`` loads the folder through the adapter registry's
checks and converts it exactly into the MMDiT's form (``dit.flux2_native``), so build, edit
and replay run it as they run the shipped model, on either runtime; ``PixelFlux2`` is its
training and sampling form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import Flux2Transformer2DModel
from safetensors.torch import save
from sakura.dit.adapters.flux2 import image_ids, text_ids
from sakura.dit.adapters.registry import SAKURA_FLUX2, SAKURA_FLUX2_DIR
from sakura.dit.errors import WeightsError
from sakura.dit.model import TokenBatch, grid_positions
from sakura.dit.weights import FOLDER_WEIGHTS, metadata
from torch import nn

from sakura.atomic import write_atomic

FLUX2_CONFIG: dict[str, Any] = SAKURA_FLUX2  # ``--model sakura-flux2`` checks it
PIXEL_PATCH = 4
CHANNELS = 3
DEFAULT_DIR = SAKURA_FLUX2_DIR
WEIGHTS_FILE = FOLDER_WEIGHTS
SIDECAR = "sakura.json"


@dataclass(frozen=True)
class PixelGeometry:
    """What ``dit.sampler.generate`` and the model bench read of a model's token space
    (the fields of ``MMDiTConfig`` they use): 4x4 patches of RGB, positions unused."""

    patch_size: int = PIXEL_PATCH
    in_channels: int = CHANNELS
    pos_span: float = 16.0

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size**2


class PixelFlux2(nn.Module):
    """``Flux2Transformer2DModel`` on 4x4 pixel-patch tokens: ``forward(TokenBatch)`` ->
    velocity ``[B, N, 48]``, as ``dit.model.MMDiT`` (square token grids, no references, no
    attention hook: SAKURA's hooks reach this model through ``dit.adapters.flux2``)."""

    cfg = PixelGeometry()

    def __init__(self, transformer: Flux2Transformer2DModel | None = None) -> None:
        super().__init__()
        self.transformer = transformer or Flux2Transformer2DModel(**FLUX2_CONFIG)

    def image_positions(self, grid: int) -> torch.Tensor:
        """``TokenBatch.img_pos`` as ``dit.sampler`` asks the MMDiT for it; unused here (the
        transformer builds FLUX's integer ids itself, ``image_ids``)."""
        return grid_positions(grid, self.cfg.pos_span)

    def forward(self, batch: TokenBatch, hook=None) -> torch.Tensor:
        if hook is not None:
            raise ValueError("the pixel FLUX.2 model takes SAKURA's hooks through "
                             "dit.adapters.flux2, not in its forward")
        if batch.ref is not None and batch.ref.shape[1] > 0:
            raise ValueError("the pixel FLUX.2 model is not trained on reference images")
        n = batch.img.shape[1]
        side = int(round(n ** 0.5))
        if side * side != n:
            raise ValueError(f"{n} image tokens are not a square grid")
        dt = batch.img.dtype
        return self.transformer(hidden_states=batch.img, encoder_hidden_states=batch.txt.to(dt),
                                timestep=batch.t.to(dt), img_ids=image_ids((side, side)),
                                txt_ids=text_ids(batch.txt.shape[1]), return_dict=False)[0]


def save_flux2(model: PixelFlux2, folder: str | Path, meta: dict[str, str] | None = None) -> None:
    """The weights folder, each file replaced whole (``sakura.atomic.write_atomic``; the
    safetensors bytes are built in memory: 22 MB)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.transformer.state_dict().items()}
    write_atomic(folder / WEIGHTS_FILE, save(state, metadata={"format": "pt", **(meta or {})}))
    config = dict(model.transformer.config)
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()
              if not k.startswith("_")}
    config["_class_name"] = type(model.transformer).__name__
    for name, doc in (("config.json", config),
                      (SIDECAR, {"pixel_patch": PIXEL_PATCH, "channels": CHANNELS,
                                 "text_encoder": "all-MiniLM-L6-v2", "text_tokens": 16,
                                 "positions": "flux2 integer ids"})):
        write_atomic(folder / name, json.dumps(doc, indent=2, sort_keys=True) + "\n")


def load_flux2(folder: str | Path | None = None) -> PixelFlux2:
    folder = Path(folder) if folder is not None else DEFAULT_DIR
    if not (folder / WEIGHTS_FILE).is_file():
        raise WeightsError(f"no pixel FLUX.2 weights in {folder} (train them: sakura train "
                           f"--arch flux2)")
    try:
        # low_cpu_mem_usage=False: a 22 MB model needs no accelerate, and diffusers would
        # otherwise print a paragraph recommending it on every load (every sakura edit)
        net = Flux2Transformer2DModel.from_pretrained(folder, local_files_only=True,
                                                      low_cpu_mem_usage=False)
    except (OSError, ValueError, RuntimeError) as exc:
        raise WeightsError(f"cannot load the pixel FLUX.2 weights in {folder}: {exc}") from None
    model = PixelFlux2(net.eval())
    model.weights_meta = flux2_metadata(folder)
    return model


def flux2_metadata(folder: str | Path | None = None) -> dict[str, str]:
    return metadata(Path(folder if folder is not None else DEFAULT_DIR) / WEIGHTS_FILE)


__all__ = ["CHANNELS", "DEFAULT_DIR", "FLUX2_CONFIG", "PIXEL_PATCH", "PixelFlux2",
           "PixelGeometry", "flux2_metadata", "load_flux2", "save_flux2"]
