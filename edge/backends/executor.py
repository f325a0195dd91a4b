"""A masked edit executed through shard graphs on one backend.

:class:`ShardExecutor` mirrors ``dit.editing.cached_edit`` for the plain case (text +
masked image tokens, template cache; no references, no text-KV reuse): per step the host
embeds the fresh tokens (``MMDiT.embed``: three small linear layers) and computes the
modulation vector, every shard graph runs its blocks with the shard's K/V from the
provider, and the host applies the final layer, guidance and the Euler update (the loop
is ``dit.sampler.denoise``). Compiled shards are kept per (geometry, block group) and
reused for every step and edit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from sakura.dit.cache import KVProvider
from sakura.dit.editing import (
    EditRequest,
    Geometry,
    Template,
    _cfg_batch,
    _guided,
    compose,
    edit_schedule,
    edit_start,
)
from sakura.dit.model import MMDiT
from sakura.dit.sampler import EulerSteps, denoise
from sakura.edge.backends import create_backend
from sakura.edge.backends.base import BackendConfig, CompiledShard, ExecutionBackend, weights_sha256
from sakura.edge.backends.errors import BackendError
from sakura.edge.backends.shard import ShardGeometry


def step_groups(blocks: int, blocks_per_shard: int) -> list[tuple[int, ...]]:
    """The block groups of one step (``codec.shards.ShardLayout`` order)."""
    if not 1 <= blocks_per_shard <= blocks:
        raise BackendError(f"blocks_per_shard must be in 1..{blocks}, got {blocks_per_shard}")
    return [tuple(range(i, min(i + blocks_per_shard, blocks)))
            for i in range(0, blocks, blocks_per_shard)]


def edit_geometry(model: MMDiT, template: Template, geo: Geometry, req: EditRequest
                  ) -> ShardGeometry:
    """The shard-graph shapes of an edit of ``template``."""
    if req.ref_images is not None and len(req.ref_images) > 0:
        raise BackendError("reference images need the torch backend (shard graphs take "
                           "text and masked image tokens only)")
    batch = 2 if req.txt_uncond is not None and template.guidance != 1.0 else 1
    return ShardGeometry(batch=batch, txt=int(req.txt.shape[1]), img=len(geo.masked),
                         cached=len(geo.unmasked))


class ShardExecutor:
    """Runs masked edits of ``model`` on ``backend``, one compiled graph per block group."""

    def __init__(self, model: MMDiT, backend: ExecutionBackend,
                 weights: str | None = None) -> None:
        self.model = model
        self.backend = backend
        self._weights = weights
        self._shards: dict[tuple[ShardGeometry, tuple[int, ...]], CompiledShard] = {}

    @property
    def weights(self) -> str:
        if self._weights is None:
            self._weights = weights_sha256(self.model)
        return self._weights

    def shard(self, geometry: ShardGeometry, blocks: tuple[int, ...]) -> CompiledShard:
        key = (geometry, tuple(blocks))
        if key not in self._shards:
            self._shards[key] = self.backend.prepare(self.model, tuple(blocks), geometry,
                                                     self.weights)
        return self._shards[key]

    def use(self, geometry: ShardGeometry, blocks: tuple[int, ...],
            shard: CompiledShard) -> None:
        """Run ``blocks`` of ``geometry`` with an already prepared (or wrapped) shard."""
        self._shards[(geometry, tuple(blocks))] = shard

    @property
    def compiled(self) -> dict[tuple[ShardGeometry, tuple[int, ...]], CompiledShard]:
        return dict(self._shards)

    def prepare(self, geometry: ShardGeometry, groups: Sequence[tuple[int, ...]]) -> None:
        """Compile or load every group's graph before the edit starts."""
        for blocks in groups:
            self.shard(geometry, blocks)

    def edit(self, template: Template, geo: Geometry, provider: KVProvider, req: EditRequest,
             groups: Sequence[tuple[int, ...]],
             on_step: Callable[[int], None] | None = None) -> torch.Tensor:
        """The edited image ``[3, H, W]`` (``cached_edit`` semantics, see module docstring)."""
        model = self.model
        covered = [b for g in groups for b in g]
        if covered != list(range(model.cfg.num_blocks)):
            raise BackendError(f"block groups {list(groups)} do not cover the model's "
                               f"{model.cfg.num_blocks} blocks in order")
        geometry = edit_geometry(model, template, geo, req)
        self.prepare(geometry, groups)
        with torch.inference_mode():
            x = edit_start(model, template, req.seed)[:, geo.masked]
            pos = geo.pos[geo.masked]
            angles = torch.cat([model.angles(model.text_positions(geometry.txt)),
                                model.angles(pos)])
            cos, sin = angles.cos(), angles.sin()

            def model_step(s: int, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
                seg = model.embed(_cfg_batch(x, pos, req, t, template.guidance))
                txt, img = seg.txt, seg.img
                for blocks in groups:
                    kv: list[torch.Tensor] = []
                    for b in blocks:
                        kv.extend(provider.get(s, b))
                    txt, img = self.shard(geometry, blocks).run(
                        txt, img, seg.vec_txt, seg.vec_img, cos, sin, *kv)
                seg.txt, seg.img = txt, img
                return model.head(seg)

            x = denoise(x, EulerSteps(edit_schedule(template)), model_step,
                        guide=lambda v: _guided(v, template.guidance), after_step=on_step)
            return compose(model, template, geo, x)


class DeviceBackend:
    """The backend an :class:`edge.runtime.EdgeRuntime` executes with.

    ``torch`` (default) leaves execution to the model's own cached edit (every feature:
    references, text-KV reuse, diffusers engines). Any other backend runs the shipped
    MMDiT's edits through compiled shard graphs (:class:`ShardExecutor`), created lazily
    and kept for the runtime's lifetime.
    """

    def __init__(self, name: str = "torch", config: BackendConfig | None = None) -> None:
        self.name = name
        self._backend = None if name == "torch" else create_backend(name, config)
        self._executor: ShardExecutor | None = None

    @property
    def is_torch(self) -> bool:
        return self._backend is None

    @property
    def backend(self) -> ExecutionBackend | None:
        return self._backend

    def executor(self, model: MMDiT | None) -> ShardExecutor:
        if self._backend is None:
            raise BackendError("the torch backend runs the model directly")
        if not isinstance(model, MMDiT):
            raise BackendError(f"--backend {self.name} runs the shipped SAKURA MMDiT only "
                               "(diffusers models run on the torch backend)")
        if self._executor is None or self._executor.model is not model:
            self._executor = ShardExecutor(model, self._backend)
        return self._executor

    def prepare(self, model: MMDiT | None, template: Template, geo: Geometry,
                req: EditRequest, blocks_per_shard: int) -> None:
        """Compile or load the shard graphs of this edit (before its transfer starts)."""
        ex = self.executor(model)
        ex.prepare(edit_geometry(ex.model, template, geo, req),
                   step_groups(ex.model.cfg.num_blocks, blocks_per_shard))

    def edit(self, model: MMDiT | None, template: Template, geo: Geometry,
             provider: KVProvider, req: EditRequest, blocks_per_shard: int) -> torch.Tensor:
        ex = self.executor(model)
        return ex.edit(template, geo, provider, req,
                       step_groups(ex.model.cfg.num_blocks, blocks_per_shard))
