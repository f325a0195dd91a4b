"""Machine-readable output of every command: ``--json PATH`` writes JSON to PATH, and
``--json -`` writes it to standard output.

Commands only ever write their JSON to the path in ``args.json``; :func:`json_to_stdout`
(applied by ``sakura.cli`` to every command) makes ``-`` work everywhere the same way: the
command writes to a temporary file while its human-readable lines go to standard error,
and the document is copied to standard output once the command succeeds, so standard
output holds nothing but the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STDOUT = "-"

# executorch depends on torchao, which transformers imports whenever it is installed; on
# this CPU build torchao logs that its CUDA kernels do not load and torch logs a deprecated
# enum registration: warnings of no use to a user, printed on every command otherwise.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_dependency_logs() -> None:
    """Silence :data:`QUIET_LOGGERS` below errors: in every command (``sakura.cli``), and in
    each process a command spawns that may import them (e.g. ``sakura replay``'s parallel
    pack builds, which printed torchao's lines once per worker)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def json_safe(o: Any) -> Any:
    """``o`` with every non-finite float (NaN, infinity: a ratio with a side missing, a
    statistic of nothing) as None, so that it serialises as strict JSON (``null``)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    return o


def write_json(path: str | Path, doc: Any, *, indent: int | None = 2) -> Path:
    """Write ``doc`` as JSON to ``path`` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")
    return path


@contextlib.contextmanager
def json_to_stdout(args: argparse.Namespace) -> Iterator[None]:
    """Run a command with ``--json -`` as described in the module docstring; a no-op for
    any other value (or a command without ``--json``)."""
    if getattr(args, "json", None) != STDOUT:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="sakura-json-") as tmp:
        args.json = str(Path(tmp) / "out.json")
        with contextlib.redirect_stdout(sys.stderr):
            yield
        written = Path(args.json)
        if written.exists():
            sys.stdout.write(written.read_text())
            sys.stdout.flush()
