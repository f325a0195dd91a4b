"""The native device runtime: an edit's shard loop in C++ (``sakura_native``), no Python in it.

The Python runtime (``sakura.edge.pipeline``) runs receive, hashing, link bookkeeping and
the DiT in one interpreter: execution shares the GIL and the cores with the network path,
and a streamed edit executed ~2x slower than the same shards with the cache resident. Here
Python only prepares the edit and collects the image:

* **before** (:meth:`NativeEngine.inputs`): the request set-up a phone app would do in its
  own language: prompt embeddings through ``txt_in``, the modulation vector of every step
  (``MMDiT.vec(t)``, a function of the schedule), the RoPE tables of the fresh tokens, the
  starting latent and the step sizes; and the manifest: which byte range of which URL
  holds each configuration, its unit checksums, and the allocator's candidate tables;
* **the loop** (``sakura_native.run_stream``): a receive thread (libcurl: kept-alive
  connections, pipelined Range requests, resume, SHA-256 per unit, retries), a reconstruct
  thread (the native sakura/svd and fp16 decoders; codecs without one, intq and cachegen,
  call back into Python for that stage only), and the execute stage running compiled
  graphs (ExecuTorch ``.pte``, XNNPACK) for every step: ``StepIn``, the shard graphs of the
  step's block groups, ``StepOut`` (``sakura.edge.backends.step``); the bandwidth monitor,
  execution progress and allocator are the C++ twins of ``sakura.edge.monitor`` /
  ``sakura.edge.allocator`` (tested against the same unit tests);
* **after**: the latent is composed into the image (template outside the mask).

The graphs are exported once per (weights, template geometry, block groups) and kept in the
compiled-artifact cache (``edge.backends.base.ArtifactCache``, folder ``native``). ``local``
(the whole model, no cache) runs through the same engine with graphs that take no cache, so
the runtime's ratios compare like with like. Scope: the shipped MMDiT, text and masked image
tokens; reference images and the text-KV approximation need the Python runtime (a clear
error says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sakura.codec.lowrank import LowRankCodec, rope_angles, rope_phasors
from sakura.dit.editing import (
    EditRequest,
    Geometry,
    RecomputedKV,
    Template,
    compose,
    edit_schedule,
    edit_start,
    template_noise,
)
from sakura.dit.model import MMDiT, patchify
from sakura.dit.stale import STALE_MAX_AGE
from sakura.edge import RUNTIMES
from sakura.edge.backends.base import ArtifactCache, ArtifactKey, default_cache_dir
from sakura.edge.backends.shard import ShardBounds, ShardGeometry, ShardModule, example_inputs
from sakura.edge.backends.step import StepIn, StepOut, step_dynamic_shapes, step_examples
from sakura.edge.deadlines import local_wait_s
from sakura.edge.errors import (
    EdgeError,
    IntegrityError,
    NativeUnavailable,
    OriginError,
    ServerUnreachable,
    VersionGone,
)
from sakura.edge.native_status import native_module

# Bump when the graphs' computation or their input/output contract changes (cache key).
GRAPHS_FORMAT = 1
# the graph set of the local fallback's recompute step (its groups emit K/V; since
# 2026-12-06): a device bundle without it runs late steps with every token
TEMPLATE_SET = "template"


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for a block: ExecuTorch's C++ runtime logs its CPU
    probing (``cpuinfo_utils.cpp: Failed to open midr file ...``) straight to stderr when
    its threadpool starts, a dozen lines of no use to a user on every edit command."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def check_runtime(name: str) -> str:
    if name not in RUNTIMES:
        raise EdgeError(f"unknown runtime {name!r} (known: {', '.join(RUNTIMES)})")
    return name


def _f32(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to(torch.float32).cpu().numpy())


@dataclass(frozen=True)
class GraphSet:
    """Where the compiled graphs of one geometry are, and how they chain."""

    step_in: Path
    groups: tuple[Path, ...]
    step_out: Path
    group_blocks: tuple[int, ...]
    takes_cache: bool
    dynamic: bool = False  # exported with dynamic M / U: the RoPE inputs hold image rows only
    emits_kv: bool = False  # groups also output every block's K/V (the template pass)


def step_groups(blocks: int, blocks_per_shard: int) -> list[tuple[int, ...]]:
    """The block groups of one step, in ``codec.shards.ShardLayout`` order."""
    if not 1 <= blocks_per_shard <= blocks:
        raise EdgeError(f"blocks_per_shard must be in 1..{blocks}, got {blocks_per_shard}")
    return [tuple(range(i, min(i + blocks_per_shard, blocks)))
            for i in range(0, blocks, blocks_per_shard)]


@dataclass
class NativeEngine:
    """Native edits of the shipped MMDiT: compiled graphs per geometry, request set-up."""

    model: MMDiT
    weights_sha256: str
    cache_dir: Path = field(default_factory=default_cache_dir)
    threads: int = 1
    # cached edits through graphs exported with dynamic M / U (edge/backends/shard.py): one
    # compile per (weights, resolution, batch, text tokens, block groups) serves every
    # template; False: one static compile per template geometry
    dynamic: bool = True
    # the block groups' shard graphs: "fp32", or "int8" (``edge.backends.int8``: PT2E,
    # dynamic activations, per-channel int8 Linear weights; StepIn / StepOut stay fp32)
    precision: str = "fp32"
    _loaded: dict[tuple, Any] = field(default_factory=dict, init=False, repr=False)
    _supported: dict[ShardBounds, bool] = field(default_factory=dict, init=False, repr=False)
    # the per-step modulation vectors of a schedule (no request in them): ~8 ms per edit
    _vecs: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict,
                                                              init=False, repr=False)
    compiles: int = field(default=0, init=False)
    # graph chains of device bundles made in the cloud (``edge.bundle``), by cache-key
    # digest: used instead of exporting on the device (``compiles`` stays 0)
    _bundled: dict[str, GraphSet] = field(default_factory=dict, init=False, repr=False)
    # said once, when graphs are first exported here (not on an edit whose graphs are in
    # the cache already): why the device exports (``edge.bundle.DeviceBundles``)
    _export_note: Callable[[], None] | None = field(default=None, init=False, repr=False)

    def when_exporting(self, note: Callable[[], None]) -> None:
        """Call ``note`` once, before the next export of graphs on this device (a cache
        miss); an edit served from the compiled-graph cache calls nothing."""
        self._export_note = note

    def __post_init__(self) -> None:
        from sakura.edge.backends.int8 import check_precision  # lazy: keeps torchao optional

        check_precision(self.precision)
        self.native = native_module()
        with quiet_stderr():  # ExecuTorch's cpuinfo start-up notes on x86 (harmless)
            self.native.set_graph_threads(self.threads)
        self.cache = ArtifactCache(Path(self.cache_dir), "native")

    # ------------------------------------------------------------------ geometry
    def geometry(self, template: Template, geo: Geometry, req: EditRequest,
                 full: bool = False) -> ShardGeometry:
        if req.ref_images is not None and len(req.ref_images) > 0:
            raise NativeUnavailable("reference images need the Python runtime "
                                    "(--runtime python)")
        batch = 2 if req.txt_uncond is not None and template.guidance != 1.0 else 1
        tokens = geo.grid * geo.grid if full else len(geo.masked)
        return ShardGeometry(batch=batch, txt=int(req.txt.shape[1]), img=tokens,
                             cached=0 if full else len(geo.unmasked))

    # ------------------------------------------------------------------ graphs
    def shape_of(self, geometry: ShardGeometry) -> ShardGeometry | ShardBounds:
        """What the graphs of ``geometry`` are compiled for: its bounds when it runs on
        dynamic graphs (a cached edit whose attention the dynamic form supports), else
        the geometry itself."""
        if not self.dynamic or geometry.cached == 0:
            return geometry
        bounds = ShardBounds(geometry.batch, geometry.txt, geometry.img + geometry.cached)
        if bounds not in self._supported:
            try:  # block-causal masks the dynamic form cannot split fall back to static
                ShardModule(self.model, (0,), bounds.example(), dynamic=True)
                self._supported[bounds] = True
            except ValueError:
                self._supported[bounds] = False
        return bounds if self._supported[bounds] else geometry

    def graphs(self, geometry: ShardGeometry, groups: list[tuple[int, ...]],
               emit_kv: bool = False) -> Any:
        """The loaded ``sakura_native.EditGraphs`` (compiled and cached on first use);
        ``emit_kv``: the template pass's graphs (their groups also output every block's K/V)."""
        return self._graph_set(geometry, groups, emit_kv)[1]

    def _graph_set(self, geometry: ShardGeometry, groups: list[tuple[int, ...]],
                   emit_kv: bool = False) -> tuple[GraphSet, Any]:
        shape = self.shape_of(geometry)
        key = (shape, tuple(groups), emit_kv)
        if key not in self._loaded:
            gs = self._compiled(shape, groups, emit_kv)
            self._loaded[key] = (gs, self._call(
                self.native.EditGraphs, str(gs.step_in), [str(p) for p in gs.groups],
                str(gs.step_out), list(gs.group_blocks), gs.takes_cache))
        return self._loaded[key]

    def _key(self, geometry: ShardGeometry | ShardBounds, groups: list[tuple[int, ...]],
             emit_kv: bool = False) -> ArtifactKey:
        version = (f"{exporter_version()}-graphs{GRAPHS_FORMAT}-groups"
                   + "_".join(f"{g[0]}-{g[-1]}" for g in groups)
                   + ("" if self.precision == "fp32" else f"-{self.precision}")
                   + ("-kv" if emit_kv else ""))
        return ArtifactKey(self.weights_sha256, self.architecture(), geometry,  # type: ignore[arg-type]
                           tuple(b for g in groups for b in g), "native", version)

    def architecture(self) -> str:
        """sha256 of the model's config (part of every graph's cache key)."""
        return hashlib.sha256(json.dumps(self.model.cfg.to_dict(), sort_keys=True).encode()
                              ).hexdigest()

    def graph_plan(self, template: Template, geo: Geometry, req: EditRequest,
                   blocks_per_shard: int, full: bool = True
                   ) -> list[tuple[str, ShardGeometry | ShardBounds, list[tuple[int, ...]]]]:
        """What an edit of this template runs: ``("cached", shape, groups)`` (the streamed
        edit's chain) and, with ``full``, ``("full", ...)`` (``local`` and the local
        fallback) and ``("template", ...)`` (the recompute step's template pass, its groups
        emitting K/V: :meth:`template_geometry`), as :meth:`prepare`, :meth:`prepare_full`
        and :meth:`local_steps` would compile them."""
        blocks = self.model.cfg.num_blocks
        plan = [("cached", self.shape_of(self.geometry(template, geo, req)),
                 step_groups(blocks, blocks_per_shard))]
        if full:
            plan.append(("full", self.geometry(template, geo, req, full=True),
                         step_groups(blocks, blocks)))
            plan.append((TEMPLATE_SET, self.template_geometry(geo, req),
                         step_groups(blocks, blocks)))
        return plan

    @staticmethod
    def template_geometry(geo: Geometry, req: EditRequest) -> ShardGeometry:
        """The template pass's: one batch row, every token, a prompt of the request's
        text length (the template prompt is encoded to the same length)."""
        return ShardGeometry(batch=1, txt=int(req.txt.shape[1]), img=geo.grid * geo.grid,
                             cached=0)

    def export(self, shape: ShardGeometry | ShardBounds, groups: list[tuple[int, ...]],
               emit_kv: bool = False) -> tuple[GraphSet, str]:
        """The graph chain of ``shape`` (exported into the artifact cache unless there) and
        its cache-key digest: what the cloud puts in a device bundle (``edge.bundle``)."""
        return (self._compiled(shape, groups, emit_kv),
                self._key(shape, groups, emit_kv).digest())

    def add_graphs(self, digest: str, graphs: GraphSet) -> None:
        """Use ``graphs`` (a device bundle's chain, checked by ``edge.bundle``) for the
        shape and groups whose cache-key digest is ``digest``, instead of exporting."""
        self._bundled[digest] = graphs

    def _compiled(self, shape: ShardGeometry | ShardBounds, groups: list[tuple[int, ...]],
                  emit_kv: bool = False) -> GraphSet:
        from sakura.edge.backends.executorch_backend import (  # lazy: executorch
            PTE_NAME,
            ExecuTorchBackend,
            export_dynamic,
        )

        dynamic = isinstance(shape, ShardBounds)
        key = self._key(shape, groups, emit_kv)
        bundled = self._bundled.get(key.digest())
        if bundled is not None:
            return bundled
        folder = self.cache.lookup(key)
        if folder is None:
            note, self._export_note = self._export_note, None
            if note is not None:
                note()
            backend = ExecuTorchBackend()
            backend.check_available()
            model = self.model
            # what the graphs are traced with: the geometry, or one inside the bounds
            traced = shape.example() if dynamic else shape
            step_shapes = step_dynamic_shapes(shape.tokens) if dynamic else {}

            def build(tmp: Path) -> None:
                ex = step_examples(model, traced.batch, traced.img)
                parts: list[tuple[str, torch.nn.Module, tuple, Any]] = [
                    ("step_in", StepIn(model, traced.batch), ex["step_in"],
                     step_shapes.get("step_in")),
                    ("step_out", StepOut(model, traced.batch), ex["step_out"],
                     step_shapes.get("step_out"))]
                for i, blocks in enumerate(groups):
                    module = ShardModule(model, blocks, traced, backend.explicit_rms,
                                         backend.sigmoid_gelu, delegable=backend.delegable,
                                         dynamic=dynamic, emit_kv=emit_kv)
                    parts.append((f"group{i}", module,
                                  example_inputs(model, blocks, traced, dynamic=dynamic),
                                  shape.dynamic_shapes(blocks) if dynamic else None))
                for name, module, example, dims in parts:
                    (tmp / name).mkdir()
                    if self.precision == "int8" and name.startswith("group"):
                        from sakura.edge.backends.int8 import (  # lazy: torchao
                            export_int8,
                        )

                        export_int8(module.eval(), example, tmp / name / PTE_NAME, dims)
                    elif dims is None:
                        backend._compile(module.eval(), example, tmp / name)
                    else:
                        export_dynamic(module.eval(), example, dims, tmp / name / PTE_NAME)

            try:
                folder = self.cache.publish(key, build)
            except EdgeError:
                raise
            except Exception as exc:  # noqa: BLE001 - exporter internals
                raise EdgeError(f"compiling the native graphs ({shape.describe()}) failed: "
                                f"{type(exc).__name__}: {exc}") from exc
            self.compiles += 1
        return GraphSet(folder / "step_in" / PTE_NAME,
                        tuple(folder / f"group{i}" / PTE_NAME for i in range(len(groups))),
                        folder / "step_out" / PTE_NAME, tuple(len(g) for g in groups),
                        dynamic or shape.cached > 0, dynamic, emit_kv)

    # ------------------------------------------------------------------ request set-up
    @torch.inference_mode()
    def inputs(self, template: Template, geo: Geometry, req: EditRequest,
               geometry: ShardGeometry, dynamic: bool = False, pin_all: bool = False) -> Any:
        """The tensors of one edit as ``sakura_native.EditInputs`` (see the module
        docstring); ``full``: every token; ``pin_all``: every token pinned to the template
        trajectory (the recompute step's template pass, ``req`` holding the template prompt);
        ``dynamic``: for dynamic graphs, whose text RoPE tables are constants (``cos`` and
        ``sin`` hold the image tokens' rows only)."""
        model = self.model
        full = geometry.cached == 0
        ts = edit_schedule(template)
        b = geometry.batch
        txt = torch.cat([req.txt, req.txt_uncond]) if b == 2 else req.txt
        key = (tuple(float(v) for v in ts[: template.steps]), b)
        if key not in self._vecs:
            vt, vi = [], []
            for s in range(template.steps):
                t = ts[s].reshape(1).expand(b)
                vec = model.vec(t)
                vec_ref = model.vec(torch.zeros_like(t))
                vi.append(vec)
                vt.append(vec_ref if model.cfg.attention_mode == "block_causal" else vec)
            self._vecs[key] = (_f32(torch.stack(vt)), _f32(torch.stack(vi)))
        vec_txt, vec_img = self._vecs[key]
        x = edit_start(model, template, req.seed)
        pos = geo.pos if full else geo.pos[geo.masked]
        angles = model.angles(pos) if dynamic else torch.cat(
            [model.angles(model.text_positions(geometry.txt)), model.angles(pos)])
        doc = {
            "steps": template.steps,
            "x": _f32(x if full else x[:, geo.masked]),
            "txt": _f32(model.txt_in(txt)),
            "vec_txt": vec_txt, "vec_img": vec_img,
            "cos": _f32(angles.cos()), "sin": _f32(angles.sin()),
            "dt": _f32(torch.stack([ts[s + 1] - ts[s] for s in range(template.steps)])),
            "guidance": float(template.guidance),
        }
        if full:
            pinned = range(geo.grid * geo.grid) if pin_all else geo.unmasked
            doc.update(pinned=[int(i) for i in pinned],
                       pin_x0=_f32(patchify(template.image[None].float(),
                                            model.cfg.patch_size)),
                       pin_noise=_f32(template_noise(model, template)),
                       t=_f32(ts[:-1]))
        return self.native.EditInputs(**doc)

    def image(self, template: Template, geo: Geometry, x: np.ndarray, full: bool = False
              ) -> torch.Tensor:
        p = self.model.cfg.patch_dim
        latent = torch.from_numpy(np.asarray(x)).reshape(1, -1, p)
        if full:
            latent = latent[:, geo.masked]
        return compose(self.model, template, geo, latent)

    def prepare(self, template: Template, geo: Geometry, req: EditRequest,
                blocks_per_shard: int) -> None:
        """Compile (first time) and load the graphs of a cached edit of this geometry."""
        self.graphs(self.geometry(template, geo, req),
                    step_groups(self.model.cfg.num_blocks, blocks_per_shard))

    def prepare_full(self, template: Template, req: EditRequest) -> None:
        """Compile (first time) and load the graphs of a full (no-cache) edit."""
        geo = Geometry.of(self.model, template)
        self.graphs(self.geometry(template, geo, req, full=True),
                    step_groups(self.model.cfg.num_blocks, self.model.cfg.num_blocks))

    def prepare_recompute(self, template: Template, geo: Geometry, req: EditRequest) -> None:
        """Compile (first time) and load the recompute step's template-pass graphs
        (:meth:`local_steps`), when the template carries its prompt embeddings."""
        if self._recomputes(template, req):
            blocks = self.model.cfg.num_blocks
            self.graphs(self.template_geometry(geo, req), step_groups(blocks, blocks),
                        emit_kv=True)

    @staticmethod
    def _recomputes(template: Template, req: EditRequest) -> bool:
        """Whether the local fallback runs recompute steps for this edit: the template's
        prompt embeddings are at hand, as long as the request's (one graph shape)."""
        return (RecomputedKV.possible(template)
                and int(template.txt.shape[1]) == int(req.txt.shape[1]))

    # ------------------------------------------------------------------ edits
    def full_edit(self, template: Template, req: EditRequest) -> torch.Tensor:
        """``local``: the whole model on every token, no cache (``dit.editing.full_edit``)."""
        geo = Geometry.of(self.model, template)
        geometry = self.geometry(template, geo, req, full=True)
        groups = step_groups(self.model.cfg.num_blocks, self.model.cfg.num_blocks)
        graphs = self.graphs(geometry, groups)
        x = self._call(self.native.run_full, graphs, self.inputs(template, geo, req, geometry))
        return self.image(template, geo, x, full=True)

    def resident_edit(self, template: Template, geo: Geometry, req: EditRequest,
                      blocks_per_shard: int, shards: list[np.ndarray],
                      origin: float | None = None) -> tuple[torch.Tensor, list[dict]]:
        """The edit with every shard's ``[2 * blocks, U, C]`` K/V in memory (the compute
        floor, ``exact``): (image, per-shard records with exec times, as dicts)."""
        image, records = self._resident(template, geo, req, blocks_per_shard, shards, origin)
        return image, [r.to_dict() for r in records]

    def _resident(self, template: Template, geo: Geometry, req: EditRequest,
                  blocks_per_shard: int, shards: list[np.ndarray],
                  origin: float | None = None) -> tuple[torch.Tensor, list[Any]]:
        """:meth:`resident_edit` with the records as ``sakura_native.ShardRecord``."""
        geometry = self.geometry(template, geo, req)
        groups = step_groups(self.model.cfg.num_blocks, blocks_per_shard)
        gs, graphs = self._graph_set(geometry, groups)
        plan = [{"step": s, "blocks": list(g)} for s in range(template.steps) for g in groups]
        if len(shards) != len(plan):
            raise EdgeError(f"the resident cache has {len(shards)} shards, the edit "
                            f"needs {len(plan)}")
        origin = time.monotonic() if origin is None else origin
        x, records = self._call(
            self.native.run_resident, graphs,
            self.inputs(template, geo, req, geometry, gs.dynamic), plan,
            [np.ascontiguousarray(s, dtype=np.float32) for s in shards], origin)
        return self.image(template, geo, x), list(records)

    def calibrate(self, template: Template, geo: Geometry, req: EditRequest,
                  blocks_per_shard: int) -> list[float]:
        """Execution time of each block, from a zero-cache native run (every step after the
        first; the median per group, shared equally by the group's blocks)."""
        groups = step_groups(self.model.cfg.num_blocks, blocks_per_shard)
        u, c = len(geo.unmasked), self.model.cfg.hidden_size
        zeros = [np.zeros((2 * len(g), u, c), np.float32) for _ in range(template.steps)
                 for g in groups]
        _img, records = self._resident(template, geo, req, blocks_per_shard, zeros)
        per_group: list[list[float]] = [[] for _ in groups]
        for i, r in enumerate(records):
            if i >= len(groups) or template.steps == 1:
                per_group[i % len(groups)].append(r.exec_end - r.exec_start)
        out = [0.0] * self.model.cfg.num_blocks
        for g, times in zip(groups, per_group):
            for b in g:
                out[b] = float(np.median(times)) / len(g)
        return out

    def local_steps(self, template: Template, geo: Geometry, req: EditRequest,
                    exec_s: list[float], measured_step_s: float | None = None,
                    stale_max_age: int = STALE_MAX_AGE) -> Any:
        """The local fallback's part of ``run_stream`` (``sakura_native.LocalFallback``): the full graphs (compiled the first
        time, as ``local``'s), their inputs, the masked tokens' rows and ``step_s``, the
        wait bound of one local step (:func:`~edge.deadlines.local_wait_s`), and the oldest
        K/V a late step may reuse before one is computed locally (``dit.stale``)."""
        full_geo = self.geometry(template, geo, req, full=True)
        graphs = self.graphs(full_geo, step_groups(self.model.cfg.num_blocks,
                                                   self.model.cfg.num_blocks))
        step_s = local_wait_s(measured_step_s, exec_s, template.steps,
                              len(geo.masked) + len(geo.unmasked), len(geo.masked))
        recompute: dict[str, Any] = {}
        if self._recomputes(template, req):
            # the recompute step (dit.editing.RecomputedKV): the template pass's graphs,
            # the template prompt in the request's place
            tmpl_geo = self.template_geometry(geo, req)
            tmpl_req = EditRequest(txt=template.txt, txt_uncond=None, seed=0)
            recompute = {
                "recompute": self.graphs(tmpl_geo, step_groups(self.model.cfg.num_blocks,
                                                               self.model.cfg.num_blocks),
                                         emit_kv=True),
                "recompute_inputs": self.inputs(template, geo, tmpl_req, tmpl_geo, pin_all=True),
                "unmasked": [int(i) for i in geo.unmasked]}
        return self.native.LocalFallback(
            graphs=graphs, inputs=self.inputs(template, geo, req, full_geo),
            masked=[int(i) for i in geo.masked], step_s=float(step_s),
            stale_max_age=int(stale_max_age), **recompute)

    def streamed_edit(self, template: Template, geo: Geometry, req: EditRequest,
                      stream: Any, allocator: Any, monitor: Any, progress: Any,
                      blocks_per_shard: int, local: Any = None
                      ) -> tuple[torch.Tensor, list[Any], list[dict]]:
        """The streamed edit (``sakura_native.run_stream``): (image, records as
        ``sakura_native.ShardRecord``, requests); ``local`` (:meth:`local_steps`): the local
        fallback."""
        geometry = self.geometry(template, geo, req)
        groups = step_groups(self.model.cfg.num_blocks, blocks_per_shard)
        gs, graphs = self._graph_set(geometry, groups)
        inputs = self.inputs(template, geo, req, geometry, gs.dynamic)
        if callable(progress):  # made now: the set-up above does not eat the allowance
            progress = progress()
        x, records, requests = self._call(self.native.run_stream, graphs, inputs, stream,
                                          allocator, monitor, progress, local)
        return self.image(template, geo, x), list(records), list(requests)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A ``sakura_native`` call whose errors become the edge's user-facing ones."""
        try:
            return fn(*args)
        except self.native.FetchError as exc:
            raise fetch_error(str(exc)) from None
        except self.native.FormatError as exc:
            raise IntegrityError(f"a shard could not be decoded: {exc}") from None
        except (RuntimeError, ValueError) as exc:  # graphs that do not load or run (stale
            # artifacts, ...), options the machine cannot honour (pipeline_cpus)
            raise EdgeError(f"native runtime: {exc}") from None


def exporter_version() -> str:
    """What exported graphs depend on besides the model and geometry (ExecuTorch, torch and
    the lowering's options): a device bundle made with another one is refused."""
    from sakura.edge.backends.executorch_backend import ExecuTorchBackend  # lazy: executorch

    return ExecuTorchBackend().version()


def fetch_error(text: str) -> EdgeError:
    """The edge error of a native ``FetchError`` ("<kind>: <message>")."""
    kind, _, message = text.partition(": ")
    cls = {"unreachable": ServerUnreachable, "integrity": IntegrityError,
           "http": OriginError, "version_gone": VersionGone}.get(kind, EdgeError)
    return cls(message or text)


def stream_shards(manifest: Mapping[str, Any], url: str) -> list[dict[str, Any]]:
    """The shard table of ``run_stream`` from a format-2 manifest whose pack is at ``url``:
    per shard and configuration its one byte range, the unit lengths and checksums and the
    ranks (a function of the manifest and the URL only, so callers memoise it)."""
    table = manifest.get("units") or []
    pack_bytes = manifest.get("pack_bytes")
    pack_bytes = int(pack_bytes) if isinstance(pack_bytes, int) and pack_bytes >= 0 else None
    shards = []
    for s in sorted(manifest["shards"], key=lambda s: int(s["index"])):
        configs = []
        for c in s["configs"]:
            (offset, length), = c["ranges"]
            units = [(int(table[int(u)][1]), str(table[int(u)][2])) for u in c.get("units", [])]
            entry = {"id": int(c["id"]), "url": url, "offset": int(offset),
                     "length": int(length), "units": units, "pack_bytes": pack_bytes}
            params = c.get("params") or {}
            if params.get("ranks") is not None:
                entry["ranks"] = [int(r) for r in params["ranks"]]
            if isinstance(params.get("bits"), int):  # intq: its one bit width
                entry["bits"] = int(params["bits"])
            configs.append(entry)
        shards.append({"step": int(s["step"]), "blocks": [int(b) for b in s["blocks"]],
                       "configs": configs})
    return shards


def stream_spec(shards: Any, geometry: Mapping[str, Any], *,
                http: Any, origin: float, max_ahead: int, max_ready: int,
                max_inflight: int, lookahead_rtts: float, max_ahead_cap: int,
                reconstruct: str, kind: str,
                decode: Callable[[int, int, bytes], np.ndarray],
                rope: np.ndarray | None,
                pipeline_cpus: Sequence[int] | None = None,
                refine: bool = True, intq_group: int = 32, stale_plan_age: int = 0,
                plan_local: bool = True) -> Any:
    """What ``run_stream`` needs, as a ``sakura_native.StreamSpec``: the shard table
    (``sakura_native.StreamTable`` of :func:`stream_shards`), the HTTP settings
    (``sakura_native.HttpOptions``), the pipeline's limits and the decoder ``kind``
    (:func:`decode_kind`; ``callback``: the Python ``decode``; ``intq``: ``intq_group``
    channels per scale); ``stale_plan_age``: the stale plan's oldest K/V (``edge.stale_plan``;
    0: off); ``plan_local``: it may plan a step local where that step is a recompute step."""
    return native_module().StreamSpec(
        shards=shards, http=http, decode=kind,
        callback=decode if kind == "callback" else None,
        rope=rope if kind == "lowrank" else None,
        matrix_floats=int(geometry["tokens"]) * int(geometry["channels"]),
        max_ahead=max_ahead, max_ready=max_ready, max_inflight=max_inflight,
        lookahead_rtts=lookahead_rtts, max_ahead_cap=max_ahead_cap, refine=refine,
        reconstruct=reconstruct,
        pipeline_cpus=None if pipeline_cpus is None else [int(c) for c in pipeline_cpus],
        origin=origin, channels=int(geometry["channels"]), intq_group=int(intq_group),
        stale_plan_age=int(stale_plan_age), plan_local=bool(plan_local))


def decode_kind(codec: Any) -> str:
    """How the native reconstruct stage decodes this codec's configurations: ``lowrank``
    (sakura, svd: the native kernels), ``fp16`` and ``intq`` (native), else ``callback``
    (the codec's Python decoder, called from the reconstruct thread: cachegen)."""
    if isinstance(codec, LowRankCodec):
        return "lowrank"
    name = getattr(codec, "name", "")
    return name if name in ("fp16", "intq") else "callback"


def rope_table(codec: Any, tokens: int, channels: int) -> np.ndarray | None:
    """The keys' RoPE table ``[N, C/2, 2]`` (cos, sin) of a low-rank codec, or None."""
    rope = getattr(getattr(codec, "opts", None), "rope", None)
    if rope is None:
        return None
    phasors = rope_phasors(rope_angles(rope, tokens, channels), int(rope["heads"]),
                           torch.float32)
    return _f32(torch.view_as_real(phasors))
