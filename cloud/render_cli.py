"""``sakura render serve`` and ``sakura render replay``: the FlashDiff render engine.

``serve`` starts the worker pool and the HTTP front (``cloud.render_http``) on uvicorn.
``replay`` submits an arrival trace (JSON lines / CSV, ``cloud.render_trace``) or a
seeded generated one, and prints latency and throughput.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _engine(args: argparse.Namespace):
    from sakura.cloud.render import EngineConfig, RenderEngine
    from sakura.dit.regional import RegionalConfig
    from sakura.dit.text import TextEncoder

    cfg = EngineConfig(workers=args.workers, weights=args.weights, priority=args.priority,
                       device=args.device,
                       regional=RegionalConfig(warmup=args.warmup, eps=args.eps,
                                               max_skips=args.max_skips))
    return RenderEngine(cfg, TextEncoder())


def _serve(args: argparse.Namespace) -> int:
    from sakura.cloud.render_http import create_render_app
    from sakura.cloud.runner import run

    with _engine(args) as engine:
        run(create_render_app(engine), args.host, args.port, log_level=args.log_level)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from sakura.cloud.render import RenderRequest
    from sakura.cloud.render_trace import (
        bursty_arrivals,
        load_trace,
        poisson_arrivals,
        replay,
        request_factory,
    )

    if args.trace:
        trace = load_trace(args.trace)
    else:
        prompts = args.prompt or ["smileys & emotion: grinning face"]
        gen = bursty_arrivals if args.arrivals == "bursty" else poisson_arrivals
        trace = gen(args.requests, args.rate, prompts, seed=args.seed)
    base = RenderRequest(steps=args.steps, size=args.size, mode=args.mode)
    with _engine(args) as engine:
        result = replay(engine, trace, request_factory(base))
        summary = result.summary()
        summary["engine"] = {k: v for k, v in engine.metrics().items() if k != "workers"}
    print(json.dumps(summary, indent=2))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--weights", help="model weights (default: the shipped model)")
    p.add_argument("--device", default="auto", help="auto (GPUs when present), cpu, cuda")
    p.add_argument("--priority", default="warmup_first", choices=["warmup_first", "fifo"])
    p.add_argument("--warmup", type=int, default=4, help="warm-up steps (default 4)")
    p.add_argument("--eps", type=float, default=1.0, help="gate threshold (default 1.0)")
    p.add_argument("--max-skips", type=int, default=3, help="forced run after K skips")


def _bench_flashdiff(args: argparse.Namespace) -> int:
    from sakura.cloud.render_bench import main

    return main(args.json, args.quick, args.weights, args.workers, args.requests,
                serve=not args.no_serve)


def register(commands: Any, bench: Any) -> None:
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

    render = commands.add_parser("render", help="FlashDiff cloud render engine")
    sub = render.add_subparsers(dest="render_command", metavar="ACTION")
    render.set_defaults(func=lambda args: (render.print_usage(), 2)[1])

    serve = sub.add_parser("serve", help="serve text-to-image renders over HTTP")
    _common(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=_serve)

    rep = sub.add_parser("replay", help="replay an arrival trace against the engine")
    _common(rep)
    rep.add_argument("trace", nargs="?", help="trace file (JSON lines or CSV t,prompt,seed)")
    rep.add_argument("--arrivals", default="bursty", choices=["bursty", "poisson"])
    rep.add_argument("--requests", type=int, default=8)
    rep.add_argument("--rate", type=float, default=1.0, help="requests per second")
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--prompt", action="append", help="prompt(s) of a generated trace")
    rep.add_argument("--steps", type=int, default=20)
    rep.add_argument("--size", type=int, default=64)
    rep.add_argument("--mode", default="regional", choices=["regional", "separate", "full", "naive"])
    rep.set_defaults(func=_replay)
