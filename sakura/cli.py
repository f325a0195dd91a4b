"""The `sakura` command: a thin argparse layer whose subcommands live in the packages.

Each package that owns commands exposes ``register(commands, bench)`` in its ``cli`` module:
``commands`` is the top-level subparsers object and ``bench`` the subparsers of
``sakura bench``. A subcommand sets ``func`` (taking the parsed namespace, returning an exit
code). No logic lives here.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from sakura.errors import SakuraError

COMMAND_MODULES = (
    "sakura.dit.cli", "sakura.dit.adapters.cli", "sakura.codec.cli", "sakura.traces.cli", "sakura.cloud.cli", "sakura.cloud.render_cli",
    "sakura.edge.cli", "sakura.edge.replay.cli", "sakura.edge.backends.cli", "sakura.edge.native_cli", "sakura.demo",
)

# executorch depends on torchao, which transformers imports whenever it is installed; on
# this CPU build torchao logs that its CUDA kernels do not load and torch logs a deprecated
# enum registration: warnings of no use to a user, printed on every command otherwise.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that prints the full usage of the failing (sub)command, exit 2."""

    def error(self, message: str) -> None:  # pragma: no cover - exercised via CLI tests
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sakura", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    bench_parser = commands.add_parser("bench", help="benchmarks that print/write JSON")
    bench = bench_parser.add_subparsers(dest="bench", metavar="BENCH", parser_class=_Parser)
    bench_parser.set_defaults(func=lambda args: _usage(bench_parser))
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # an optional command module that is not there; a missing dependency inside
            # one that *is* there still raises
            if exc.name is None or not name.startswith(exc.name):
                raise
            continue
        module.register(commands, bench)
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_usage(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        return _usage(parser)
    try:
        return int(args.func(args) or 0)
    except SakuraError as exc:
        print(f"sakura: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sakura: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
