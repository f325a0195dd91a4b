"""Where the real traces live and how to pick sets of them.

Traces are never copied into the repository: they are read from ``$SAKURA_TRACES`` when
set, else ``../shared/traces`` next to the repository root (found from this file's location
or from the current directory). Named sets (``5g``, ``lte``, ``ucc5g``, ``wifi``...) map to
file patterns inside that folder; :func:`mixed_trace` builds mixed 4G + 5G traces.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from sakura.traces.errors import TraceError, TraceFormatError
from sakura.traces.formats import load_trace
from sakura.traces.model import Trace

ENV_VAR = "SAKURA_TRACES"

#: Named sets of trace files, as glob patterns relative to the trace folder.
TRACE_SETS: dict[str, str] = {
    "5g": "lumos5g/5g/*.txt",
    "5g-walking": "lumos5g/5g/*walking*.txt",
    "5g-driving": "lumos5g/5g/*driving*.txt",
    "lte": "lumos5g/4g/*.txt",
    "ucc5g": "ucc5g/*.csv",
    "wifi": "wifi/*_wifi.csv",
    "wifi-cellular": "wifi/*_cellular.csv",
    "mahimahi": "mahimahi/*.down",
    "mahimahi-up": "mahimahi/*.up",
}
_SKIP_SUFFIXES = {".md", ".rst", ".py", ".json", ".pdf", ".zip", ".gz", ".tar", ".html"}


def default_trace_dir() -> Path | None:
    """The real-trace folder: ``$SAKURA_TRACES``, else ``../shared/traces`` if it exists.

    ``../shared/traces`` is resolved relative to the repository root (from this package's
    location) and relative to the current directory. Returns None when none exists; raises
    :class:`TraceError` when ``$SAKURA_TRACES`` is set but is not a folder.
    """
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise TraceError(f"{ENV_VAR}={env} is not a folder of traces")
        return path.resolve()
    repo_root = Path(__file__).resolve().parents[1]
    for base in (repo_root, Path.cwd()):
        candidate = base.parent / "shared" / "traces"
        if candidate.is_dir():
            return candidate.resolve()
    return None


def require_trace_dir() -> Path:
    """:func:`default_trace_dir`, or a clear error saying how to point at the traces."""
    root = default_trace_dir()
    if root is None:
        raise TraceError(
            "no trace folder found: put the traces at ../shared/traces next to the repository "
            f"or set {ENV_VAR}=/path/to/traces"
        )
    return root


def _is_trace_file(path: Path) -> bool:
    name = path.name
    return (
        path.is_file()
        and not name.startswith(".")
        and not name.upper().startswith("README")
        and path.suffix.lower() not in _SKIP_SUFFIXES
    )


def find_trace_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Expand files and folders (recursively) into a sorted list of trace files.

    README files and other documentation in folders are skipped; a file named explicitly is
    always kept (and will fail loudly later if it is not a trace).
    """
    out: list[Path] = []
    for item in paths:
        p = Path(item)
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if _is_trace_file(f)))
        elif p.exists():
            out.append(p)
        else:
            raise TraceFormatError(f"trace path {p} does not exist")
    return out


def trace_set(name: str, root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The files of named set ``name`` (see :data:`TRACE_SETS`) under ``root``."""
    if name not in TRACE_SETS:
        raise TraceError(f"unknown trace set {name!r}; known: {', '.join(sorted(TRACE_SETS))}")
    base = Path(root) if root is not None else require_trace_dir()
    files = sorted(base.glob(TRACE_SETS[name]))
    if not files:
        raise TraceError(f"trace set {name!r} is empty under {base} ({TRACE_SETS[name]})")
    return files


def load_set(name: str, root: str | os.PathLike[str] | None = None) -> list[Trace]:
    """Load every trace of a named set."""
    return [load_trace(p) for p in trace_set(name, root)]


def mixed_trace(
    first: Sequence[Trace],
    second: Sequence[Trace],
    *,
    segments: int = 6,
    segment_s: float = 20.0,
    seed: int = 0,
    name: str = "mixed",
) -> Trace:
    """Alternating ``segment_s`` pieces of random traces from ``first`` and ``second``.

    For mixed 4G + 5G: ``mixed_trace(load_set("lte"), load_set("5g"))``. Reproducible for
    a given seed; per-slice labels of the inputs are kept.
    """
    if not first or not second:
        raise TraceError("mixed_trace needs at least one trace in each group")
    if segments < 1 or not segment_s > 0:
        raise TraceError("mixed_trace needs segments >= 1 and segment_s > 0")
    rng = np.random.default_rng(int(seed))
    pieces: list[Trace] = []
    for i in range(segments):
        group = first if i % 2 == 0 else second
        src = group[int(rng.integers(len(group)))]
        start = float(rng.uniform(0.0, max(src.duration_s - segment_s, 0.0)))
        pieces.append(src.slice(round(start, 3), segment_s))
    return Trace.concatenate(pieces, name=name)
