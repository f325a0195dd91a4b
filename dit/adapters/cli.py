"""`sakura bench adapters`: the adapters' command (registered by ``sakura.cli``)."""

from __future__ import annotations

import argparse


def _bench_adapters(args: argparse.Namespace) -> int:
    from sakura.dit.adapters.bench import main

    return main(args.json, args.quick, args.models)


def register(commands, bench) -> None:
    b = bench.add_parser(
        "adapters",
        help="diffusers adapters: exactness, masked speed-up, reference/prefix KV, cache geometry")
    b.add_argument("--json", metavar="PATH", help="write the result JSON here")
    b.add_argument("--quick", action="store_true", help="test-size models, 4 steps, 1 repeat")
    b.add_argument("--models", metavar="LIST",
                   help="comma-separated subset of flux2,sd3.5,qwenimage,qwenimage-2.1")
    b.set_defaults(func=_bench_adapters)
