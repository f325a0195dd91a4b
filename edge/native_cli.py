"""``sakura bench native``: native (C++) vs Python reconstruction, pipeline overhead.

``sakura bench native --json PATH [--pack DIR [--template ID]] [--shards N] [--threads T]``
writes the JSON described in :mod:`edge.native_bench`; ``--export DIR`` instead writes the
sampled shards for the standalone ``sakura-native run DIR`` (``native/README.md``).
Imports are lazy so ``sakura --help`` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sakura.argtypes import json_out, positive_int
from sakura.errors import UsageError


def register(commands: Any, bench: Any) -> None:
    p = bench.add_parser(
        "native", help="native (C++) vs Python sakura reconstruction and pipeline overhead",
        description="Decode every configuration of a sample of shards with the Python and "
                    "the native decoder (1 thread each, and native with --threads), check "
                    "they agree, and time a pipeline of no-op stages.")
    json_out(p, required=False)
    p.add_argument("--pack", metavar="DIR", help="a sakura/svd pack directory (default: a "
                   "synthetic cache at the shipped model's geometry)")
    p.add_argument("--template", metavar="ID", help="template id of the pack's manifest")
    p.add_argument("--shards", type=positive_int, default=6, metavar="N",
                   help="shards sampled (default 6)")
    p.add_argument("--configs", type=positive_int, default=8, metavar="N",
                   help="configs per shard (default 8)")
    p.add_argument("--repeats", type=positive_int, default=15, metavar="N",
                   help="timings per config (median; default 15)")
    p.add_argument("--threads", type=positive_int, default=2, metavar="N",
                   help="threads of the native multi-thread figure (default 2)")
    p.add_argument("--export", metavar="DIR",
                   help="write the sampled shards for `sakura-native run DIR` instead")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    if not (args.json or args.export):
        raise UsageError("give --json PATH (or --export DIR)")
    from sakura.edge.native_bench import (  # lazy: torch
        NativeBenchConfig,
        export_shards,
        run,
        write_json,
    )

    cfg = NativeBenchConfig(pack_dir=Path(args.pack) if args.pack else None,
                            template=args.template, shards=args.shards,
                            configs_per_shard=args.configs, repeats=args.repeats,
                            threads=args.threads)
    if args.export:
        info = export_shards(cfg, Path(args.export))
        print(f"wrote {info['shards']} shards to {info['dir']}")
        return 0
    res = run(cfg)
    write_json(res, args.json)
    pipe = res["pipeline"]
    t = args.threads
    print(f"native {res['native_gbps']:.3f} GB/s ({t} threads {res[f'native_{t}t_gbps']:.3f}) "
          f"vs python {res['python_gbps']:.3f} GB/s: speedup x{res['native_speedup']:.2f} "
          f"(min x{res['speedup_min']:.2f}); bit-equal {res['bit_equal_tensors']}/"
          f"{res['tensors']}; no-op pipeline {pipe['noop_native_us_per_shard']:.1f} us/shard "
          f"(python stages {pipe['noop_python_callables_us_per_shard']:.1f})")
    return 0
