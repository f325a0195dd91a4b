"""``sakura replay CONFIG --out DIR`` and ``sakura report DIR [--json PATH]``.

Imports are lazy: registering the commands costs nothing at ``sakura --help``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sakura.dit.cli import check_file
from sakura.edge.cli import _set_threads, runtime_arg, startup_fraction

from sakura.argtypes import json_out, nonnegative_float, positive_int
from sakura.output import write_json


def register(commands: Any, bench: Any) -> None:
    r = commands.add_parser(
        "replay", help="every system over real traces and many start points (resumable)",
        description="Replay real 5G / LTE / mixed / Wi-Fi traces against every policy: real "
                    "compute, real HTTP over an emulated link, regime-matched (or the phone "
                    "profile). Results append to DIR/runs.jsonl; a rerun skips finished runs.")
    r.add_argument("config", nargs="?", metavar="CONFIG",
                   help="YAML config (default: the shipped edge/replay/configs/default.yaml)")
    r.add_argument("--out", required=True, metavar="DIR",
                   help="results folder (runs.jsonl; a rerun resumes)")
    r.add_argument("--quick", action="store_true",
                   help="a small run: 1 template per workload, 2 networks, 3 start points")
    r.add_argument("--starts", type=positive_int, metavar="N", help="start points per network")
    r.add_argument("--regime", choices=("matched", "profile"),
                   help="regime-matched replay or the phone device profile")
    r.add_argument("--link", choices=("paced", "kernel"), help="link emulation")
    r.add_argument("--loss", type=float, metavar="P",
                   help="packet loss rate in [0, 0.5) each way (the config's loss): dropped "
                        "for real by nftables on --link kernel, modelled as retransmission "
                        "delay on the paced link")
    r.add_argument("--startup-fraction", type=startup_fraction, metavar="F",
                   help="startup allowance of the streamed edits (0 to 1; the config's "
                        "startup_fraction)")
    runtime_arg(r, python_needs=" (the config's runtime, default native)")
    r.add_argument("--packs-dir", metavar="DIR", help="where packs are built and kept")
    r.add_argument("--weights", metavar="FILE", help="model weights (default: the shipped model)")
    r.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="torch threads of the device (default 1)")
    r.add_argument("--max-load", type=nonnegative_float, metavar="L",
                   help="timed runs wait for the 1-minute load average to be at most L, and "
                        "one ending above it is taken again (the config's max_load, default "
                        "1.5; 0: no gate)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--report", action="store_true", help="write the report when done")
    r.set_defaults(func=_replay)

    t = bench.add_parser(
        "tail", help="the tail: kernel-shaped link, real loss 0/1/3%%, repeated edits (root)",
        description="Every policy over the kernel-shaped link (network namespaces, tc, "
                    "nftables: run as root) at loss 0, 0.01 and 0.03 on 3 templates x 14 "
                    "starts, then repeated edits without a prior; writes the tail ratios, "
                    "PSNR, stalls, events and conditions (edge/replay/tail.py). Resumable: "
                    "results stay in --out.")
    json_out(t, help="write the bench document here (- for stdout)")
    t.add_argument("--out", default="out/bench-tail", metavar="DIR",
                   help="results folder (OUT/loss-<p>/runs.jsonl, OUT/packs; default "
                        "out/bench-tail)")
    t.add_argument("--quick", action="store_true",
                   help="3 start points per template on 5G and one mixed (every key kept)")
    t.add_argument("--starts", type=positive_int, metavar="N", help="5G start points")
    t.add_argument("--no-repeat", action="store_true", help="skip the repeated edits")
    t.add_argument("--rto-min", choices=("scaled", "kernel"), default="scaled",
                   help="the link's minimum TCP retransmission timeout: scaled like the "
                        "round trip (default; the targets are read so) or the kernel's "
                        "200 ms, for the comparison")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=_tail)

    p = commands.add_parser(
        "report", help="Markdown report with figures (and headline JSON) of a replay",
        description="Write DIR/report.md and DIR/figures/*.png from DIR/runs.jsonl; "
                    "--json PATH also writes the headline ratios and their targets.")
    p.add_argument("dir", metavar="DIR", help="a `sakura replay` results folder")
    json_out(p, help="write the headline ratios here (- for stdout)", required=False)
    p.add_argument("--out", metavar="DIR", help="write the report here (default: DIR)")
    p.set_defaults(func=_report)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _replay(args: argparse.Namespace) -> int:
    check_file(args.weights, "--weights")
    from sakura.edge.replay.config import load_config  # lazy: CLI --help stays fast
    from sakura.edge.replay.runner import run_replay  # lazy: CLI --help stays fast

    _set_threads(args.threads)
    cfg = load_config(args.config, quick=args.quick, starts=args.starts, regime=args.regime,
                      link=args.link, loss=args.loss, packs_dir=args.packs_dir,
                      weights=args.weights, startup_fraction=args.startup_fraction,
                      runtime=args.runtime, max_load=args.max_load)
    summary = run_replay(cfg, args.out, log=_log, progress=not args.no_progress)
    print(f"replay: {summary['ran']} runs done, {summary['skipped']} skipped (already in "
          f"{args.out}/runs.jsonl)")
    failed = summary.get("failed", [])
    if failed:
        print(f"sakura: error: {len(failed)} run(s) failed (each left a failure record, which "
              "the report names); rerun the same command to retry them", file=sys.stderr)
    if args.report:
        from sakura.edge.replay.report import write_report  # lazy: scipy

        path = write_report(args.out, json_path=None)
        print(f"wrote {path}")
    return 1 if failed else 0


def _tail(args: argparse.Namespace) -> int:
    from sakura.edge.replay.tail import run_tail  # lazy: scipy

    _set_threads(1)
    doc = run_tail(args.out, quick=args.quick, starts=args.starts, log=_log,
                   progress=not args.no_progress, repeat=not args.no_repeat,
                   rto_min=args.rto_min)
    write_json(args.json, doc)
    missed = [k for k, ok in doc["targets"].items() if ok is False]
    print(f"tail: {sum(doc['runs'].values())} runs; targets missed: "
          f"{', '.join(missed) if missed else 'none'}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from sakura.edge.replay.report import write_report  # lazy: scipy

    path = write_report(args.dir, json_path=args.json, out_dir=args.out)
    print(f"wrote {path}" + (f" and {args.json}" if args.json else ""))
    return 0
