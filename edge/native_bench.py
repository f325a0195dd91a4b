"""``sakura bench native``: native (C++) vs Python reconstruction and the native pipeline.

Workload: every configuration of a sample of shards of a real pack (``--pack DIR``), or of
a synthetic cache at the shipped model's geometry with the model-style RoPE frame. Per
configuration, the median decode time through ``LowRankCodec.decode`` with the Python
decoder and with ``sakura_native`` (1 thread, and ``--threads`` threads); throughput is
FP16 bytes reconstructed per second over all of them. Every pair of outputs is compared
(bit-equal count, max abs difference). Pipeline overhead: microseconds per shard of a
pipeline of no-op stages (native stages; Python callables), and the native pipeline
(receive bytes -> native decode -> execute) over the sampled shards.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sakura.codec import native as codec_native
from sakura.codec.base import get_codec
from sakura.codec.lowrank import LowRankCodec
from sakura.codec.pack import Manifest, PackReader, manifest_path
from sakura.codec.shards import ShardLayout, ShardSpec, shard_data
from sakura.dit.bench_kv import median_time
from sakura.dit.rope import rope_option
from sakura.dit.synthetic import synthetic_cache
from sakura.edge.errors import EdgeError


@dataclass(frozen=True)
class NativeBenchConfig:
    pack_dir: Path | None = None
    template: str | None = None
    shards: int = 6
    configs_per_shard: int = 8
    repeats: int = 15
    threads: int = 2
    pipeline_shards: int = 20000


@dataclass
class Case:
    """One configuration's bytes and what decodes it."""

    shard: int
    params: dict[str, Any]
    data: bytes
    spec: ShardSpec
    fp16_bytes: int


def _spread(items: list, k: int) -> list:
    if len(items) <= k:
        return list(items)
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)] if k > 1 else items[:1]


def pack_cases(cfg: NativeBenchConfig) -> tuple[LowRankCodec, list[Case], dict[str, Any]]:
    d = Path(cfg.pack_dir)  # type: ignore[arg-type]
    path = manifest_path(d, cfg.template) if cfg.template else d / "manifest.json"
    if not path.exists():
        cands = sorted(d.glob("*.manifest.json"))
        if not cands:
            raise EdgeError(f"no manifest in {d} (give --template or a pack directory)")
        path = cands[-1]
    m = Manifest.load(path)
    codec = m.make_codec()
    if not isinstance(codec, LowRankCodec):
        raise EdgeError(f"{path}: codec {m.codec!r} is not sakura/svd")
    cases = []
    with PackReader(d / m.pack_file) as r:
        for s in _spread(list(range(len(m.shards))), cfg.shards):
            spec = m.spec(s)
            fp16 = 2 * spec.num_matrices * spec.tokens * spec.channels
            for c in _spread(m.shards[s].configs, cfg.configs_per_shard):
                cases.append(Case(s, c.params, r.read_config(s, c.id), spec, fp16))
    return codec, cases, {"kind": "pack", "manifest": str(path), "template": m.template_id,
                          "geometry": m.geometry if isinstance(m.geometry, dict) else None}


def synthetic_cases(cfg: NativeBenchConfig) -> tuple[LowRankCodec, list[Case], dict[str, Any]]:
    """Shards of a synthetic cache at the shipped model's geometry (204 tokens x 192
    channels, 6 heads, 4 blocks per shard), keys in a model-style RoPE frame."""
    cache = synthetic_cache(steps=2, blocks=4, grid=16, channels=192, heads=6, rank=24,
                            mask_ratio=0.2, seed=0)
    n = cache.tokens
    side = 16
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    pos = torch.stack([torch.zeros(side * side), ys.flatten() + 0.5, xs.flatten() + 0.5], 1)
    rope = rope_option(pos[:n], (8, 12, 12), 10000.0, 6)
    codec = get_codec("sakura", rope=rope)
    layout = ShardLayout(cache.steps, cache.blocks, 4)
    cases = []
    for s in _spread(list(range(layout.num_shards)), cfg.shards):
        sd = shard_data(cache, layout, s)
        enc = codec.encode_shard(sd)
        fp16 = 2 * sd.spec.num_matrices * n * cache.channels
        for i in _spread(list(range(len(enc.configs))), cfg.configs_per_shard):
            cases.append(Case(s, enc.configs[i].params, enc.config_data(i), sd.spec, fp16))
    return codec, cases, {"kind": "synthetic", "tokens": n, "channels": cache.channels,
                          "matrices_per_shard": 8, "rope": True}


def run(cfg: NativeBenchConfig) -> dict[str, Any]:
    st = codec_native.status()
    if not st.enabled:
        raise EdgeError(f"sakura bench native needs the native module: {st.reason}")
    native = codec_native.module()
    assert native is not None
    torch.set_num_threads(1)
    codec, cases, workload = (pack_cases if cfg.pack_dir else synthetic_cases)(cfg)
    py_t = nat_t = mt_t = 0.0
    fp16_total = 0
    equal = tensors = 0
    max_diff = 0.0
    rows = []
    for case in cases:
        def decode(use_native: bool, threads: int = 1, c: Case = case) -> list[torch.Tensor]:
            codec.use_native, codec.native_threads = use_native, threads
            return codec.decode(c.params, c.data, c.spec)

        try:
            ref, out = decode(False), decode(True)
        finally:
            codec.use_native, codec.native_threads = True, 1
        tensors += len(ref)
        equal += sum(bool(torch.equal(a, b)) for a, b in zip(ref, out))
        max_diff = max(max_diff, max(float((a - b).abs().max()) for a, b in zip(ref, out)))
        tp = median_time(lambda: decode(False), cfg.repeats)
        tn = median_time(lambda: decode(True), cfg.repeats)
        tm = median_time(lambda: decode(True, cfg.threads), cfg.repeats)
        codec.use_native, codec.native_threads = True, 1
        py_t, nat_t, mt_t = py_t + tp, nat_t + tn, mt_t + tm
        fp16_total += case.fp16_bytes
        rows.append({"shard": case.shard, "ranks": case.params.get("ranks"),
                     "bytes": len(case.data), "python_ms": tp * 1e3, "native_ms": tn * 1e3,
                     f"native_{cfg.threads}t_ms": tm * 1e3, "speedup": tp / tn})
    out: dict[str, Any] = {
        "workload": workload,
        "configs": len(cases),
        "python_gbps": fp16_total / py_t / 1e9,
        "native_gbps": fp16_total / nat_t / 1e9,
        f"native_{cfg.threads}t_gbps": fp16_total / mt_t / 1e9,
        "native_speedup": py_t / nat_t,
        f"native_{cfg.threads}t_speedup": py_t / mt_t,
        "speedup_min": min(r["speedup"] for r in rows),
        "speedup_target": 2.0,
        "bit_equal_tensors": equal,
        "tensors": tensors,
        "max_abs_diff": max_diff,
        "pipeline": pipeline_overhead(native, codec, cases, cfg),
        "kernel": st.kernel,
        "threads_each_side": 1,
        "per_config": rows,
        "machine": _machine(),
    }
    return out


def pipeline_overhead(native: Any, codec: LowRankCodec, cases: list[Case],
                      cfg: NativeBenchConfig) -> dict[str, Any]:
    """Microseconds per shard of no-op pipelines, and the native pipeline over real shards."""
    s = native.pipeline_overhead(cfg.pipeline_shards)
    n_py = max(1, cfg.pipeline_shards // 4)
    t0 = time.perf_counter()
    p = native.Pipeline(2, 2).run(n_py, lambda i: i, lambda i, x: None,
                                  reconstruct=lambda i, x: x)
    py_wall = time.perf_counter() - t0
    # the native pipeline on the sampled configs (same geometry and RoPE frame), repeated
    same = [c for c in cases if c.spec.tokens == cases[0].spec.tokens]
    rope = rope_table(codec, same[0].spec)
    reps = 10
    t0 = time.perf_counter()
    stats = native.Pipeline(2, 2).run(
        reps * len(same), lambda i: (same[i % len(same)].data, same[i % len(same)].params["ranks"]),
        lambda i, x: None, rope=rope)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(reps * len(same)):
        c = same[i % len(same)]
        native.decode(c.data, c.params["ranks"], rope, 1)
    seq = time.perf_counter() - t0
    return {
        "noop_native_us_per_shard": s.wall_s * 1e6 / max(1, s.executed),
        "noop_python_callables_us_per_shard": py_wall * 1e6 / max(1, p.executed),
        "native_decode_pipeline_ms_per_shard": wall * 1e3 / stats.executed,
        "native_decode_sequential_ms_per_shard": seq * 1e3 / stats.executed,
        "max_received_depth": stats.max_received_depth,
        "max_ready_depth": stats.max_ready_depth,
        "shards": stats.executed,
    }


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "machine": platform.machine(), "python": platform.python_version()}


def export_shards(cfg: NativeBenchConfig, out: Path) -> dict[str, Any]:
    """Write the sampled configurations for the standalone ``sakura-native run DIR``: shard
    bytes, the RoPE table and the Python decoder's tensors (float32) as the expected output."""
    codec, cases, workload = (pack_cases if cfg.pack_dir else synthetic_cases)(cfg)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# sakura-native shards v1"]
    table = rope_table(codec, cases[0].spec)
    if table is not None:
        table.tofile(out / "rope.f32")
        lines.append("rope rope.f32")
    codec.use_native = False
    try:
        for i, c in enumerate(cases):
            (out / f"shard{i:03d}.bin").write_bytes(c.data)
            ref = torch.stack(codec.decode(c.params, c.data, c.spec)).numpy()
            ref.astype(np.float32).tofile(out / f"expected{i:03d}.f32")
            ranks = ",".join(str(r) for r in c.params["ranks"])
            lines.append(f"shard shard{i:03d}.bin {ranks} expected{i:03d}.f32")
    finally:
        codec.use_native = True
    (out / "shards.txt").write_text("\n".join(lines) + "\n")
    return {"dir": str(out), "shards": len(cases), "workload": workload}


def rope_table(codec: LowRankCodec, spec: ShardSpec) -> np.ndarray | None:
    """The keys' RoPE table ``[N, C/2, 2]`` float32 the native decoder takes, or None."""
    if codec.opts.rope is None:
        return None
    return np.ascontiguousarray(torch.view_as_real(codec._phasors(spec, torch.float32)).numpy())


def write_json(result: dict[str, Any], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1) + "\n")

