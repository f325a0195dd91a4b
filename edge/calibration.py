"""Execution-time calibration: the masked computation's time per block, before any shard.

The first edit of a (template, request shape) runs two steps
of the masked computation with a zero cache (no network) and times every block of the
second step; a shard's predicted time is the sum over its blocks. The pipeline corrects
the prediction online with measured shard times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from sakura.codec.shards import ShardLayout
from sakura.dit.adapters.engine import EditEngine, Prepared
from sakura.dit.editing import EditRequest


@dataclass
class ExecProfile:
    """Masked execution time of each block of one (steady-state) denoising step, and
    (native runtime, local fallback on) one full-token step's measured time."""

    block_s: list[float]
    local_step_s: float | None = None  # a timed ``local`` edit / its steps (runner.py)

    @property
    def step_s(self) -> float:
        return float(sum(self.block_s))

    def shard_times(self, layout: ShardLayout) -> list[float]:
        out = []
        for shard in range(layout.num_shards):
            _step, blocks = layout.blocks_of(shard)
            out.append(float(sum(self.block_s[b] for b in blocks)))
        return out


class _StopCalibration(Exception):
    pass


class _TimingProvider:
    """Zero K/V of the right shape; records when each (step, block) asks."""

    def __init__(self, tokens: int, channels: int, stop_step: int) -> None:
        self.k = torch.zeros(tokens, channels)
        self.stop_step = stop_step
        self.times: dict[tuple[int, int], float] = {}

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.times[(step, block)] = time.perf_counter()
        if step >= self.stop_step:
            raise _StopCalibration
        return self.k, self.k


def calibrate(engine: EditEngine, prep: Prepared, req: Any) -> ExecProfile:
    """Time every block of the masked computation (second step, zero cache)."""
    geo = engine.cache_geometry(prep)
    blocks, steps = geo["blocks"], geo["steps"]
    measure = 1 if steps >= 2 else 0
    stop = measure + 1
    prov = _TimingProvider(geo["tokens"], geo["channels"], stop)
    end: dict[str, float] = {}

    def on_step(s: int) -> None:
        end[str(s)] = time.perf_counter()

    try:
        engine.edit(prep, prov, _probe(req), on_step=on_step)
    except _StopCalibration:
        pass
    t = prov.times
    out = []
    for b in range(blocks):
        nxt = t.get((measure, b + 1)) if b + 1 < blocks else t.get((stop, 0),
                                                                   end.get(str(measure)))
        out.append(max(0.0, (nxt or t[(measure, b)]) - t[(measure, b)]))
    return ExecProfile(out)


def _probe(req: Any) -> Any:
    """A request of the same shape with zero content (the default model's); others as is."""
    if not isinstance(req, EditRequest):
        return req
    return EditRequest(torch.zeros_like(req.txt),
                       None if req.txt_uncond is None else torch.zeros_like(req.txt_uncond),
                       seed=0, ref_images=None if req.ref_images is None
                       else torch.zeros_like(req.ref_images))
