"""Output-PSNR profiling of pack configurations (``sakura build --profile-psnr``).

The pack writer asks ``quality_fn(shard, params, decoded)`` for the output PSNR of each
configuration of each shard (``codec.pack.write_pack``). :class:`OutputPSNR` answers it the
direct way: the template's profiling requests are edited with the exact (FP16) cache except
for that one shard, which gets the configuration's decoded K/V, and the images are compared
with the exact edits (PSNR over the whole image, capped at 200 dB as ``codec.metrics.psnr``).

Cost: one edit per (configuration, profiling request). On the shipped model a changed shard
of step ``s`` only changes steps ``s`` onwards, so the edit resumes from the exact run's
latent at ``s`` (half an edit on average); diffusers engines re-run whole edits. A template
with 40 shards and ~30 configurations per shard costs minutes per codec with one profiling
request: ``--profile-psnr N`` (every configuration, N requests) is opt-in, and the default
build measures a few sampled shards only and fits the rest per step
(``codec.profile.FittedPSNR``, ``--psnr-fit``).
"""

from __future__ import annotations

from typing import Any

import torch
from sakura.codec.metrics import psnr
from sakura.codec.shards import ShardLayout
from sakura.dit.adapters.engine import DefaultEngine
from sakura.dit.editing import cached_edit, full_edit


class _OneShardChanged:
    """The exact cache, except the blocks of one shard (``KVProvider``)."""

    def __init__(self, exact: Any, step: int, blocks: list[int], decoded: list[torch.Tensor]):
        self.exact, self.step = exact, step
        self.kv = {b: (decoded[2 * k], decoded[2 * k + 1]) for k, b in enumerate(blocks)}

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == self.step and block in self.kv:
            return self.kv[block]
        return self.exact.get(step, block)


class OutputPSNR:
    """``quality_fn`` for ``write_pack``: output PSNR against ``exact`` on ``requests``."""

    def __init__(self, engine: Any, prep: Any, run: Any, requests: list[Any],
                 layout: ShardLayout) -> None:
        if not requests:
            raise ValueError("output-PSNR profiling needs at least one profiling request")
        self.engine, self.prep, self.requests, self.layout = engine, prep, requests, layout
        self.exact_cache = run.cache.to_fp16_exact()
        self.resumable = isinstance(engine, DefaultEngine)
        self.exact: list[torch.Tensor] = []
        self.latents: list[dict[int, torch.Tensor]] = []
        for req in requests:
            xs: dict[int, torch.Tensor] = {}
            if self.resumable:
                image = cached_edit(engine.model, prep.template, prep.geometry,
                                    self.exact_cache, req,
                                    on_latent=lambda s, x, xs=xs: xs.__setitem__(s, x.clone()))
            else:
                image = engine.edit(prep, self.exact_cache, req)
            self.exact.append(image)
            self.latents.append(xs)
        # a local edit (every token, no cache) on the same requests: the quality the device
        # gets by computing the edit itself, its floor for streamed configurations
        self.local_psnr_db: float | None = None
        if self.resumable:
            local = [psnr((full_edit(engine.model, prep.template, req) + 1) / 2, (ref + 1) / 2)
                     for req, ref in zip(requests, self.exact, strict=True)]
            self.local_psnr_db = float(sum(local) / len(local))

    def _edit(self, i: int, provider: Any, step: int) -> torch.Tensor:
        req = self.requests[i]
        if self.resumable:
            return cached_edit(self.engine.model, self.prep.template, self.prep.geometry,
                               provider, req, start_step=step, x_start=self.latents[i][step])
        return self.engine.edit(self.prep, provider, req)

    def __call__(self, shard: int, params: dict[str, Any], decoded: list[torch.Tensor]) -> float:
        step, blocks = self.layout.blocks_of(shard)
        provider = _OneShardChanged(self.exact_cache, step, blocks,
                                    [t.float() for t in decoded])
        values = [psnr((self._edit(i, provider, step) + 1) / 2, (ref + 1) / 2)
                  for i, ref in enumerate(self.exact)]
        return float(sum(values) / len(values))
