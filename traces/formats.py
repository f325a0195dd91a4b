"""Loaders for the real trace formats, with auto-detection.

Supported formats (see ``traces/LINK.md`` for the exact conversion rules):

``mahimahi``
    One line per 1500-byte delivery opportunity, integer timestamp in ms; repeated
    timestamps are several packets in that ms. Converted to per-bin rates (default 100 ms
    bins); the period is the last timestamp (``mm-link`` loops there), an opportunity at
    exactly the period wraps to time 0, so every byte of the file is kept.
``lumos``
    Lumos5G: ``seconds<TAB>Mbps`` per line.
``gnettrack``
    G-NetTrack Pro CSV with a header; ``DL_bitrate`` (kbit/s) over ``Timestamp``
    (``YYYY.MM.DD_HH.MM.SS``); ``NetworkMode`` becomes the per-slice label.
``bytes_csv``
    ``seconds,bytes_per_second`` CSV without a header (the Wi-Fi / cellular traces).

Timestamped samples become slices: a sample holds from its time to the next sample's time
(time is the ground truth: gaps are held, several samples sharing one timestamp split
the time to the next timestamp evenly); the last sample lasts the median sample spacing.
Zero rates are outages and are kept.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from sakura.traces.errors import TraceFormatError
from sakura.traces.model import Trace

from sakura.atomic import write_atomic

FORMATS = ("mahimahi", "lumos", "gnettrack", "bytes_csv")
MAHIMAHI_PACKET_BYTES = 1500
DEFAULT_MAHIMAHI_BIN_S = 0.1
_EXPECTED = (
    "expected one of: Mahimahi (one integer ms timestamp per line), Lumos5G "
    "('seconds<TAB>Mbps'), G-NetTrack CSV (header with Timestamp and DL_bitrate), or "
    "'seconds,bytes_per_second' CSV"
)
_NUM = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_RE_INT = re.compile(r"^\d+$")
_RE_TWO_WS = re.compile(rf"^({_NUM})[ \t]+({_NUM})$")
_RE_TWO_COMMA = re.compile(rf"^({_NUM})\s*,\s*({_NUM})$")
_GNET_TIME = "%Y.%m.%d_%H.%M.%S"


def _read_text(path: Path) -> str:
    if not path.exists():
        raise TraceFormatError(f"trace file {path} does not exist")
    if path.is_dir():
        raise TraceFormatError(f"{path} is a directory; expected a trace file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace file {path}: {exc.strerror}") from exc
    if b"\x00" in data[:65536]:
        raise TraceFormatError(f"{path} is a binary file, not a trace; {_EXPECTED}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path} is not UTF-8/ASCII text; {_EXPECTED}") from exc
    return text


def _lines(text: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, stripped line) for every non-empty line, lazily."""
    for i, ln in enumerate(text.splitlines()):
        stripped = ln.strip()
        if stripped:
            yield i + 1, stripped


def detect_format(path: str | os.PathLike[str], text: str | None = None) -> str:
    """Name of the format of ``path`` (one of :data:`FORMATS`), sniffed from its content."""
    p = Path(path)
    if text is None:
        text = _read_text(p)
    first_line = next(_lines(text), None)
    if first_line is None:
        raise TraceFormatError(f"trace file {p} is empty; {_EXPECTED}")
    first = first_line[1]
    if "," in first and not _RE_TWO_COMMA.match(first):
        header = [h.strip() for h in first.split(",")]
        if "DL_bitrate" in header:
            if "Timestamp" not in header:
                raise TraceFormatError(
                    f"{p}: G-NetTrack CSV header has DL_bitrate but no Timestamp column"
                )
            return "gnettrack"
        raise TraceFormatError(
            f"{p}: CSV header {first[:80]!r} has no DL_bitrate column; {_EXPECTED}"
        )
    if _RE_INT.match(first):
        return "mahimahi"
    if _RE_TWO_WS.match(first):
        return "lumos"
    if _RE_TWO_COMMA.match(first):
        return "bytes_csv"
    raise TraceFormatError(f"{p}: unrecognised first line {first[:80]!r}; {_EXPECTED}")


def _samples_to_trace(
    times: np.ndarray,
    rates_bps: np.ndarray,
    *,
    name: str,
    source: str,
    fmt: str,
    labels: list[str] | None = None,
) -> Trace:
    """Timestamped samples -> slices (see the module docstring for the rule)."""
    t = np.asarray(times, dtype=np.float64)
    order_bad = np.nonzero(np.diff(t) < 0)[0]
    if order_bad.size:
        i = int(order_bad[0])
        raise TraceFormatError(
            f"{source}: timestamps go backwards at sample {i + 2} ({t[i]:g} -> {t[i + 1]:g})"
        )
    t = t - t[0]
    gaps = np.diff(t)
    positive = gaps[gaps > 0]
    last_width = float(np.median(positive)) if positive.size else 1.0
    distinct, first_idx, counts = np.unique(t, return_index=True, return_counts=True)
    ends = np.append(distinct[1:], distinct[-1] + last_width)
    group = np.repeat(np.arange(distinct.size), counts)
    rank = np.arange(t.size) - first_idx[group]
    starts = distinct[group] + (ends - distinct)[group] * rank / counts[group]
    duration = float(ends[-1])
    return Trace(starts, rates_bps, duration, name=name, labels=labels, source=source, fmt=fmt)


def _parse_two_columns(
    p: Path, text: str, pattern: re.Pattern[str], what: str
) -> tuple[np.ndarray, np.ndarray]:
    times: list[float] = []
    values: list[float] = []
    for lineno, line in _lines(text):
        m = pattern.match(line)
        if not m:
            raise TraceFormatError(f"{p}:{lineno}: expected {what}, got {line[:80]!r}")
        times.append(float(m.group(1)))
        values.append(float(m.group(2)))
    v = np.asarray(values)
    if np.any(v < 0) or not np.all(np.isfinite(v)):
        bad = int(np.nonzero((v < 0) | ~np.isfinite(v))[0][0])
        raise TraceFormatError(f"{p}: negative or non-finite throughput at data row {bad + 1}")
    return np.asarray(times), v


def _network_from_name(p: Path, fmt: str) -> str:
    low = str(p).lower()
    if fmt == "lumos":
        if "/5g/" in low or p.name.lower().startswith("5g"):
            return "5G"
        if "/4g/" in low or p.name.lower().startswith("4g"):
            return "LTE"
    if fmt == "bytes_csv":
        if "wifi" in p.name.lower():
            return "WiFi"
        if "cellular" in p.name.lower():
            return "cellular"
    if fmt == "mahimahi":
        for key in ("LTE", "UMTS"):
            if key in p.name:
                return key
    return ""


def load_lumos(path: str | os.PathLike[str], text: str | None = None) -> Trace:
    """Lumos5G ``seconds<TAB>Mbps`` (one line per second)."""
    p = Path(path)
    text = _read_text(p) if text is None else text
    t, mbps = _parse_two_columns(p, text, _RE_TWO_WS, "'seconds<TAB>Mbps'")
    net = _network_from_name(p, "lumos")
    return _samples_to_trace(
        t,
        mbps * 1e6,
        name=p.stem,
        source=str(p),
        fmt="lumos",
        labels=[net] * t.size if net else None,
    )


def load_bytes_csv(path: str | os.PathLike[str], text: str | None = None) -> Trace:
    """``seconds,bytes_per_second`` CSV without header (Wi-Fi / cellular traces)."""
    p = Path(path)
    text = _read_text(p) if text is None else text
    t, bps = _parse_two_columns(p, text, _RE_TWO_COMMA, "'seconds,bytes_per_second'")
    net = _network_from_name(p, "bytes_csv")
    return _samples_to_trace(
        t,
        bps * 8.0,
        name=p.stem,
        source=str(p),
        fmt="bytes_csv",
        labels=[net] * t.size if net else None,
    )


def _parse_gnet_time(text: str) -> datetime:
    """``YYYY.MM.DD_HH.MM.SS`` (fast path by position, strict fallback)."""
    if len(text) == 19 and text[4] == text[7] == text[13] == text[16] == "." and text[10] == "_":
        try:
            return datetime(
                int(text[0:4]), int(text[5:7]), int(text[8:10]),
                int(text[11:13]), int(text[14:16]), int(text[17:19]),
            )  # fmt: skip
        except ValueError:
            pass
    return datetime.strptime(text, _GNET_TIME)


def load_gnettrack(
    path: str | os.PathLike[str], text: str | None = None, column: str = "DL_bitrate"
) -> Trace:
    """G-NetTrack Pro CSV: ``column`` (kbit/s, default ``DL_bitrate``) over ``Timestamp``.

    ``NetworkMode`` (5G, LTE, HSPA+...) becomes the per-slice label, so
    ``trace.select("5G")`` gives the 5G-mode samples.
    """
    p = Path(path)
    text = _read_text(p) if text is None else text
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise TraceFormatError(f"trace file {p} is empty; {_EXPECTED}") from None
    missing = [c for c in ("Timestamp", column) if c not in header]
    if missing:
        raise TraceFormatError(f"{p}: G-NetTrack CSV lacks column(s) {', '.join(missing)}")
    i_time, i_rate = header.index("Timestamp"), header.index(column)
    i_mode = header.index("NetworkMode") if "NetworkMode" in header else None
    times: list[float] = []
    rates: list[float] = []
    modes: list[str] = []
    for lineno, row in enumerate(reader, start=2):
        if not row or not any(cell.strip() for cell in row):
            continue
        if len(row) <= max(i_time, i_rate):
            raise TraceFormatError(
                f"{p}:{lineno}: row has {len(row)} fields, header has {len(header)}"
            )
        try:
            stamp = _parse_gnet_time(row[i_time].strip())
        except ValueError:
            raise TraceFormatError(
                f"{p}:{lineno}: Timestamp {row[i_time][:40]!r} is not YYYY.MM.DD_HH.MM.SS"
            ) from None
        cell = row[i_rate].strip()
        try:
            kbps = float(cell) if cell not in ("", "-") else 0.0
        except ValueError:
            raise TraceFormatError(
                f"{p}:{lineno}: {column} {cell[:40]!r} is not a number"
            ) from None
        if kbps < 0 or not np.isfinite(kbps):
            raise TraceFormatError(f"{p}:{lineno}: {column} {cell!r} is negative or not finite")
        times.append(stamp.replace(tzinfo=UTC).timestamp())
        rates.append(kbps * 1e3)
        modes.append(row[i_mode].strip() if i_mode is not None and i_mode < len(row) else "")
    if not times:
        raise TraceFormatError(f"{p}: G-NetTrack CSV has a header but no data rows")
    return _samples_to_trace(
        np.asarray(times),
        np.asarray(rates),
        name=p.stem,
        source=str(p),
        fmt="gnettrack",
        labels=modes if i_mode is not None else None,
    )


def load_mahimahi(
    path: str | os.PathLike[str], text: str | None = None, bin_s: float = DEFAULT_MAHIMAHI_BIN_S
) -> Trace:
    """Mahimahi packet-opportunity trace -> per-bin rates (``bin_s`` seconds, default 0.1).

    The period is the last timestamp (as ``mm-link`` loops); the final bin may be shorter.
    Total bytes per period = lines x 1500, exactly.
    """
    p = Path(path)
    text = _read_text(p) if text is None else text
    tokens = text.split()
    if not tokens:
        raise TraceFormatError(f"trace file {p} is empty; {_EXPECTED}")
    try:
        ms = np.array(tokens, dtype=np.int64)
    except ValueError:
        for lineno, line in _lines(text):
            if not _RE_INT.match(line):
                raise TraceFormatError(
                    f"{p}:{lineno}: expected one integer ms timestamp per line (Mahimahi), "
                    f"got {line[:80]!r}"
                ) from None
        raise TraceFormatError(f"{p}: not a Mahimahi trace; {_EXPECTED}") from None
    lines = text.splitlines()
    if len(tokens) != len(lines) - lines.count(""):
        for lineno, line in _lines(text):
            if not _RE_INT.match(line):
                raise TraceFormatError(
                    f"{p}:{lineno}: expected one integer ms timestamp per line (Mahimahi), "
                    f"got {line[:80]!r}"
                )
    if np.any(ms < 0):
        raise TraceFormatError(f"{p}: negative Mahimahi timestamp")
    back = np.nonzero(np.diff(ms) < 0)[0]
    if back.size:
        i = int(back[0])
        raise TraceFormatError(
            f"{p}:{i + 2}: Mahimahi timestamps must not decrease ({ms[i]} -> {ms[i + 1]})"
        )
    period_ms = int(ms[-1])
    if period_ms <= 0:
        raise TraceFormatError(
            f"{p}: Mahimahi trace's last timestamp is 0 ms: the period is undefined"
        )
    if not bin_s > 0:
        raise TraceFormatError(f"Mahimahi bin size must be > 0, got {bin_s}")
    bin_ms = bin_s * 1e3
    n_bins = int(np.ceil(period_ms / bin_ms - 1e-9))
    wrapped = np.where(ms >= period_ms, ms - period_ms, ms)
    idx = np.minimum((wrapped / bin_ms).astype(np.int64), n_bins - 1)
    counts = np.bincount(idx, minlength=n_bins).astype(np.float64)
    edges_s = np.minimum(np.arange(n_bins + 1) * bin_ms, period_ms) / 1e3
    widths = np.diff(edges_s)
    rates = counts * MAHIMAHI_PACKET_BYTES * 8.0 / widths
    net = _network_from_name(p, "mahimahi")
    return Trace.from_edges(
        edges_s,
        rates,
        name=p.name,
        labels=[net] * n_bins if net else None,
        source=str(p),
        fmt="mahimahi",
    )


def to_mahimahi(trace: Trace, start_s: float = 0.0, duration_s: float | None = None) -> str:
    """The trace (from ``start_s`` for ``duration_s``, default its whole period) as a
    Mahimahi ``mm-link`` packet-opportunity file: one line per 1500-byte delivery
    opportunity, the integer ms at which it occurs (several lines may share a ms).

    Opportunity ``k`` is at the first ms by which the trace has delivered ``k x 1500`` bytes
    (floor of the cumulative integral, so fractions of a packet carry over and the total is
    exact to within one packet). ``mm-link`` loops at the last timestamp, so the last line
    is always the period (``duration_s`` in ms): when no opportunity falls in the last ms,
    one is added there (at most one extra packet per period). Rates are goodput, as the
    traces' tools measured them; ``mm-link`` counts 1500-byte packets, so a file written
    here and read back by :func:`load_mahimahi` holds the same bytes per period.
    """
    dur = trace.duration_s if duration_s is None else float(duration_s)
    period_ms = int(round(dur * 1e3))
    if period_ms < 1:
        raise TraceFormatError(f"a Mahimahi trace needs at least 1 ms, got {dur} s")
    piece = trace.slice(start_s, period_ms / 1e3)  # loops like every trace query
    edges = np.asarray(piece.edges_s, dtype=np.float64)
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(piece.rates_bps) * np.diff(edges))])
    # the cumulative integral is linear inside each slice: interpolation is exact
    bits = np.interp(np.arange(period_ms + 1) / 1e3, edges, cum)
    packets = np.floor(bits / (MAHIMAHI_PACKET_BYTES * 8.0) + 1e-9).astype(np.int64)
    per_ms = np.diff(packets)
    if per_ms[-1] == 0:
        per_ms[-1] = 1
    stamps = np.repeat(np.arange(1, period_ms + 1), per_ms)
    return "\n".join(str(int(t)) for t in stamps) + "\n"


def write_mahimahi(path: str | os.PathLike[str], trace: Trace, start_s: float = 0.0,
                   duration_s: float | None = None) -> Path:
    """Write :func:`to_mahimahi` to ``path`` (atomically); returns the path."""
    out = Path(path)
    write_atomic(out, to_mahimahi(trace, start_s, duration_s))
    return out


def load_trace(
    path: str | os.PathLike[str],
    fmt: str | None = None,
    *,
    mahimahi_bin_s: float = DEFAULT_MAHIMAHI_BIN_S,
) -> Trace:
    """Load any supported trace file; the format is auto-detected unless ``fmt`` is given.

    Raises :class:`traces.TraceFormatError` naming the file and what was expected.
    """
    p = Path(path)
    text = _read_text(p)
    kind = fmt or detect_format(p, text)
    if kind == "mahimahi":
        return load_mahimahi(p, text, bin_s=mahimahi_bin_s)
    if kind == "lumos":
        return load_lumos(p, text)
    if kind == "gnettrack":
        return load_gnettrack(p, text)
    if kind == "bytes_csv":
        return load_bytes_csv(p, text)
    raise TraceFormatError(f"unknown trace format {kind!r}; known: {', '.join(FORMATS)}")
