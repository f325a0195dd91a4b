"""``sakura traces ...`` and ``sakura bench link``: thin argparse wrappers over the package.

- ``sakura traces stats PATH|SET... [--json PATH] [--window S] [--label L]``: statistics
  table of trace files, folders or named sets (``sakura traces list`` shows the sets).
- ``sakura traces list [--json PATH]``: the trace folder and its named sets.
- ``sakura traces mahimahi (PATH | --mixed SEED) --out FILE [--scale F] [--start S]
  [--duration S]``: a scaled or mixed trace as a Mahimahi ``mm-link`` file.
- ``sakura bench link [PATH...] [--json PATH] [--quick]``: emulator accuracy.

``--json PATH`` writes the machine-readable result to PATH (``-``: standard output).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sakura.traces.catalog import (
    TRACE_SETS,
    default_trace_dir,
    find_trace_files,
    mixed_trace,
    trace_set,
)
from sakura.traces.errors import TraceError
from sakura.traces.formats import load_trace, write_mahimahi

from sakura.argtypes import json_out, positive_float, seed
from sakura.output import write_json

_COLUMNS = (
    ("name", "trace", "{}"),
    ("format", "format", "{}"),
    ("duration_s", "dur_s", "{:.0f}"),
    ("mean_mbps", "mean", "{:.2f}"),
    ("median_mbps", "median", "{:.2f}"),
    ("p10_mbps", "p10", "{:.2f}"),
    ("p90_mbps", "p90", "{:.2f}"),
    ("outage_fraction", "outage", "{:.3f}"),
)


def register(commands: Any, bench: Any) -> None:
    """Add ``traces`` and ``bench link`` to the ``sakura`` parser."""
    traces_p = commands.add_parser("traces", help="real network traces: statistics and sets")
    sub = traces_p.add_subparsers(dest="traces_command", metavar="ACTION")
    traces_p.set_defaults(func=lambda args: _usage(traces_p))

    stats = sub.add_parser("stats", help="mean/median/p10/p90/outage of trace files or folders",
                           description="Statistics of trace files, folders (searched "
                                       "recursively) or named sets (see `sakura traces list`).")
    stats.add_argument("paths", nargs="+", metavar="PATH",
                       help="trace files, folders, or named sets such as 5g, lte, wifi")
    json_out(stats, help="write the rows as JSON here (- for stdout) instead of a table", required=False)
    stats.add_argument("--window", type=positive_float, default=1.0, metavar="S",
                       help="window in s (default 1)")
    stats.add_argument("--label", help="only slices with this network label (e.g. 5G)")
    stats.add_argument("--mahimahi-bin", type=positive_float, default=0.1, metavar="S",
                       help="Mahimahi bin in s (default 0.1)")
    stats.set_defaults(func=_cmd_stats)

    lst = sub.add_parser("list", help="where the traces are and the named sets")
    json_out(lst, help="write the folder and sets as JSON here (- for stdout)", required=False)
    lst.set_defaults(func=_cmd_list)

    mm = sub.add_parser("mahimahi", help="write a (scaled or mixed) trace as a Mahimahi "
                                         "mm-link packet-opportunity file")
    mm.add_argument("path", nargs="?", metavar="PATH", help="a trace file")
    mm.add_argument("--mixed", type=seed, metavar="SEED",
                    help="instead of PATH: the replay's mixed 4G+5G trace with this seed "
                         "(6 alternating 20-s Lumos 4G / 5G pieces)")
    mm.add_argument("--scale", type=float, default=1.0, help="multiply every rate (default 1)")
    mm.add_argument("--start", type=float, default=0.0, help="start in the trace, s")
    mm.add_argument("--duration", type=float, help="seconds to export (default: the trace)")
    mm.add_argument("--out", type=Path, required=True, metavar="FILE", help="output file")
    mm.set_defaults(func=_cmd_mahimahi)

    link = bench.add_parser("link", help="accuracy of the paced and kernel link emulators")
    link.add_argument(
        "paths", nargs="*", metavar="PATH", help="trace files or the trace folder (default)"
    )
    json_out(link, help="write the full JSON report here (- for stdout)", required=False)
    link.add_argument("--quick", action="store_true", help="3 traces, one window each")
    link.add_argument("--window", type=positive_float, default=2.0, metavar="S",
                      help="window in s (default 2)")
    link.add_argument("--seed", type=seed, default=0, metavar="N",
                      help="seed of the window starts, 0 to 2**63 - 1 (default 0)")
    link.add_argument("--max-mbps", type=positive_float, default=200.0, metavar="MBPS",
                      help="peak rate cap (default 200)")
    link.add_argument("--no-kernel", action="store_true", help="skip kernel shaping")
    link.set_defaults(func=_cmd_bench_link)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_usage(sys.stderr)
    return 2


def _expand_sets(items: list[str]) -> list[str | Path]:
    """Named sets (``5g``, ``lte``...) become their files; an existing path always wins."""
    out: list[str | Path] = []
    for item in items:
        if item in TRACE_SETS and not Path(item).exists():
            out.extend(trace_set(item))
        else:
            out.append(item)
    return out


def _cmd_stats(args: argparse.Namespace) -> int:
    files = find_trace_files(_expand_sets(args.paths))
    if not files:
        raise TraceError(f"no trace files under {' '.join(args.paths)}")
    rows = []
    for f in files:
        trace = load_trace(f, mahimahi_bin_s=args.mahimahi_bin)
        if args.label:
            if not trace.labels or args.label not in trace.labels:
                continue
            trace = trace.select(args.label)
        row = trace.stats(window_s=args.window)
        row["path"] = str(f)
        rows.append(row)
    if args.json:
        write_json(args.json, rows)
        return 0
    print(format_table(rows))
    return 0


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table of :meth:`Trace.stats` rows (Mbit/s)."""
    header = [h for _, h, _ in _COLUMNS]
    body = [[fmt.format(r[k]) for k, _, fmt in _COLUMNS] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    lines.append("(rates in Mbit/s over 1-s windows unless --window; outage = fraction at 0)")
    return "\n".join(lines)


def _cmd_list(args: argparse.Namespace) -> int:
    root = default_trace_dir()
    sets = {}
    if root is not None:
        sets = {name: len(list(root.glob(pat))) for name, pat in TRACE_SETS.items()}
    if args.json:
        write_json(args.json, {"root": str(root) if root else None, "sets": sets})
        return 0
    print(f"trace folder: {root if root else '(none: set SAKURA_TRACES)'}")
    for name, n in sets.items():
        print(f"  {name:14s} {n:4d} files  {TRACE_SETS[name]}")
    return 0


def _cmd_mahimahi(args: argparse.Namespace) -> int:
    if (args.path is None) == (args.mixed is None):
        raise TraceError("give a trace file or --mixed SEED (one of them)")
    if args.mixed is not None:
        lte = [load_trace(p) for p in trace_set("lte")]
        nr = [load_trace(p) for p in trace_set("5g")]
        trace = mixed_trace(lte, nr, seed=args.mixed, name=f"mixed-{args.mixed}")
    else:
        trace = load_trace(args.path)
    if args.scale != 1.0:
        trace = trace.scaled(args.scale)
    out = write_mahimahi(args.out, trace, args.start, args.duration)
    n = sum(1 for _ in out.open())
    dur = trace.duration_s if args.duration is None else args.duration
    print(f"wrote {out}: {n} packet opportunities over {dur:g} s "
          f"({n * 1500 * 8 / dur / 1e6:.2f} Mbit/s mean) from {trace.name} at {args.start:g} s; "
          f"as mm-link's downlink, with the default 30 ms RTT: mm-delay 15 mm-link UPLINK "
          f"{out.name}")
    return 0


def _cmd_bench_link(args: argparse.Namespace) -> int:
    from sakura.traces.bench import run_link_bench  # lazy: CLI --help stays fast

    report = run_link_bench(
        args.paths,
        quick=args.quick,
        window_s=args.window,
        seed=args.seed,
        max_mbps=args.max_mbps,
        kernel=not args.no_kernel,
    )
    if args.json:
        write_json(args.json, report)
    if args.json != "-":
        fmt = lambda v: "n/a" if v is None else f"{100 * v:.2f}%"  # noqa: E731
        print(f"paced link:  max window error {fmt(report['paced_rel_error'])}")
        skipped = report["kernel_skipped"]
        print(
            f"kernel link: max window error {fmt(report['kernel_rel_error'])}"
            + (f" (skipped: {skipped})" if skipped else "")
        )
    return 0
