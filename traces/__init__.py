"""Real network traces and link emulation.

Loaders for the real 5G / LTE / Wi-Fi trace formats (:mod:`traces.formats`), the
piecewise-constant :class:`Trace` model with statistics and sampling
(:mod:`traces.model`), the trace folder and named sets (:mod:`traces.catalog`), and two
link emulators with one interface: a paced asyncio TCP proxy (:mod:`traces.link`) and
kernel shaping with tbf between two network namespaces (:mod:`traces.netns`).
"""

from sakura.traces.catalog import (
    ENV_VAR,
    TRACE_SETS,
    default_trace_dir,
    find_trace_files,
    load_set,
    mixed_trace,
    require_trace_dir,
    trace_set,
)
from sakura.traces.errors import LinkError, NetnsUnavailableError, TraceError, TraceFormatError
from sakura.traces.formats import FORMATS, detect_format, load_trace
from sakura.traces.model import Trace

__all__ = [
    "ENV_VAR",
    "FORMATS",
    "TRACE_SETS",
    "LinkError",
    "NetnsUnavailableError",
    "Trace",
    "TraceError",
    "TraceFormatError",
    "default_trace_dir",
    "detect_format",
    "find_trace_files",
    "load_set",
    "load_trace",
    "mixed_trace",
    "require_trace_dir",
    "trace_set",
]
