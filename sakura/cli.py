"""The `sakura` command: a thin argparse layer whose subcommands live in the packages.

Each package that owns commands exposes ``register(commands, bench)`` in a light ``cli``
module: ``commands`` is the top-level subparsers object and ``bench`` the subparsers of
``sakura bench``. A subcommand sets ``func`` (taking the parsed namespace, returning an
exit code). The ``cli`` modules import nothing heavy at module level (no torch, no model,
no network): every argument is parsed and checked before a command starts its work, and
``sakura --help`` stays fast (``tests/sakura/test_cli.py`` checks what gets imported).

The contract of every command (README): a bad argument prints the usage and exits 2; bad
input (missing files, unknown templates, broken packs, a port in use) prints one
``sakura: error: ...`` line and exits 1; ``--json PATH`` writes the machine-readable result
to PATH and ``--json -`` to standard output (:mod:`sakura.output`); output cut short by a
closed pipe (``sakura ... | head -1``) ends quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from sakura import __version__
from sakura.errors import SakuraError, UsageError
from sakura.extras import missing_message
from sakura.output import json_to_stdout, quiet_dependency_logs

# the order is the order of `sakura --help` and `sakura bench --help`
COMMAND_MODULES = (
    "sakura.dit.cli", "sakura.dit.adapters.cli", "sakura.codec_bench_cli", "sakura.codec.cli",
    "sakura.traces.cli", "sakura.cloud.cli", "sakura.bundle_cli", "sakura.cloud.render_cli", "sakura.edge.cli",
    "sakura.edge.replay.cli", "sakura.edge.backends.cli", "sakura.edge.backends.aihub_cli",
    "sakura.edge.native_cli", "sakura.demo", "sakura.cli_bench", "sakura.origins_bench",
    "sakura.faults_bench", "sakura.serve_ride_cli",
)

DESCRIPTION = ("SAKURA: stream compressed KV caches of diffusion-transformer edit templates\n"
               "from the cloud to phones, and edit privately on the device.")
EPILOG = """\
`sakura COMMAND --help` for a command's options. Bad arguments print the usage and exit 2;
bad input prints one `sakura: error: ...` line and exits 1. `--json PATH` writes a
command's machine-readable result to PATH (`-`: standard output)."""

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process ended by it


class Terminated(BaseException):
    """SIGTERM, raised in the main thread (:func:`sigterm_unwinds`) so that every ``with``
    and ``finally`` on the way out runs: a ``sakura replay`` stopped by ``kill`` (or a
    supervisor) left its ``sakura serve`` children and network namespaces behind. A
    ``BaseException``: no ``except Exception`` on the way swallows it."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside (and in the main thread): SIGTERM raises :class:`Terminated`; the
    previous handler is restored on the way out. A command that installs its own handler
    (uvicorn's graceful stop in ``sakura serve``) replaces it for its own time."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that prints the full usage of the failing (sub)command, exit 2."""

    def error(self, message: str) -> None:  # pragma: no cover - exercised via CLI tests
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sakura", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sakura {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    bench_parser = commands.add_parser(
        "bench", help="benchmarks that write JSON (--json PATH, - for stdout)",
        description="Benchmarks: each writes its results as JSON to --json PATH.")
    bench = bench_parser.add_subparsers(dest="bench", metavar="BENCH", parser_class=_Parser)
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
    for sub in _parsers(parser):
        # the parser of the command that runs, for usage errors found after parsing; a
        # command group without an action prints its usage (exit 2)
        sub.set_defaults(command_parser=sub)
        if sub is not parser and _subcommands(sub) and sub.get_default("func") is None:
            sub.set_defaults(func=_print_usage)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every parser below it (each once; aliases share a parser)."""
    yield parser
    seen: set[int] = set()
    for action in _subcommands(parser):
        for sub in action.choices.values():
            if id(sub) not in seen:
                seen.add(id(sub))
                yield from _parsers(sub)


def _print_usage(args: argparse.Namespace) -> int:
    args.command_parser.print_usage(sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    quiet_dependency_logs()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_usage(sys.stderr)
        return EXIT_USAGE
    try:
        with sigterm_unwinds(), json_to_stdout(args):
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the handlers: a closed pipe shows up here
        return code
    except UsageError as exc:
        command = getattr(args, "command_parser", parser)
        command.print_usage(sys.stderr)
        print(f"{command.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SakuraError as exc:
        return _error(str(exc))
    except ModuleNotFoundError as exc:
        return _error(missing_message(exc))
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        # the file system or the network refused (a full disk, a read-only folder): the
        # user's to fix, so one line, not a traceback
        where = f": {exc.filename}" if exc.filename else ""
        return _error(f"{exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        _quiet_teardown()
        print("sakura: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        _quiet_teardown()
        print("sakura: terminated", file=sys.stderr)
        return EXIT_TERMINATED


def _quiet_teardown() -> None:
    """After a stop (SIGTERM, Ctrl-C) the one line is all the user gets. The signal may have
    cut an object's ``__init__`` short, and its ``__del__`` then fails when the traceback
    that held it goes: an asyncio loop stopped before its self-pipe existed printed
    "AttributeError: '_UnixSelectorEventLoop' object has no attribute '_ssock'" after
    "sakura: terminated" (a clean-clone CI run, 2026-12-07). Those reports are dropped;
    the process is exiting."""
    sys.unraisablehook = lambda unraisable: None


def _error(message: str) -> int:
    print(f"sakura: error: {message}", file=sys.stderr)
    return 1


def _silence_stdout() -> None:
    """The reader of stdout is gone: point stdout at /dev/null so that the interpreter's
    final flush does not raise (and print) a second BrokenPipeError."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
