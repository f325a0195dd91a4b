"""What the adapter algorithms take and give, in the model's latent token space: a
:class:`LatentTemplate` (template latents, token mask, prompt, seed, steps, guidance), a
private :class:`LatentRequest`, their :class:`Conditioning` (encoded prompts; text encoders
run outside the adapter) and :class:`LatentImage` references; the template's
:class:`AdapterGeometry` on a model and the template run's :class:`AdapterRun`.
``token_mask`` turns a pixel mask into the token mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from sakura.dit.cache import TemplateCache


@dataclass
class LatentImage:
    """An image in the model's latent token space: ``tokens [h*w, C]`` row-major, ``grid (h, w)``."""

    tokens: torch.Tensor
    grid: tuple[int, int]


@dataclass
class Conditioning:
    """An encoded prompt (text encoders run outside the adapter).

    ``embeds [1, T, D]`` token embeddings; ``pooled [1, P]`` the pooled vector (SD3.5 only);
    for QwenImage 2.1 ``image_slots [T]`` marks the vision-language encoder's image slots
    (each stands for 2x2 latent tokens of the condition image in ``images``, in order).
    """

    embeds: torch.Tensor
    pooled: torch.Tensor | None = None
    image_slots: torch.Tensor | None = None
    images: list[LatentImage] = field(default_factory=list)


@dataclass
class LatentTemplate:
    """An edit template in latent space: template latents ``[N, C]`` on ``grid``, the token
    mask ``[N]`` (True = editable), the template prompt, seed, steps, true-CFG scale
    (``guidance``; 1 = off) and the embedded guidance of guidance-distilled models."""

    latents: torch.Tensor
    grid: tuple[int, int]
    mask: torch.Tensor
    cond: Conditioning
    seed: int
    steps: int = 20
    guidance: float = 1.0
    embedded_guidance: float | None = None

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]


@dataclass
class LatentRequest:
    """A private edit: prompt (and negative prompt for CFG), seed and, for FLUX.2, reference
    images (Flux2-klein KV semantics). Never leaves the device."""

    cond: Conditioning
    uncond: Conditioning | None
    seed: int
    references: list[LatentImage] = field(default_factory=list)


@dataclass
class AdapterGeometry:
    """Token and cache geometry of a template on a model."""

    grid: tuple[int, int]
    masked: torch.Tensor
    unmasked: torch.Tensor
    heads: int
    head_dim: int
    blocks: list[str]

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def channels(self) -> int:
        return self.heads * self.head_dim

    def fp16_bytes(self, steps: int) -> int:
        """Bytes of the FP16 template cache (K and V of the unmasked tokens, every step/block)."""
        return 2 * steps * len(self.blocks) * len(self.unmasked) * self.channels * 2


@dataclass
class AdapterRun:
    """The template run's outputs: the cache, plus block-input hidden states of the image
    tokens (``hidden[step][layer] -> [N, D]``) for the slow pinned reference."""

    cache: TemplateCache
    geometry: AdapterGeometry
    hidden: list[dict[int, torch.Tensor]] = field(default_factory=list)


def token_mask(mask: torch.Tensor, pixels_per_token: int) -> torch.Tensor:
    """Pixel mask ``[H, W]`` -> token mask ``[N]``: a token is editable if any pixel is."""
    m = F.max_pool2d(mask.float()[None, None], pixels_per_token)[0, 0] > 0
    return m.flatten()
