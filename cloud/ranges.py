"""HTTP Range header parsing and normalisation (RFC 9110 section 14), pure and I/O free.

Decisions (documented in ``cloud/README.md``):

* Only the ``bytes`` unit is understood (case-insensitive). Any other unit, or a header whose
  syntax is not a valid ``ranges-specifier`` (garbage, ``last < first``, signs, spaces inside
  numbers, empty list), is *ignored* as RFC 9110 directs: the caller serves ``200`` with the
  full representation (:attr:`RangeKind.IGNORED`).
* Range specs that start at or beyond the end (``bytes=LEN-``) and zero-length suffixes
  (``bytes=-0``) are unsatisfiable and dropped; if nothing satisfiable remains the answer is
  ``416`` with ``Content-Range: bytes */LEN`` (:attr:`RangeKind.UNSATISFIABLE`).
* Overlapping and adjacent ranges are coalesced and the result is served in ascending
  offset order, so a response never carries more bytes than the representation itself
  (no amplification). A single coalesced range is served as a plain ``206`` with
  ``Content-Range``; two or more as ``multipart/byteranges``.
* More than ``max_ranges`` range specs (default 64), or a header longer than
  ``max_header_bytes`` (default 4096), is rejected: :class:`RangeRejected`, which the server
  turns into ``400`` with a JSON error (hostile or broken client, RFC 9110 section 14.2).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

MAX_RANGES = 64
MAX_HEADER_BYTES = 4096

_SPEC = re.compile(r"^(?:([0-9]+)-([0-9]*)|-([0-9]+))$")
_UNIT = re.compile(r"^\s*([A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]*)\s*=(.*)$", re.DOTALL)


class RangeRejected(ValueError):
    """A Range header refused outright (too many ranges, too long); the server answers 400."""


class RangeKind(enum.Enum):
    """What a Range header asks the server to do."""

    NONE = "none"  # no Range header: 200 full
    IGNORED = "ignored"  # not understood / invalid syntax: 200 full (RFC 9110 says ignore)
    PARTIAL = "partial"  # 206 with one range, or multipart/byteranges
    UNSATISFIABLE = "unsatisfiable"  # 416 with Content-Range: bytes */LEN


@dataclass(frozen=True)
class ByteRange:
    """A half-open byte interval ``[start, stop)`` of a representation."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.stop <= self.start:
            raise ValueError(f"invalid byte range [{self.start}, {self.stop})")

    @property
    def length(self) -> int:
        return self.stop - self.start

    def content_range(self, size: int) -> str:
        """The ``Content-Range`` value for this range of a representation of ``size`` bytes."""
        return f"bytes {self.start}-{self.stop - 1}/{size}"


@dataclass(frozen=True)
class RangeRequest:
    """The normalised outcome of a Range header against a representation of ``size`` bytes."""

    kind: RangeKind
    size: int
    ranges: tuple[ByteRange, ...] = field(default=())
    reason: str = ""

    @property
    def is_multipart(self) -> bool:
        return self.kind is RangeKind.PARTIAL and len(self.ranges) > 1


def unsatisfied_content_range(size: int) -> str:
    """The ``Content-Range`` value of a 416 response."""
    return f"bytes */{size}"


def parse_range(
    header: str | None,
    size: int,
    *,
    max_ranges: int = MAX_RANGES,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> RangeRequest:
    """Parse and normalise a ``Range`` header for a representation of ``size`` bytes.

    Raises :class:`RangeRejected` for headers the server refuses (too many ranges, too long).
    """
    if size < 0:
        raise ValueError("size must be >= 0")
    if header is None:
        return RangeRequest(RangeKind.NONE, size)
    if len(header) > max_header_bytes:
        raise RangeRejected(f"Range header too long ({len(header)} > {max_header_bytes} bytes)")
    match = _UNIT.match(header)
    if not match:
        return RangeRequest(RangeKind.IGNORED, size, reason="malformed Range header")
    unit, spec_list = match.group(1), match.group(2)
    if unit.lower() != "bytes":
        return RangeRequest(RangeKind.IGNORED, size, reason=f"unsupported range unit {unit!r}")
    # RFC 9110 list syntax: elements separated by commas with optional whitespace; empty
    # elements are allowed and ignored, but at least one element must be present.
    items = [item.strip(" \t") for item in spec_list.split(",")]
    items = [item for item in items if item]
    if not items:
        return RangeRequest(RangeKind.IGNORED, size, reason="empty range set")
    if len(items) > max_ranges:
        raise RangeRejected(f"too many ranges ({len(items)} > {max_ranges})")
    wanted: list[ByteRange] = []
    for item in items:
        spec = _SPEC.match(item)
        if not spec:
            return RangeRequest(
                RangeKind.IGNORED, size, reason=f"malformed range spec {item[:40]!r}"
            )
        first, last, suffix = spec.groups()
        if suffix is not None:
            n = _num(suffix)
            if n == 0 or size == 0:
                continue  # unsatisfiable: a zero-length suffix, or anything of an empty body
            wanted.append(ByteRange(max(0, size - n), size))
            continue
        start = _num(first)
        if last:
            end = _num(last)
            if end < start:
                return RangeRequest(RangeKind.IGNORED, size, reason=f"invalid range {item[:40]!r}")
        else:
            end = size - 1
        if start >= size:
            continue  # unsatisfiable spec: dropped
        wanted.append(ByteRange(start, min(end, size - 1) + 1))
    if not wanted:
        return RangeRequest(RangeKind.UNSATISFIABLE, size, reason="no satisfiable range")
    return RangeRequest(RangeKind.PARTIAL, size, tuple(coalesce(wanted)))


def _num(digits: str) -> int:
    """A decimal number, saturated at 10**19 (larger than any representation we serve)."""
    stripped = digits.lstrip("0") or "0"
    return int(stripped) if len(stripped) <= 19 else 10**19


def coalesce(ranges: list[ByteRange]) -> list[ByteRange]:
    """Sort ``ranges`` and merge the overlapping or adjacent ones."""
    out: list[ByteRange] = []
    for rng in sorted(ranges, key=lambda r: (r.start, r.stop)):
        if out and rng.start <= out[-1].stop:
            if rng.stop > out[-1].stop:
                out[-1] = ByteRange(out[-1].start, rng.stop)
        else:
            out.append(rng)
    return out


def parse_etag_list(header: str | None) -> list[str] | None:
    """Entity tags of an ``If-Match``/``If-None-Match`` header (``["*"]`` for a star).

    Returns ``None`` when the header is absent; malformed members are skipped.
    """
    if header is None:
        return None
    header = header.strip()
    if header == "*":
        return ["*"]
    return re.findall(r'(?:W/)?"[^"]*"', header)


def strong_match(a: str, b: str) -> bool:
    """RFC 9110 strong comparison: both tags strong and identical."""
    return not a.startswith("W/") and not b.startswith("W/") and a == b


def weak_match(a: str, b: str) -> bool:
    """RFC 9110 weak comparison: opaque tags identical, ignoring the ``W/`` prefix."""
    return a.removeprefix("W/") == b.removeprefix("W/")
