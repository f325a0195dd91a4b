"""Seeded synthetic template caches: stand-ins for what ``template_run`` captures, no model.

Real caches come from a template run (``dit.editing.template_run``); these stand-ins have
the properties the codecs exploit or suffer from: a decaying low-rank structure that is
smooth over the token grid and drifts slowly across steps and blocks, additive noise, a few
outlier channels in the keys (massive activations), a few high-norm tokens, and
heavy-tailed importance with exact zeros (tokens the masked queries never attend to).

They serve the codec's tests and the benches that need a cache but no model (``sakura bench
codec --synthetic``, ``sakura bench native``, ``sakura bench faults``). The module lives in
``dit`` because what it builds is a :class:`~sakura.dit.cache.TemplateCache` and it needs
nothing else; ``codec`` imports nothing of ``dit`` and takes the cache by duck typing.
"""

from __future__ import annotations

import math

import torch
from sakura.dit.cache import TemplateCache


def synthetic_cache(
    steps: int = 4,
    blocks: int = 4,
    grid: int = 16,
    channels: int = 64,
    heads: int = 4,
    mask_ratio: float = 0.12,
    rank: int = 24,
    decay: float = 0.85,
    noise: float = 0.02,
    seed: int = 0,
) -> TemplateCache:
    """A ``TemplateCache`` of the unmasked tokens of a ``grid x grid`` image."""
    gen = torch.Generator().manual_seed(seed)
    # a centred square mask of ~mask_ratio of the tokens
    side = max(1, round(math.sqrt(mask_ratio) * grid))
    lo = (grid - side) // 2
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    masked = (rows >= lo) & (rows < lo + side) & (cols >= lo) & (cols < lo + side)
    token_index = (~masked).flatten().nonzero().flatten()
    n = len(token_index)

    def smooth_fields(count: int) -> torch.Tensor:
        """``count`` random smooth functions on the grid, sampled at the cached tokens."""
        freqs = torch.randn(count, 4, 2, generator=gen) * 0.6
        phases = torch.rand(count, 4, generator=gen) * 2 * math.pi
        amps = torch.randn(count, 4, generator=gen)
        yy = rows.flatten()[token_index].float()
        xx = cols.flatten()[token_index].float()
        arg = freqs[..., 0, None] * yy + freqs[..., 1, None] * xx + phases[..., None]
        f = (amps[..., None] * torch.cos(arg)).sum(1)
        f = f + 0.3 * torch.randn(count, n, generator=gen)
        return f / f.norm(dim=1, keepdim=True)  # [count, n]

    spectrum = decay ** torch.arange(rank, dtype=torch.float32) * math.sqrt(n * channels)
    keys = torch.empty(steps, blocks, n, channels)
    values = torch.empty_like(keys)
    base = {kind: (smooth_fields(rank), torch.linalg.qr(torch.randn(channels, rank, generator=gen))[0])
            for kind in ("k", "v")}
    outlier_ch = torch.randperm(channels, generator=gen)[: max(1, channels // 32)]
    hot_tokens = torch.randperm(n, generator=gen)[: max(1, n // 50)]
    for s in range(steps):
        for b in range(blocks):
            for kind, out in (("k", keys), ("v", values)):
                u0, v0 = base[kind]
                u = u0 + 0.15 * smooth_fields(rank) + 0.02 * (s + b)
                v = v0 + 0.1 * torch.randn(channels, rank, generator=gen) / math.sqrt(channels)
                x = (u.T * spectrum) @ v.T / math.sqrt(n)
                x = x + noise * torch.randn(n, channels, generator=gen) * x.std()
                if kind == "k":
                    x[:, outlier_ch] *= 6.0
                x[hot_tokens] *= 3.0
                out[s, b] = x
    uni = torch.rand(steps, blocks, n, generator=gen)
    imp = (1.0 - uni).clamp_min(1e-6) ** (-1.0 / 1.2) - 1.0  # Pareto(alpha = 1.2) - 1
    imp = torch.where(torch.rand(steps, blocks, n, generator=gen) < 0.1, torch.zeros(()), imp)
    return TemplateCache(
        keys=keys,
        values=values,
        importance=imp.float(),
        token_index=token_index,
        timesteps=torch.linspace(1.0, 0.0, steps + 1)[:-1],
        num_heads=heads,
    )
