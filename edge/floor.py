"""``exact`` and the compute floor: the edit with the whole FP16 cache resident.

Regime-matched replay (``DESIGN.md``, "Measuring"): the masked execution time ``T`` is
measured with the whole FP16 cache resident (:func:`resident_floor`, ``compute_bound_s``,
the floor no streaming system can beat, which also yields ``exact``); the trace's rates are
scaled by one factor (:func:`regime_factor`) so that the FP16 cache at the trace's median
rate takes ``regime_x`` (10) times ``T``. Shared by ``sakura bench edit`` and ``sakura
replay``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import torch
from sakura.codec.pack import Manifest, decode_config
from sakura.dit.cache import ShardSkipped
from sakura.dit.editing import EditRequest, Template
from sakura.edge.client import PackClient
from sakura.edge.runtime import EdgeRuntime


async def _fetch_all(server: str, template_id: str, codec: str) -> tuple[dict, list[bytes]]:
    """A codec's manifest and the body of each shard's first configuration."""
    async with PackClient(server) as client:
        manifest = await client.manifest(template_id, codec)
        bodies = []
        for s in manifest["shards"]:
            got = await client.fetch_config(template_id, codec, int(s["index"]),
                                            int(s["configs"][0]["id"]), manifest=manifest)
            bodies.append(got.data)
        return manifest, bodies


class ResidentCache:
    """The whole decoded cache in memory (``get`` never waits). A shard given as None was
    not fetched (the stale plan, ``edge.stale_plan``): its blocks raise
    :class:`~dit.cache.ShardSkipped`, as the streaming provider's do, so the edit runs them
    on their group's last K/V or computes the step."""

    def __init__(self, manifest: Manifest, shards: list[list[torch.Tensor] | None]) -> None:
        self.layout = manifest.layout()
        self.shards = shards

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.layout.shard_of(step, block)
        tensors = self.shards[shard]
        if tensors is None:
            raise ShardSkipped(step, block)
        _s, blocks = self.layout.blocks_of(shard)
        j = blocks.index(block)
        return tensors[2 * j], tensors[2 * j + 1]


@dataclass
class Floor:
    """``exact`` and the compute floor: the edit with the whole FP16 cache resident."""

    image: torch.Tensor
    seconds: float        # wall time of the edit (min of runs): ``compute_bound_s``
    shard_exec_s: float   # the shards' summed execution time in that run
    manifest: dict[str, Any]


def resident_floor(runtime: EdgeRuntime, server: str, template_id: str, template: Template,
                   req: EditRequest, repeats: int = 1) -> Floor:
    """``exact`` (the FP16 cache fully resident) and its masked execution time (min of
    runs), on the runtime's own execution engine (the native graphs or the torch model)."""
    manifest_d, bodies = asyncio.run(_fetch_all(server, template_id, "fp16"))
    manifest = Manifest.from_dict(manifest_d)
    codec = manifest.make_codec()
    shards = [decode_config(manifest, i, int(manifest_d["shards"][i]["configs"][0]["id"]), b,
                            codec) for i, b in enumerate(bodies)]
    prep = runtime.prepared(template_id, template)
    best = best_exec = float("inf")
    image = None
    if runtime.runtime == "native":
        bps, cache = native_resident(runtime, template, prep.geometry, req, manifest_d, shards)
    else:
        provider = ResidentCache(manifest, shards)
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        if runtime.runtime == "native":
            image, records = runtime.native.resident_edit(template, prep.geometry, req, bps,
                                                          cache)
            dt = time.perf_counter() - t0
            exec_s = sum(r["exec_end"] - r["exec_start"] for r in records)
        else:
            image = runtime.engine.edit(prep, provider, req)
            dt = exec_s = time.perf_counter() - t0
        if dt < best:
            best, best_exec = dt, exec_s
    assert image is not None
    return Floor(image, best, best_exec, manifest_d)


def native_resident(runtime: EdgeRuntime, template: Template, geometry: Any,
                    req: EditRequest, manifest_d: dict[str, Any],
                    shards: list[list[torch.Tensor]]) -> tuple[int, list[Any]]:
    """The native runtime prepared for an edit with every shard decoded in memory, and that
    cache in its form: ``(blocks_per_shard, cache)`` for ``runtime.native.resident_edit``,
    which runs the runtime's own graphs as a streamed edit does. ``exact`` is that edit of
    the FP16 cache, and so are the profile regime's configured edits
    (``edge.replay.runs``) whenever every shard was fetched: FP16's image is then ``exact``
    to the bit, where the torch model differs from the graphs by float rounding (147 dB on
    the replay tests' model, 2026-12-07)."""
    bps = int(manifest_d["geometry"]["blocks_per_shard"])
    runtime.native.prepare(template, geometry, req, bps)
    return bps, [torch.stack(t).to(torch.float32).numpy() for t in shards]


def exact_and_floor(runtime: EdgeRuntime, server: str, template_id: str, template: Template,
                    req: EditRequest, repeats: int = 1) -> tuple[torch.Tensor, float, dict]:
    """``(exact, compute floor s, fp16 manifest)``: :func:`resident_floor` as a tuple."""
    floor = resident_floor(runtime, server, template_id, template, req, repeats)
    return floor.image, floor.seconds, floor.manifest


def regime_factor(fp16_bytes: int, masked_exec_s: float, median_bps: float,
                  regime_x: float = 10.0) -> float:
    """The one trace scale factor of regime-matched replay: the FP16 cache at the scaled
    median rate takes ``regime_x`` times the masked execution time."""
    return fp16_bytes * 8.0 / (regime_x * masked_exec_s) / median_bps
