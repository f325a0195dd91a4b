"""``sakura bench backends``: every backend on the shard graphs of one template.

Per backend: compile time of each shard graph into an empty artifact cache (first use),
load time of the cached artifact by a fresh backend instance (every later use, and the
evidence that nothing recompiles: ``recompiles`` must be 0), shard latency (median over
``repeats`` runs on real inputs: the hidden states, modulation, RoPE and template cache of
a mid-edit step), max abs error of the shard outputs against the torch backend, and a whole
masked edit with the FP16 template cache through the backend: max abs pixel error and PSNR
against the torch backend's edit (which equals ``dit.editing.cached_edit``).

Delegation (``edge.backends.delegation``): ``xnnpack_delegated_ops_fraction`` = compute ops
inside XNNPACK subgraphs / all compute ops of the ExecuTorch shard graphs (ExecuTorch's
delegation info, target 1.0); ``qnn_cpu_fallback_nodes`` = ONNX nodes ONNX Runtime gives to
another provider than the QNN EP when fallback is allowed (target 0).

Phone side (``edge.backends.phone_bench``): ``arm64`` (the native runtime cross-compiled and
run under qemu-aarch64), ``opencl`` (GPU reconstruction vs the CPU kernels), and
``qnn_quantized`` (w8a16 / w8a8 QDQ shard graphs on the HTP simulator, edit PSNR vs exact).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sakura.codec import DEFAULT_BLOCKS_PER_SHARD
from sakura.dit.bench_kv import median_time
from sakura.dit.cache import KVProvider
from sakura.dit.editing import EditRequest, Geometry, Template, cached_edit, template_run
from sakura.dit.model import MMDiT
from sakura.edge.backends import BACKENDS, create_backend, phone_bench
from sakura.edge.backends.base import BackendConfig, CompiledShard, weights_sha256
from sakura.edge.backends.errors import BackendError
from sakura.edge.backends.executor import ShardExecutor, edit_geometry, step_groups
from sakura.edge.backends.shard import ShardGeometry
from sakura.edge.quality import psnr


@dataclass
class BackendBenchSpec:
    """What to measure."""

    backends: Sequence[str] = BACKENDS
    blocks_per_shard: int = DEFAULT_BLOCKS_PER_SHARD
    repeats: int = 5
    step: int | None = None  # the step whose shard inputs are timed (default: the middle)
    qnn_options: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = lambda msg: None
    phone: bool = False                  # arm64 build + emulated run, OpenCL reconstruction
    quantized: Sequence[str] = ()        # QDQ schemes on the HTP simulator ("w8a16", "w8a8")
    calibration_requests: Sequence[EditRequest] = ()  # the template's profiling prompts


class _Recording(CompiledShard):
    """Wraps a compiled shard and keeps the inputs it saw at one step."""

    def __init__(self, inner: CompiledShard, sink: list, counter: dict, step: int) -> None:
        super().__init__(inner.blocks, inner.shapes)
        self.inner, self.sink, self.counter, self.step = inner, sink, counter, step

    def _run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counter["step"] == self.step:
            self.sink.append((self.blocks, [x.clone() for x in inputs]))
        return self.inner._run(inputs)


def shard_inputs(model: MMDiT, template: Template, geo: Geometry, provider: KVProvider,
                 req: EditRequest, groups: list[tuple[int, ...]], step: int
                 ) -> list[tuple[tuple[int, ...], list[torch.Tensor]]]:
    """The real inputs of every shard graph at ``step`` of an edit (torch backend)."""
    ex = ShardExecutor(model, create_backend("torch"))
    sink: list = []
    counter = {"step": 0}
    geometry = edit_geometry(model, template, geo, req)
    for blocks in groups:
        ex.use(geometry, blocks, _Recording(ex.shard(geometry, blocks), sink, counter, step))

    def on_step(s: int) -> None:
        counter["step"] = s + 1

    ex.edit(template, geo, provider, req, groups, on_step=on_step)
    return sink


def bench_backends(model: MMDiT, template: Template, req: EditRequest,
                   spec: BackendBenchSpec, template_id: str = "") -> dict[str, Any]:
    """Measure every backend of ``spec`` (see the module docstring); returns the JSON doc."""
    log = spec.log
    groups = step_groups(model.cfg.num_blocks, spec.blocks_per_shard)
    log(f"template run ({template.steps} steps)")
    run = template_run(model, template)
    geo = run.geometry
    cache = run.cache.to_fp16_exact()  # what the fp16 policy (= exact) streams
    geometry: ShardGeometry = edit_geometry(model, template, geo, req)
    step = spec.step if spec.step is not None else template.steps // 2
    inputs = shard_inputs(model, template, geo, cache, req, groups, step)
    with torch.inference_mode():
        reference_edit = cached_edit(model, template, geo, cache, req)
    weights = weights_sha256(model)
    torch_backend = create_backend("torch")
    ref_out = {blocks: torch_backend.prepare(model, blocks, geometry).run(*xs)
               for blocks, xs in inputs}
    doc: dict[str, Any] = {
        "template": template_id, "geometry": geometry.to_dict(),
        "blocks_per_shard": spec.blocks_per_shard, "groups": [list(g) for g in groups],
        "steps": template.steps, "timed_step": step, "repeats": spec.repeats,
        "torch_threads": torch.get_num_threads(), "weights_sha256": weights,
        "loadavg_at_start": list(os.getloadavg()),
        "backends": {}}
    for name in spec.backends:
        log(f"backend {name}")
        with tempfile.TemporaryDirectory(prefix=f"sakura-bench-{name}-") as tmp:
            config = BackendConfig(cache_dir=Path(tmp),
                                   options=dict(spec.qnn_options) if name == "qnn" else {})
            first = create_backend(name, config)
            shards = {}
            for blocks in groups:
                t0 = time.perf_counter()
                shards[blocks] = first.prepare(model, blocks, geometry, weights)
                log(f"  blocks {blocks[0]}-{blocks[-1]}: ready in "
                    f"{time.perf_counter() - t0:.1f} s")
            again = create_backend(name, config)  # a fresh process would do the same
            for blocks in groups:
                again.prepare(model, blocks, geometry, weights)
            per_shard = []
            for blocks, xs in inputs:
                out = shards[blocks].run(*xs)
                ref = ref_out[blocks]
                err = max(float((o - r).abs().max()) for o, r in zip(out, ref))
                scale = max(float(r.abs().max()) for r in ref)
                lat = median_time(lambda s=shards[blocks], x=xs: s.run(*x), spec.repeats)
                per_shard.append({"blocks": list(blocks), "latency_s": lat,
                                  "max_abs_err": err, "ref_max_abs": scale})
            ex = ShardExecutor(model, first, weights)
            for b, s in shards.items():
                ex.use(geometry, b, s)
            t0 = time.perf_counter()
            image = ex.edit(template, geo, cache, req, groups)
            edit_s = time.perf_counter() - t0
            compile_s = first.stats.compile_s
            delegation = _delegation(first, model, weights, groups, geometry)
            doc.update(delegation.pop("top", {}))
            doc["backends"][name] = {
                "version": first.version(),
                "shards": per_shard,
                "step_latency_s": sum(s["latency_s"] for s in per_shard),
                "max_abs_err": max(s["max_abs_err"] for s in per_shard),
                "compile_s": compile_s, "compile_total_s": sum(compile_s),
                "cached_load_s": again.stats.load_s,
                "cached_load_total_s": sum(again.stats.load_s),
                "compiles": first.stats.compiles, "recompiles": again.stats.compiles,
                "cache_hits": again.stats.cache_hits,
                "edit_s": edit_s,
                "edit_max_abs_err": float((image - reference_edit).abs().max()),
                "edit_psnr_db": _finite(psnr(image, reference_edit)),
                **delegation,
            }
            log(f"  step {doc['backends'][name]['step_latency_s'] * 1e3:.1f} ms, shard err "
                f"{doc['backends'][name]['max_abs_err']:.2e}, edit PSNR "
                f"{doc['backends'][name]['edit_psnr_db']}")
    doc["loadavg_after_backends"] = list(os.getloadavg())  # 2 shared cores: timings move
    if spec.phone or spec.quantized:
        doc.update(_phone_side(model, template, run, cache, req, spec, groups,
                               reference_edit, weights, template_id, doc))
    return doc


def _phone_side(model: MMDiT, template: Template, run: Any, cache: Any, req: EditRequest,
                spec: BackendBenchSpec, groups: list[tuple[int, ...]],
                reference_edit: torch.Tensor, weights: str, template_id: str,
                doc: dict[str, Any]) -> dict[str, Any]:
    """The ``arm64``, ``opencl`` and ``qnn_quantized`` keys (``edge.backends.phone_bench``);
    a part that cannot run here reports ``{"error": why}``."""
    out: dict[str, Any] = {}
    if spec.phone:
        with tempfile.TemporaryDirectory(prefix="sakura-bench-pack-") as tmp:
            spec.log("phone side: a sakura pack of the template's cache")
            pack = phone_bench.build_pack(model, template, run, spec.calibration_requests,
                                          Path(tmp) / "pack", template_id or "template",
                                          spec.blocks_per_shard)
            for key, fn in (("arm64", lambda: phone_bench.bench_arm64(
                                pack, template_id or "template", log=spec.log)),
                            ("opencl", lambda: phone_bench.bench_opencl(
                                pack, template_id or "template", repeats=spec.repeats))):
                try:
                    out[key] = fn()
                except (BackendError, ImportError) as exc:
                    out[key] = {"error": str(exc)}
                spec.log(f"  {key}: {out[key]}")
    if spec.quantized:
        q = phone_bench.bench_quantized(model, template, run, cache, req,
                                        spec.calibration_requests, groups, spec.quantized,
                                        reference_edit, weights, log=spec.log)
        first = spec.quantized[0]
        fp16 = doc["backends"].get("qnn", {}).get("edit_psnr_db")
        out["qnn_quantized"] = {"scheme": first, "edit_psnr_db": q[first]["edit_psnr_db"],
                                "fp16_edit_psnr_db": fp16, **q}
    return out


def _delegation(backend: Any, model: MMDiT, weights: str, groups: list[tuple[int, ...]],
                geometry: ShardGeometry) -> dict[str, Any]:
    """Delegation of the compiled shard graphs (``top``: the document-level keys)."""
    folders = [backend.cache.lookup(backend.key(model, weights, g, geometry)) for g in groups]
    if backend.name == "executorch":
        infos = [backend.delegation(f) for f in folders]
        inside = sum(i.delegated_ops for i in infos)
        outside = sum(i.outside_ops for i in infos)
        return {"delegation": [i.to_dict() for i in infos],
                "top": {"xnnpack_delegated_ops_fraction": inside / max(inside + outside, 1)}}
    if backend.name == "qnn":
        got = [backend.assignment(backend.onnx_path(f)) for f in folders]
        return {"assignment": [a.to_dict() for a in got],
                "top": {"qnn_cpu_fallback_nodes": sum(a.cpu_fallback_nodes for a in got)}}
    return {}


def _finite(x: float) -> float | str:
    return "inf" if x == float("inf") else x


def write(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
