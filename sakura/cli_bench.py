"""`sakura bench cli`: how fast the front door opens.

Runs ``sakura --help`` and ``sakura X --help`` for every command (each in a fresh process,
``--repeats`` times) and writes the median and worst wall time and the median CPU time
(user + system of the child) per command, with the load average before and after, to
``--json PATH``. The target: every one under 1.5 s of wall time on the 2-core machine. The
CPU time is the figure that does not move with other work on the machine; the wall time
does (state the load with it).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from sakura.argtypes import json_path, positive_int
from sakura.cli import build_parser
from sakura.errors import UsageError
from sakura.output import write_json

TARGET_WALL_S = 1.5


def register(commands: Any, bench: Any) -> None:
    b = bench.add_parser(
        "cli", help="start-up time of sakura --help and of every sakura X --help",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    b.add_argument("--json", type=json_path, required=True, metavar="PATH",
                   help="write the timings here (- for stdout)")
    b.add_argument("--repeats", type=positive_int, default=5, metavar="N",
                   help="fresh processes per command (default 5)")
    b.add_argument("--commands", metavar="LIST",
                   help="comma-separated commands to time, e.g. 'build,bench kv' (default: "
                        "sakura itself and every command)")
    b.set_defaults(func=_bench)


def command_paths() -> list[str]:
    """``""`` (sakura itself) and every command and subcommand, e.g. ``"bench kv"``."""
    paths: list[str] = []

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> None:
        paths.append(" ".join(prefix))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*prefix, name))

    walk(build_parser(), ())
    return paths


def time_help(path: str, repeats: int) -> dict[str, float]:
    """Wall and CPU seconds of ``sakura PATH --help`` in fresh processes."""
    wall, cpu = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sakura.cli", *path.split(), "--help"],
                       check=True, stdout=subprocess.DEVNULL)
        wall.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return {"wall_s_median": statistics.median(wall), "wall_s_max": max(wall),
            "cpu_s_median": statistics.median(cpu)}


def _bench(args: argparse.Namespace) -> int:
    every = command_paths()
    paths = every
    if args.commands is not None:
        paths = [c.strip() for c in args.commands.split(",")]
        unknown = [c for c in paths if c not in every]
        if unknown:
            raise UsageError(f"--commands: unknown command(s) {', '.join(unknown)}")
    load_before = os.getloadavg()
    timings = {p or "sakura": time_help(p, args.repeats) for p in paths}
    load_after = os.getloadavg()
    worst = max(timings, key=lambda k: timings[k]["wall_s_median"])
    doc = {
        "commands": timings, "repeats": args.repeats, "target_wall_s": TARGET_WALL_S,
        "max_wall_s_median": timings[worst]["wall_s_median"], "slowest": worst,
        "max_cpu_s_median": max(t["cpu_s_median"] for t in timings.values()),
        "all_under_target": all(t["wall_s_median"] < TARGET_WALL_S for t in timings.values()),
        "loadavg_before": list(load_before), "loadavg_after": list(load_after),
        "cpus": os.cpu_count(), "python": platform.python_version(),
    }
    write_json(args.json, doc)
    print(f"sakura bench cli: {len(timings)} commands, slowest {worst!r} "
          f"{doc['max_wall_s_median']:.2f} s wall (median of {args.repeats}), CPU at most "
          f"{doc['max_cpu_s_median']:.2f} s; load average {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f} on {os.cpu_count()} CPUs")
    return 0
