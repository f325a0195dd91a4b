"""The phone-side parts of ``sakura bench backends``: arm64, OpenCL, quantized HTP shards.

All three run on real data of the benchmarked template: the trained model's template run,
its importance profiled with the catalog's profiling prompts (as ``sakura build`` does), and
a ``sakura`` pack of its cache (keys in the RoPE frame), written to a temporary folder.

* ``arm64`` (:mod:`edge.backends.arm64`): ``sakura-native`` cross-compiled for arm64 and run
  under qemu-aarch64 on configurations of that pack; ``max_rel_err`` against the x86 Python
  decoder's tensors (the tool's bound 1e-5).
* ``opencl``: every sampled configuration decoded by the OpenCL kernels (pocl here: a CPU
  OpenCL, so ``gbps`` is a CPU figure, not an Adreno one) and by the CPU kernels;
  ``max_abs_err_vs_cpu`` and ``gbps`` = FP16-equivalent bytes reconstructed per second
  (median wall time of a decode, uploads and the read-back included), beside the CPU
  kernels' ``cpu_gbps`` from the same loop (1 thread).
* ``qnn_quantized``: QDQ shard graphs calibrated on the shard inputs of edits with the
  profiling prompts (never the evaluated one), compiled for the HTP simulator; the whole
  edit's PSNR against the exact edit, next to the fp16 HTP graph's.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sakura.codec import DEFAULT_BLOCKS_PER_SHARD
from sakura.codec.base import get_codec
from sakura.codec.pack import write_pack
from sakura.dit.editing import EditRequest, Template, TemplateRun, profile_importance
from sakura.dit.model import MMDiT
from sakura.dit.rope import rope_option
from sakura.edge.backends import arm64
from sakura.edge.backends.base import BackendConfig
from sakura.edge.backends.delegation import context_cpu_nodes
from sakura.edge.backends.errors import BackendError
from sakura.edge.backends.executor import ShardExecutor, edit_geometry
from sakura.edge.backends.qnn_quantized import QnnQuantizedBackend, capture_calibration, qdq_summary
from sakura.edge.native_bench import NativeBenchConfig, export_shards, pack_cases, rope_table
from sakura.edge.quality import psnr


def build_pack(model: MMDiT, template: Template, run: TemplateRun,
               profiling: Sequence[EditRequest], out: Path, template_id: str,
               blocks_per_shard: int = DEFAULT_BLOCKS_PER_SHARD) -> Path:
    """A ``sakura`` pack (RoPE frame, importance from ``profiling``) of ``run``'s cache."""
    profile_importance(model, template, run, list(profiling))
    geo, cfg = run.geometry, model.cfg
    rope = rope_option(geo.pos[geo.unmasked], cfg.rope_axes, cfg.rope_theta, cfg.num_heads)
    out.mkdir(parents=True, exist_ok=True)
    write_pack(out, template_id, run.cache, get_codec("sakura", rope=rope),
               blocks_per_shard=blocks_per_shard, model={"name": "sakura-mmdit"})
    return out


def bench_arm64(pack_dir: Path, template_id: str, shards: int = 3, configs: int = 4,
                log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sakura-arm64-") as tmp:
        exported = Path(tmp) / "shards"
        info = export_shards(NativeBenchConfig(pack_dir=pack_dir, template=template_id,
                                               shards=shards, configs_per_shard=configs),
                             exported)
        log(f"  arm64: building native/ for aarch64, {info['shards']} configurations")
        t0 = time.perf_counter()
        result = arm64.check(Path(tmp) / "build", exported)
        doc = result.to_dict()
        doc["build_and_emulated_run_s"] = time.perf_counter() - t0
        return doc


def bench_opencl(pack_dir: Path, template_id: str, shards: int = 3, configs: int = 4,
                 repeats: int = 5) -> dict[str, Any]:
    import sakura_native as native

    ok, why = native.opencl_available()
    if not ok:
        raise BackendError(f"no OpenCL device: {why}")
    dec = native.OpenCLDecoder()
    codec, cases, _workload = pack_cases(NativeBenchConfig(
        pack_dir=pack_dir, template=template_id, shards=shards, configs_per_shard=configs))
    err = scale = 0.0
    equal = 0
    gpu_t = cpu_t = 0.0
    fp16_bytes = 0
    kernels: dict[str, list[float]] = {}
    for c in cases:
        table = rope_table(codec, c.spec)
        ranks = c.params["ranks"]
        cpu = native.decode(c.data, ranks, table)
        gpu = dec.decode(c.data, ranks, table)
        err = max(err, float(np.abs(cpu.astype(np.float64) - gpu).max()))
        scale = max(scale, float(np.abs(cpu).max()))
        equal += bool(np.array_equal(cpu, gpu))
        gpu_t += _median(lambda c=c, r=ranks, t=table: dec.decode(c.data, r, t), repeats)
        for k, v in dec.last_timings.items():
            kernels.setdefault(k, []).append(v)
        cpu_t += _median(lambda c=c, r=ranks, t=table: native.decode(c.data, r, t), repeats)
        fp16_bytes += c.fp16_bytes
    return {"device": dec.device["name"], "platform": dec.device["platform"],
            "device_type": dec.device["type"], "work_groups": {
                "dequantize": dec.work_groups["dequantize"],
                "product": list(dec.work_groups["product"])},
            "configs": len(cases), "bit_equal_configs": equal,
            "max_abs_err_vs_cpu": err, "max_abs_value": scale,
            "gbps": fp16_bytes / gpu_t / 1e9, "cpu_gbps": fp16_bytes / cpu_t / 1e9,
            "cpu_kernel": native.product_kernel(),
            "kernel_ms_mean": {k: statistics.fmean(v) for k, v in kernels.items()}}


def _median(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_quantized(model: MMDiT, template: Template, run: TemplateRun, cache: Any,
                    req: EditRequest, calibration_requests: Sequence[EditRequest],
                    groups: list[tuple[int, ...]], schemes: Sequence[str],
                    reference_edit: torch.Tensor, weights: str,
                    log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Per scheme: compile, whole edit vs exact (``reference_edit``), delegation."""
    if not calibration_requests:
        raise BackendError("qnn_quantized needs calibration requests (the template's "
                           "profiling prompts)")
    geo = run.geometry
    t0 = time.perf_counter()
    cal = capture_calibration(model, template, geo, cache, calibration_requests, groups)
    doc: dict[str, Any] = {"calibration": {
        "requests": len(calibration_requests), "feeds_per_graph": len(cal[tuple(groups[0])]),
        "capture_s": time.perf_counter() - t0, "method": "MinMax"}}
    geometry = edit_geometry(model, template, geo, req)
    for scheme in schemes:
        log(f"  qnn {scheme}: calibrate, quantize, compile")
        with tempfile.TemporaryDirectory(prefix=f"sakura-qnn-{scheme}-") as tmp:
            backend = QnnQuantizedBackend(BackendConfig(cache_dir=Path(tmp)), scheme=scheme,
                                          calibration=cal)
            backend.check_available()
            ex = ShardExecutor(model, backend, weights)
            t0 = time.perf_counter()
            for blocks in groups:
                ex.shard(geometry, blocks)
            compile_s = time.perf_counter() - t0
            graphs = []
            for blocks in groups:
                folder = backend.cache.lookup(backend.key(model, weights, blocks, geometry))
                allowed = backend.assignment(backend.qdq_path(folder))
                graphs.append({"blocks": list(blocks),
                               "qdq": qdq_summary(backend.qdq_path(folder)),
                               "context_cpu_nodes": context_cpu_nodes(
                                   folder / "shard_ctx.onnx"),
                               "fallback_allowed": allowed.to_dict(),
                               "boundary_only": allowed.boundary_only(
                                   backend.qdq_path(folder))})
            log(f"  qnn {scheme}: edit on the simulator")
            t0 = time.perf_counter()
            image = ex.edit(template, geo, cache, req, groups)
            edit_s = time.perf_counter() - t0
            db = psnr(image, reference_edit)
            doc[scheme] = {"edit_psnr_db": "inf" if db == float("inf") else db,
                           "edit_max_abs_err": float((image - reference_edit).abs().max()),
                           "compile_total_s": compile_s, "edit_s": edit_s, "graphs": graphs}
            log(f"  qnn {scheme}: edit PSNR {db:.2f} dB")
    return doc
