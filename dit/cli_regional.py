"""``sakura bench flashdiff``: FlashDiff regional execution and the cloud render engine.

The bench spans ``dit`` (quality) and ``cloud`` (the render engine's serving measurement).
Its implementation lives in ``cloud.render_bench`` and is imported only when the command
runs, so importing ``dit`` never pulls in ``cloud`` (the package layering stays one-way).
"""

from __future__ import annotations

import argparse


def _bench_flashdiff(args: argparse.Namespace) -> int:
    from cloud.render_bench import main

    return main(args.json, args.quick, args.weights, args.workers, args.requests,
                serve=not args.no_serve)


def register(commands, bench) -> None:
    b = bench.add_parser(
        "flashdiff",
        help="regional execution vs full / uniform steps / naive patches; render engine load",
        description="Quality of FlashDiff regional execution on the evaluation prompts and "
                    "throughput / p90 latency of the render engine under a bursty load.")
    b.add_argument("--json", metavar="PATH", help="write the result JSON here")
    b.add_argument("--quick", action="store_true", help="2 prompts, 10 steps, 6 requests")
    b.add_argument("--weights", help="model weights (default: the shipped model)")
    b.add_argument("--workers", type=int, default=2, help="render worker processes (default 2)")
    b.add_argument("--requests", type=int, help="requests in the arrival trace")
    b.add_argument("--no-serve", action="store_true", help="skip the render-engine part")
    b.set_defaults(func=_bench_flashdiff)
