"""Template-cache geometry of real checkpoints, computed from their ``config.json`` values.

The FP16 template cache is K and V of every cached image token, for every step and every
attention call ("block"), heads x head_dim channels each::

    bytes = 2 (K, V) x steps x blocks x cached tokens x heads x head_dim x 2 (FP16)

with ``cached tokens = (1 - mask ratio) x tokens`` and ``tokens = (resolution /
pixels_per_token)^2``. Blocks: FLUX.2 double + single blocks; SD3.5 layers plus one more per
dual-attention layer; QwenImage layers. The architecture values are those of the released
checkpoints (:mod:`dit.adapters.registry`); a local checkpoint's own ``config.json`` gives the
same numbers through :func:`cache_geometry`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

GIB = 1024 ** 3


@dataclass(frozen=True)
class CacheGeometry:
    """Cache geometry of one model at one resolution and step count."""

    model: str
    resolution: int
    tokens: int
    blocks: int
    heads: int
    head_dim: int
    steps: int

    @property
    def channels(self) -> int:
        return self.heads * self.head_dim

    def bytes_per_step(self, mask_ratio: float = 0.0) -> int:
        cached = round(self.tokens * (1.0 - mask_ratio))
        return 2 * self.blocks * cached * self.channels * 2

    def fp16_bytes(self, mask_ratio: float = 0.0, steps: int | None = None) -> int:
        return (self.steps if steps is None else steps) * self.bytes_per_step(mask_ratio)

    def to_dict(self, mask_ratios: tuple[float, ...] = (0.0, 0.1, 0.3)) -> dict[str, Any]:
        out = asdict(self)
        out["channels"] = self.channels
        out["bytes_per_step_full_grid"] = self.bytes_per_step()
        for m in mask_ratios:
            key = f"mask{int(round(m * 100))}"
            out[f"fp16_bytes_{key}"] = self.fp16_bytes(m)
            out[f"fp16_gib_{key}"] = self.fp16_bytes(m) / GIB
        return out


def pixels_per_token(class_name: str, config: dict[str, Any]) -> int:
    """Image pixels per latent token side: VAE factor x patch size of the model family."""
    patch = int(config.get("patch_size", 1))
    if class_name == "Flux2Transformer2DModel":
        return 16 * patch  # VAE /8, then 2x2 latents packed into the 128 input channels
    if class_name == "QwenImage21Transformer2DModel":
        return 16 * patch  # VAE /16 (the 2.1 pipeline's vae_scale_factor)
    return 8 * patch  # SD3 and QwenImage: VAE /8, then the transformer's own patch size


def attention_blocks(class_name: str, config: dict[str, Any]) -> int:
    if class_name == "Flux2Transformer2DModel":
        return int(config["num_layers"]) + int(config["num_single_layers"])
    if class_name == "SD3Transformer2DModel":
        return int(config["num_layers"]) + len(config.get("dual_attention_layers") or ())
    return int(config["num_layers"])


def cache_geometry(name: str, class_name: str, config: dict[str, Any], resolution: int,
                   steps: int) -> CacheGeometry:
    ppt = pixels_per_token(class_name, config)
    side = resolution // ppt
    return CacheGeometry(name, resolution, side * side, attention_blocks(class_name, config),
                         int(config["num_attention_heads"]), int(config["attention_head_dim"]),
                         steps)


def released(resolution: int = 512) -> dict[str, CacheGeometry]:
    """Geometry of every released checkpoint named in the registry, at its default steps."""
    from sakura.dit.adapters.registry import MODELS  # lazy: torch

    return {s.name: cache_geometry(s.name, s.model_class, s.config, resolution, s.default_steps)
            for s in MODELS.values() if s.config and not s.name.endswith("-kv")}


PAPER_FLUX2_4B_GIB = 1.46  # SAKURA paper: FP16 cache of a 512x512 template on FLUX.2 4B


def paper_comparison(klein: CacheGeometry) -> dict[str, Any]:
    """How our FLUX.2-klein-4B figure relates to the paper's 1.46 GiB (512x512, FP16)."""
    per_step = klein.bytes_per_step() / GIB
    return {
        "paper_fp16_gib": PAPER_FLUX2_4B_GIB,
        "ours_full_grid_gib_per_step": per_step,
        "ours_full_grid_gib_default_steps": klein.fp16_bytes() / GIB,
        "default_steps": klein.steps,
        "steps_equivalent_to_paper": PAPER_FLUX2_4B_GIB / per_step,
        "explanation": (
            f"One step of K+V of all {klein.tokens} image tokens over {klein.blocks} blocks x "
            f"{klein.channels} channels is {per_step:.3f} GiB in FP16, so the paper's "
            f"{PAPER_FLUX2_4B_GIB} GiB is {PAPER_FLUX2_4B_GIB / per_step:.2f} such steps: it "
            f"matches the full token grid (nothing masked out) over {round(PAPER_FLUX2_4B_GIB / per_step)} "
            "steps (or, equivalently, 25% more tokens over 4 steps, e.g. with 256 text or "
            "reference tokens cached too; the figure alone does not say which). At klein's "
            f"default {klein.steps} distilled steps we compute {klein.fp16_bytes() / GIB:.3f} GiB "
            "for the full grid; SAKURA "
            "caches only the unmasked tokens, so a template with mask ratio m needs (1 - m) of "
            "that, and a non-distilled schedule (e.g. 28-50 steps) multiplies it."),
    }
