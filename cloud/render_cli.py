"""``sakura render serve`` and ``sakura render replay``: the FlashDiff render engine.

``serve`` binds its port, then starts the worker pool and the HTTP front
(``cloud.render_http``) on uvicorn. ``replay`` submits an arrival trace (JSON lines / CSV,
``cloud.render_trace``) or a seeded generated one, and prints latency and throughput
(``--json PATH``: the summary as JSON).
"""

from __future__ import annotations

import argparse
from typing import Any

from sakura.cloud.cli import listen

from sakura.argtypes import (
    SEED_LIMIT,
    json_out,
    nonnegative_float,
    nonnegative_int,
    port,
    positive_float,
    positive_int,
    seed_below,
)
from sakura.errors import SakuraError
from sakura.output import write_json


def _engine(args: argparse.Namespace):
    from sakura.cloud.render import RenderEngine  # lazy: torch
    from sakura.cloud.render_api import EngineConfig  # lazy: torch
    from sakura.dit.regional import RegionalConfig  # lazy: torch
    from sakura.dit.text import TextEncoder  # lazy: torch

    pool = "ray" if args.ray else args.pool
    cfg = EngineConfig(workers=args.workers, weights=args.weights, priority=args.priority,
                       pool=pool, ray_address=args.ray,
                       device=args.device, preempt=args.preempt,
                       quality_eps=None if args.no_quality_mode else 0.0,
                       patch_search=args.patches is None, patch_split=args.patch_split,
                       regional=RegionalConfig(warmup=args.warmup, eps=args.eps,
                                               max_skips=args.max_skips, gate=args.gate,
                                               partition=args.partition,
                                               patches=args.patches))
    return RenderEngine(cfg, TextEncoder())


def _serve(args: argparse.Namespace) -> int:
    _check_weights(args)
    sock = listen(args.host, args.port)  # before the workers start: a port in use costs nothing
    fd = sock.detach()
    from sakura.cloud.render_http import create_render_app  # lazy: torch
    from sakura.cloud.runner import run  # lazy: web stack

    with _engine(args) as engine:
        run(create_render_app(engine), args.host, args.port, fd=fd, log_level=args.log_level)
    return 0


def _check_weights(args: argparse.Namespace) -> None:
    from pathlib import Path

    if args.weights and not Path(args.weights).is_file():
        raise SakuraError(f"--weights: no such file: {args.weights}")


def _replay(args: argparse.Namespace) -> int:
    from sakura.cloud.render_api import RenderRequest  # lazy: torch
    from sakura.cloud.render_trace import (  # lazy: torch
        bursty_arrivals,
        load_trace,
        poisson_arrivals,
        replay,
        request_factory,
    )

    _check_weights(args)
    if args.trace:
        trace = load_trace(args.trace)
    else:
        prompts = args.prompt or ["smileys & emotion: grinning face"]
        gen = bursty_arrivals if args.arrivals == "bursty" else poisson_arrivals
        trace = gen(args.requests, args.rate, prompts, seed=args.seed)
    base = RenderRequest(steps=args.steps, size=args.size, mode=args.mode,
                         priority=args.request_priority)
    with _engine(args) as engine:
        result = replay(engine, trace, request_factory(base))
        summary = result.summary()
        summary["engine"] = {k: v for k, v in engine.metrics().items() if k != "workers"}
    if args.json:
        write_json(args.json, summary)
    print(f"render replay: {summary['requests']} requests in {summary['makespan_s']:.2f} s "
          f"({summary['throughput_rps']:.2f} req/s), latency p50 "
          f"{summary['p50_latency_s']:.2f} s p90 {summary['p90_latency_s']:.2f} s p99 "
          f"{summary['p99_latency_s']:.2f} s, {100 * summary['skipped_fraction']:.0f}% of "
          "patch-steps skipped")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=positive_int, default=2, metavar="N",
                   help="worker processes (default 2)")
    p.add_argument("--weights", metavar="FILE", help="model weights (default: the shipped model)")
    p.add_argument("--device", default="auto", help="auto (GPUs when present), cpu, cuda")
    p.add_argument("--pool", default="process", choices=["process", "ray"],
                   help="workers as spawned processes (default) or Ray actors on a local Ray "
                        "the engine starts (needs the [ray] extra)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379; implies --pool ray): "
                        "the workers are actors spread over its nodes")
    p.add_argument("--priority", default="warmup_first", choices=["warmup_first", "fifo"],
                   help="monotask order within a priority class (default warmup_first)")
    p.add_argument("--preempt", default="benefit", choices=["benefit", "strict"],
                   help="preemption across priority classes at step boundaries (default: "
                        "benefit vs switch cost)")
    p.add_argument("--warmup", type=nonnegative_int, default=4, metavar="N",
                   help="warm-up steps (default 4)")
    p.add_argument("--gate", default="paper", choices=["paper", "importance", "drift", "periodic"],
                   help="patch gate (default paper: frozen changes over their sum, at least "
                        "one patch per step; importance: the earlier default)")
    p.add_argument("--partition", default="grid", choices=["grid", "otsu", "cuts"],
                   help="patch partition (default grid, which beats otsu, the paper's "
                        "focus/context split, at equal compute: dit/REGIONAL.md)")
    p.add_argument("--eps", type=nonnegative_float, default=None,
                   help="gate threshold (default 0.22 for paper, 0.01 for importance, 1.0 for drift)")
    p.add_argument("--max-skips", type=nonnegative_int, default=3, metavar="K",
                   help="forced run after K skips (default 3)")
    p.add_argument("--patches", type=positive_int, default=None, metavar="R",
                   help="fixed patch count (default: searched online)")
    p.add_argument("--no-quality-mode", action="store_true",
                   help="keep gating under low load (default: every patch runs then)")
    p.add_argument("--patch-split", type=positive_int, default=1, metavar="N",
                   help="patch parallelism: while fewer requests are open than workers, "
                        "cut a step's active patches into up to N gangs that may run on "
                        "different workers (default 1: one worker per step)")


def _bench_flashdiff(args: argparse.Namespace) -> int:
    _check_weights(args)
    from sakura.cloud.render_api import EngineConfig, size_problem  # lazy: torch
    from sakura.dit.model import MMDiTConfig  # lazy: torch

    problem = size_problem(args.serve_size, MMDiTConfig.patch_size, EngineConfig.max_size)
    if problem:
        raise SakuraError(f"--serve-size: {problem}")
    from sakura.cloud.render_bench import main  # lazy: torch

    return main(args.json, args.quick, args.weights, args.workers, args.requests,
                serve=not args.no_serve, serve_size=args.serve_size)


def register(commands: Any, bench: Any) -> None:
    b = bench.add_parser(
        "flashdiff",
        help="regional execution vs full / uniform steps / naive patches; render engine load",
        description="Quality of FlashDiff regional execution on the evaluation prompts and "
                    "throughput / p90 latency of the render engine under a bursty load.")
    json_out(b, help="write the result JSON here (- for stdout)", required=False)
    b.add_argument("--quick", action="store_true", help="2 prompts, 10 steps, 8 requests")
    b.add_argument("--weights", metavar="FILE", help="model weights (default: the shipped model)")
    b.add_argument("--workers", type=positive_int, default=2, metavar="N",
                   help="render worker processes (default 2)")
    b.add_argument("--requests", type=positive_int, metavar="N",
                   help="requests in the arrival trace")
    b.add_argument("--no-serve", action="store_true", help="skip the render-engine part")
    b.add_argument("--serve-size", type=positive_int, default=128, metavar="PX",
                   help="image size of the serving replays (default 128; the quality runs "
                        "use 64, and the replays are repeated there)")
    b.set_defaults(func=_bench_flashdiff)

    render = commands.add_parser("render", help="FlashDiff cloud render engine",
                                 description="The FlashDiff cloud render engine.")
    sub = render.add_subparsers(dest="render_command", metavar="ACTION")

    serve = sub.add_parser("serve", help="serve text-to-image renders over HTTP")
    _common(serve)
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8100,
                       help="listen port, 0 for any free one (default 8100)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn log level (default info)")
    serve.set_defaults(func=_serve)

    rep = sub.add_parser("replay", help="replay an arrival trace against the engine")
    _common(rep)
    rep.add_argument("trace", nargs="?", help="trace file (JSON lines or CSV t,prompt,seed)")
    rep.add_argument("--arrivals", default="bursty", choices=["bursty", "poisson"],
                     help="arrival process of a generated trace (default bursty)")
    rep.add_argument("--requests", type=positive_int, default=8, metavar="N",
                     help="requests of a generated trace (default 8)")
    rep.add_argument("--rate", type=positive_float, default=1.0,
                     help="requests per second of a generated trace (default 1)")
    # a generated trace's requests have seeds seed * 1000 + i (cloud.render_trace)
    rep.add_argument("--seed", type=seed_below(SEED_LIMIT // 2000), default=0, metavar="N",
                     help=f"seed of a generated trace, 0 to {SEED_LIMIT // 2000 - 1} "
                          "(default 0)")
    rep.add_argument("--prompt", action="append", help="prompt(s) of a generated trace")
    rep.add_argument("--steps", type=positive_int, default=20, metavar="N",
                     help="denoising steps per request (default 20)")
    rep.add_argument("--size", type=positive_int, default=64, metavar="PX",
                     help="image size in pixels (default 64)")
    rep.add_argument("--mode", default="regional", choices=["regional", "separate", "full", "naive"],
                     help="execution mode (default regional)")
    rep.add_argument("--request-priority", default="normal", choices=["high", "normal", "low"],
                     help="priority class of the replayed requests (default normal)")
    json_out(rep, help="write the latency/throughput summary here (- for stdout)", required=False)
    rep.set_defaults(func=_replay)
