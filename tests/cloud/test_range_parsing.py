"""sakura.cloud.ranges: Range header parsing and normalisation, without any HTTP."""

from __future__ import annotations

import random

import pytest
from sakura.cloud.ranges import (
    ByteRange,
    RangeKind,
    RangeRejected,
    coalesce,
    parse_etag_list,
    parse_range,
    strong_match,
    unsatisfied_content_range,
    weak_match,
)

SIZE = 1000


def spans(header: str, size: int = SIZE) -> list[tuple[int, int]]:
    result = parse_range(header, size)
    assert result.kind is RangeKind.PARTIAL, result
    return [(r.start, r.stop) for r in result.ranges]


def kind(header: str | None, size: int = SIZE) -> RangeKind:
    return parse_range(header, size).kind


def test_no_header_is_full():
    assert kind(None) is RangeKind.NONE


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("bytes=0-0", [(0, 1)]),
        ("bytes=0-499", [(0, 500)]),
        ("bytes=500-", [(500, 1000)]),
        ("bytes=-1", [(999, 1000)]),
        ("bytes=-200", [(800, 1000)]),
        ("bytes=-5000", [(0, 1000)]),  # suffix longer than the body: the whole body
        ("bytes=900-5000", [(900, 1000)]),  # last-pos past the end is clamped
        ("bytes=999-999", [(999, 1000)]),
        ("Bytes=1-2", [(1, 3)]),  # unit is case-insensitive
        ("bytes= 1-2 ,\t5-6 ", [(1, 3), (5, 7)]),  # optional whitespace around elements
        ("bytes=1-2,,5-6,", [(1, 3), (5, 7)]),  # empty list elements are ignored
        ("bytes=0007-0009", [(7, 10)]),  # leading zeros
        ("bytes=0-99999999999999999999999999999", [(0, 1000)]),  # huge last-pos saturates
    ],
)
def test_satisfiable(header, expected):
    assert spans(header) == expected


def test_overlapping_and_adjacent_ranges_are_coalesced_in_ascending_order():
    assert spans("bytes=500-599,0-9,5-20,21-30,550-560") == [(0, 31), (500, 600)]
    assert spans("bytes=0-10,0-10,0-10") == [(0, 11)]
    assert spans("bytes=-100,800-") == [(800, 1000)]
    # the result never exceeds the body: no amplification through overlap
    many = ",".join(["0-999"] * 64)
    result = parse_range(f"bytes={many}", SIZE)
    assert sum(r.length for r in result.ranges) == SIZE


def test_disjoint_ranges_stay_separate():
    assert spans("bytes=0-0,2-2") == [(0, 1), (2, 3)]


@pytest.mark.parametrize(
    "header",
    [
        "bytes=1000-",
        "bytes=1000-2000",
        "bytes=-0",
        "bytes=5000-5001,1000-",
        "bytes=99999999999999999999999-",
    ],
)
def test_unsatisfiable(header):
    result = parse_range(header, SIZE)
    assert result.kind is RangeKind.UNSATISFIABLE
    assert unsatisfied_content_range(SIZE) == "bytes */1000"


def test_unsatisfiable_specs_are_dropped_when_others_are_satisfiable():
    assert spans("bytes=2000-3000,0-1,-0") == [(0, 2)]


def test_empty_body_is_never_satisfiable():
    assert kind("bytes=0-", 0) is RangeKind.UNSATISFIABLE
    assert kind("bytes=-10", 0) is RangeKind.UNSATISFIABLE
    assert kind(None, 0) is RangeKind.NONE


@pytest.mark.parametrize(
    "header",
    [
        "",
        "bytes",
        "bytes=",
        "bytes=,",
        "bytes=abc",
        "bytes=5-1",  # last < first: invalid, so the whole header is ignored
        "bytes=-5-10",
        "bytes=1-2-3",
        "bytes=+1-2",
        "bytes=1 -2",
        "bytes=0x10-0x20",
        "bytes=1-2;3-4",
        "bytes=--1",
        "bytes=1.5-2",
        "items=0-1",  # unknown unit
        "=0-1",
        "bytes 0-1",
        "bytes=٣-٤",  # non-ASCII digits are not DIGIT
        "bytes=0-1,\x00",
    ],
)
def test_malformed_headers_are_ignored(header):
    assert kind(header) is RangeKind.IGNORED


def test_too_many_ranges_are_rejected():
    ok = ",".join(f"{i * 10}-{i * 10 + 1}" for i in range(64))
    assert len(parse_range(f"bytes={ok}", SIZE).ranges) == 64
    too_many = ",".join(f"{i * 10}-{i * 10 + 1}" for i in range(65))
    with pytest.raises(RangeRejected, match="too many ranges"):
        parse_range(f"bytes={too_many}", SIZE)
    with pytest.raises(RangeRejected):
        parse_range("bytes=" + ",".join(["0-0"] * 10), SIZE, max_ranges=9)


def test_overlong_header_is_rejected():
    with pytest.raises(RangeRejected, match="too long"):
        parse_range("bytes=0-1" + " " * 5000, SIZE)


def test_huge_numbers_do_not_blow_up():
    digits = "9" * 4000
    assert kind(f"bytes={digits}-") is RangeKind.UNSATISFIABLE
    assert kind(f"bytes=-{digits}") is RangeKind.PARTIAL


def test_byte_range_helpers():
    rng = ByteRange(10, 20)
    assert rng.length == 10
    assert rng.content_range(100) == "bytes 10-19/100"
    with pytest.raises(ValueError):
        ByteRange(5, 5)
    with pytest.raises(ValueError):
        ByteRange(-1, 5)


def test_coalesce_matches_a_brute_force_model():
    rnd = random.Random(7)
    for _ in range(300):
        size = rnd.randint(1, 200)
        specs = []
        for _ in range(rnd.randint(1, 8)):
            a = rnd.randint(0, size + 5)
            b = rnd.randint(a, size + 10)
            specs.append(f"{a}-{b}" if rnd.random() < 0.7 else f"-{rnd.randint(0, size + 3)}")
        result = parse_range("bytes=" + ",".join(specs), size)
        covered = set()
        for spec in specs:
            if spec.startswith("-"):
                n = int(spec[1:])
                covered |= set(range(max(0, size - n), size)) if n else set()
            else:
                a, b = map(int, spec.split("-"))
                covered |= set(range(a, min(b, size - 1) + 1))
        if not covered:
            assert result.kind is RangeKind.UNSATISFIABLE
            continue
        got = [(r.start, r.stop) for r in result.ranges]
        assert got == sorted(got)
        for (_, stop), (start, _) in zip(got, got[1:]):
            assert stop < start  # neither overlapping nor adjacent
        assert set().union(*(set(range(a, b)) for a, b in got)) == covered


def test_coalesce_function():
    assert coalesce([ByteRange(5, 10), ByteRange(0, 5)]) == [ByteRange(0, 10)]
    assert coalesce([ByteRange(0, 3), ByteRange(4, 6)]) == [ByteRange(0, 3), ByteRange(4, 6)]


def test_etag_helpers():
    assert parse_etag_list(None) is None
    assert parse_etag_list("*") == ["*"]
    assert parse_etag_list('"a", W/"b" ,"c"') == ['"a"', 'W/"b"', '"c"']
    assert parse_etag_list("garbage") == []
    assert strong_match('"a"', '"a"')
    assert not strong_match('W/"a"', '"a"')
    assert weak_match('W/"a"', '"a"')
    assert not weak_match('"a"', '"b"')
