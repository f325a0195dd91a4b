"""``sakura bench backends --json PATH``: torch vs ExecuTorch vs QNN HTP on shard graphs;
``sakura bench dynamic --json PATH``: one dynamic-shape ExecuTorch graph vs the static ones."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sakura.codec import DEFAULT_BLOCKS_PER_SHARD
from sakura.dit.cli import check_file, check_template
from sakura.edge.backends import BACKENDS as NAMES
from sakura.edge.backends.errors import BackendError
from sakura.edge.cli import BACKEND_MODULES

from sakura.argtypes import json_out, positive_int
from sakura.extras import require
from sakura.output import write_json


def register(commands: Any, bench: Any) -> None:
    b = bench.add_parser(
        "backends", help="shard latency, error vs torch, compile vs cached load per backend",
        description="Compile the shard graphs of one catalog template for every backend, "
                    "time them, compare their outputs and a whole edit with torch.")
    json_out(b)
    b.add_argument("--template", metavar="ID", help="catalog template (default: the first)")
    b.add_argument("--backends", nargs="+", choices=NAMES, default=list(NAMES),
                   metavar="B", help=f"backends (default all: {', '.join(NAMES)})")
    b.add_argument("--weights", metavar="FILE", help="model weights (default: the shipped model)")
    b.add_argument("--blocks-per-shard", type=positive_int, default=DEFAULT_BLOCKS_PER_SHARD, metavar="N",
                   help="blocks per shard graph (default %(default)s, as sakura build)")
    b.add_argument("--repeats", type=positive_int, default=5, metavar="N",
                   help="timed runs per shard (median; default 5)")
    b.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="torch threads (default 1)")
    b.add_argument("--phone", action=argparse.BooleanOptionalAction, default=True,
                   help="also the arm64 build under qemu and the OpenCL reconstruction "
                        "(default on)")
    b.add_argument("--quantized", nargs="*", choices=("w8a16", "w8a8"), default=["w8a16"],
                   metavar="SCHEME", help="QDQ schemes on the HTP simulator (default w8a16; "
                   "none: --quantized with no scheme)")
    b.add_argument("--calibration-prompts", type=positive_int, default=2, metavar="N",
                   help="profiling prompts whose edits calibrate the quantized graphs "
                        "(default 2)")
    b.set_defaults(func=_bench)

    d = bench.add_parser(
        "dynamic", help="one dynamic-shape ExecuTorch graph vs the static graphs",
        description="Compile the shard and step graphs of one catalog template static and "
                    "with dynamic M/U, time both interleaved, compare both with torch, and "
                    "run the dynamic graphs at every catalog template's geometry.")
    json_out(d)
    d.add_argument("--template", metavar="ID", default="face-technologist",
                   help="catalog template (default face-technologist)")
    d.add_argument("--weights", metavar="FILE", help="model weights (default: the shipped model)")
    d.add_argument("--blocks-per-shard", type=positive_int, default=DEFAULT_BLOCKS_PER_SHARD, metavar="N",
                   help="blocks per shard graph (default %(default)s, as sakura build)")
    d.add_argument("--repeats", type=positive_int, default=20, metavar="N",
                   help="timed runs per graph (median; default 20)")
    d.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="ExecuTorch and torch threads (default 1)")
    d.set_defaults(func=_bench_dynamic)


def _bench_dynamic(args: argparse.Namespace) -> int:
    check_template(args.template)
    check_file(args.weights, "--weights")
    require(*BACKEND_MODULES["executorch"], what="the executorch backend")
    from sakura.dit.editing import Geometry  # lazy: torch
    from sakura.dit.templates import load_catalog  # lazy: torch
    from sakura.dit.text import TextEncoder  # lazy: torch
    from sakura.dit.weights import DEFAULT_WEIGHTS, load_model  # lazy: torch
    from sakura.edge.backends.dynamic_bench import bench_dynamic  # lazy: torch
    from sakura.edge.backends.executor import edit_geometry  # lazy: torch

    model = load_model(Path(args.weights) if args.weights else DEFAULT_WEIGHTS)
    catalog = load_catalog()
    if args.template not in catalog:
        raise BackendError(f"template {args.template!r} is not in the catalog "
                           f"(known: {', '.join(catalog)})")
    encoder = TextEncoder(model.cfg.text_tokens)
    others = {}
    for tid, spec in catalog.items():
        t = spec.to_template(encoder)
        others[tid] = edit_geometry(model, t, Geometry.of(model, t), spec.requests(encoder)[0])
    spec = catalog[args.template]
    template = spec.to_template(encoder)
    doc = bench_dynamic(model, template, spec.requests(encoder)[0], others,
                        blocks_per_shard=args.blocks_per_shard, repeats=args.repeats,
                        threads=args.threads, template_id=args.template,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    doc["weights"] = str(args.weights or DEFAULT_WEIGHTS)
    write_json(args.json, doc, indent=1)
    for r in doc["shards"]:
        s, d = r["static"], r["dynamic"]
        print(f"blocks {r['blocks'][0]}-{r['blocks'][-1]}: latency static "
              f"{s['latency_s'] * 1e3:.2f} ms, dynamic {d['latency_s'] * 1e3:.2f} ms "
              f"(x{r['dynamic_over_static_latency']:.3f}); compile static "
              f"{s['compile_s']:.1f} s, dynamic {d['compile_s']:.1f} s; max abs err static "
              f"{s['max_abs_err']:.2e}, dynamic {d['max_abs_err']:.2e} (outputs up to "
              f"{r['max_abs_output']:.1f})")
    for tid, r in doc["other_geometries"].items():
        if r["in_bounds"]:
            print(f"{tid}: m={r['geometry']['img']} dynamic max abs err "
                  f"{r['max_abs_err']:.2e}")
    print(f"load average {doc['load_average_start']} -> {doc['load_average_end']}")
    print(f"wrote {args.json}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    check_template(args.template)
    check_file(args.weights, "--weights")
    for name in args.backends:
        if name in BACKEND_MODULES:
            require(*BACKEND_MODULES[name], what=f"the {name} backend")
    import torch
    from sakura.dit.templates import load_catalog  # lazy: torch
    from sakura.dit.text import TextEncoder  # lazy: torch
    from sakura.dit.weights import DEFAULT_WEIGHTS, load_model  # lazy: torch
    from sakura.edge.backends.bench import BackendBenchSpec, bench_backends, write  # lazy: torch

    if args.threads < 1 or args.repeats < 1:
        raise BackendError("--threads and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    model = load_model(Path(args.weights) if args.weights else DEFAULT_WEIGHTS)
    catalog = load_catalog()
    tid = args.template or next(iter(catalog))
    if tid not in catalog:
        raise BackendError(f"template {tid!r} is not in the catalog "
                           f"(known: {', '.join(catalog)})")
    spec_t = catalog[tid]
    encoder = TextEncoder(model.cfg.text_tokens)
    template = spec_t.to_template(encoder)
    req = spec_t.requests(encoder)[0]
    profiling = spec_t.requests(encoder, "profiling")[: args.calibration_prompts]
    spec = BackendBenchSpec(backends=tuple(args.backends),
                            blocks_per_shard=args.blocks_per_shard, repeats=args.repeats,
                            log=lambda m: print(m, file=sys.stderr, flush=True),
                            phone=args.phone, quantized=tuple(args.quantized),
                            calibration_requests=profiling)
    doc = bench_backends(model, template, req, spec, template_id=tid)
    doc["weights"] = str(args.weights or DEFAULT_WEIGHTS)
    write(doc, Path(args.json))
    for name, r in doc["backends"].items():
        print(f"{name:11s} step {r['step_latency_s'] * 1e3:8.2f} ms  shard err "
              f"{r['max_abs_err']:.2e}  edit PSNR {r['edit_psnr_db']}  compile "
              f"{r['compile_total_s']:.2f} s  cached load {r['cached_load_total_s']:.3f} s")
    for key in ("xnnpack_delegated_ops_fraction", "qnn_cpu_fallback_nodes", "arm64",
                "opencl", "qnn_quantized"):
        if key in doc:
            value = doc[key]
            if isinstance(value, dict):
                value = {k: v for k, v in value.items() if not isinstance(v, (dict, list))}
            print(f"{key}: {value}")
    print(f"wrote {args.json}")
    return 0
