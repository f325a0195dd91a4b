"""The shipped model through ``sakura-edge`` and through the Python runtime (issue 31 item 2).

A thin wrapper over :func:`sakura.edge.sakura_edge_bench.x86_figures` (the ``x86`` key of
``sakura bench phone``): one template of the shipped catalog with its device bundle, served
by ``sakura serve`` on loopback; the same edits (fixed configurations) by the binary and by
``EdgeRuntime(runtime="native")`` (``sakura edit --runtime native``). Prints and writes
``{max_abs_err per configuration, latency per run, ratio}``.

    python scripts/sakura_edge_check.py [--exe native/build/sakura-edge/sakura-edge]
        [--template face-technologist] [--runs 3] [--json docs/bench/sakura-edge.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sakura.edge.sakura_edge_bench import X86_BUILD, build_x86, shipped_world, x86_figures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", default=None, help=f"default: built in {X86_BUILD}")
    ap.add_argument("--template", default="face-technologist")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    exe = Path(args.exe) if args.exe else build_x86()
    with shipped_world(args.template) as world:
        out = x86_figures(world, exe, runs=args.runs, seed=args.seed, log=print)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
