"""What the render engine needs of its model: geometry, schedule, costs and output.

``MMDiTView`` reads the shipped default MMDiT's config from its weights file's metadata (no
weights loaded); ``AdapterView`` holds a weightless (``meta``) copy of a diffusers
checkpoint's transformer (any ``dit.adapters`` model). Either turns a request into the
start of a ``dit.regional.RegionalState`` (token coordinates, timesteps, initial noise,
text length, a MAC cost function) plus the spec a worker builds its backend from, and the
final latents into the result. The workers (``cloud.render_worker``) load the weights.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from sakura.cloud.render_api import EngineConfig, RenderError, RenderRequest
from sakura.dit.adapters.base import EDIT_SEED_OFFSET
from sakura.dit.adapters.regional import adapter_macs, meta_adapter
from sakura.dit.model import MMDiTConfig, unpatchify
from sakura.dit.regional_mmdit import grid_coords, mmdit_macs
from sakura.dit.sampler import noise_like, schedule
from sakura.dit.weights import DEFAULT_WEIGHTS, WeightsError, metadata


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as a contiguous CPU array (tensors cross the worker pipes as numpy)."""
    return t.detach().cpu().contiguous().numpy()


def model_config(weights: str | None) -> MMDiTConfig:
    """The model's config from the weights file's metadata (no weights loaded)."""
    path = weights or str(DEFAULT_WEIGHTS)
    try:
        return MMDiTConfig.from_dict(json.loads(metadata(path)["config"]))
    except FileNotFoundError as exc:
        raise WeightsError(f"model weights not found at {path}") from exc
    except (KeyError, ValueError, OSError) as exc:
        raise WeightsError(f"{path} is not a SAKURA MMDiT checkpoint: {exc}") from exc


class MMDiTView:
    """What the engine needs of the default model: geometry, schedule, costs, output."""

    kind = "mmdit"

    def __init__(self, cfg: EngineConfig):
        self.cfg = model_config(cfg.weights)
        self.unit = self.cfg.patch_size
        self.num_blocks = self.cfg.num_blocks

    def check(self, req: RenderRequest) -> None:
        mc = self.cfg
        if req.txt is None:
            return
        if req.txt.ndim != 3 or req.txt.shape[0] != 1 or req.txt.shape[-1] != mc.text_dim:
            raise RenderError(f"txt must be [1, T, {mc.text_dim}]")

    def start(self, req: RenderRequest):
        mc = self.cfg
        grid = req.size // mc.patch_size
        branches = 2 if req.txt_uncond is not None and req.guidance != 1.0 else 1
        x = noise_like((1, grid * grid, mc.patch_dim), req.seed)[0]
        spec = {"kind": "mmdit", "txt": as_numpy(req.txt),
                "txt_uncond": None if branches == 1 else as_numpy(req.txt_uncond),
                "size": req.size, "guidance": req.guidance}
        return (grid_coords(grid), schedule(req.steps), x, int(req.txt.shape[1]),
                lambda q, k: branches * mmdit_macs(mc, q, k), spec)

    def output(self, x: torch.Tensor, req: RenderRequest):
        mc = self.cfg
        return unpatchify(x[None], mc.patch_size, mc.in_channels, req.size)[0].clamp(-1, 1), None


class AdapterView:
    """The same for a diffusers checkpoint, over a weightless copy of its transformer."""

    kind = "adapter"

    def __init__(self, cfg: EngineConfig):
        if not cfg.model_path:
            raise RenderError(f"model {cfg.model} needs model_path (a checkpoint folder)")
        self.adapter = meta_adapter(cfg.model, cfg.model_path)
        self.unit = self.adapter.pixels_per_token
        self.num_blocks = self.adapter.num_blocks

    def check(self, req: RenderRequest) -> None:
        if req.cond is None:
            raise RenderError(f"{self.adapter.name} requests carry their encoded conditioning "
                              "(cond, and uncond for guidance)")
        if req.guidance != 1.0 and req.uncond is None:
            raise RenderError(f"guidance {req.guidance} needs uncond")

    def start(self, req: RenderRequest):
        a = self.adapter
        g = req.size // self.unit
        n = g * g
        rows = torch.arange(n)
        branches = 2 if req.guidance != 1.0 else 1
        x = noise_like((1, n, a.latent_channels), req.seed + EDIT_SEED_OFFSET)[0]
        ts = a.make_scheduler(req.steps, n).sigmas.float()
        params = float(sum(p.numel() for m in a.layers() for p in m.parameters()))

        def cond(c):
            return None if c is None else (as_numpy(c.embeds),
                                           None if c.pooled is None else as_numpy(c.pooled))

        spec = {"kind": "adapter", "cond": cond(req.cond),
                "uncond": cond(req.uncond) if branches == 2 else None,
                "guidance": req.guidance, "grid": (g, g)}
        coords = torch.stack([rows // g, rows % g], dim=-1)
        return (coords, ts, x, int(req.cond.embeds.shape[1]),
                lambda q, k: adapter_macs(a, q, k, branches, params), spec)

    def output(self, x: torch.Tensor, req: RenderRequest):
        return None, x.clone()


def model_view(cfg: EngineConfig) -> MMDiTView | AdapterView:
    """The view of ``cfg``'s model: a ``dit.adapters`` checkpoint when ``cfg.model`` is
    set, else the default MMDiT."""
    return AdapterView(cfg) if cfg.model else MMDiTView(cfg)
