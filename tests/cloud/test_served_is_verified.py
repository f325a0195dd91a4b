"""The server verifies exactly what it sends (issue 29): one Range parse
(``cloud/ranges.py`` with the server's limits) decides both which pack bytes are checked
against the manifest's unit checksums and which bytes the response carries, on every route
(the layout's pack file, ``/v1/.../pack``, the shard endpoint).

Property (hypothesis, against the real ASGI app): for any ``Range`` header (random strings,
well-formed multi-range lists, overlapping, reversed, more than 100 ranges) and ``If-Range``,
the answer is the one :func:`parse_range` describes, every pack byte served lies inside
spans the verifier passed for that request, and the served bytes are the file's bytes.
"""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sakura.cloud.ranges import RangeKind, RangeRejected, parse_range, strong_match
from sakura.cloud.server import Body, ServerSettings, create_app
from sakura.cloud.storage import LocalStorage
from sakura.cloud.synthetic import SyntheticSpec, build_catalog

from tests.cloud.helpers import parse_multipart

SPEC = SyntheticSpec(shards=3, configs=3, unit_bytes=700, seed=7)
MAX_RANGES = ServerSettings().max_ranges
DATE = "Wed, 21 Oct 2015 07:28:00 GMT"


class Served:
    """A published catalog and an app whose verifier records the spans it passed."""

    def __init__(self, root) -> None:
        self.pub = build_catalog(root, ["face-a"], spec=SPEC)["face-a"]
        self.pack = (root / self.pub.pack_key).read_bytes()
        self.manifest = json.loads((root / self.pub.versioned_manifest_key).read_text())
        self.etag = f'"{self.pub.pack_sha256}"'
        self.app = create_app(LocalStorage(root))
        verifier = self.app.state.sakura.verifier
        original = verifier.verify
        self.verified: list[tuple[int, int]] = []

        def recording(reader, resolved, spans):
            original(reader, resolved, spans)  # raises unless every unit of spans passed
            self.verified.extend((int(o), int(n)) for o, n in spans)

        verifier.verify = recording
        self.client = TestClient(self.app, raise_server_exceptions=True)

    def get(self, url: str, headers: dict[str, str]):
        self.verified.clear()
        return self.client.get(url, headers=headers)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("verified") / "catalog")
    with s.client:
        yield s


def routes(s: Served) -> list[tuple[str, str, Body, str]]:
    """(name, url, body as pack spans, etag) of every route that serves pack bytes."""
    shard = s.manifest["shards"][1]
    cfg = shard["configs"][-1]
    whole = Body(((0, len(s.pack)),))
    return [
        ("layout", f"/templates/face-a/sakura/{s.pub.pack_file}", whole, s.etag),
        ("v1-pack", "/v1/templates/face-a/sakura/pack", whole, s.etag),
        ("shard", f"/v1/templates/face-a/sakura/shards/{shard['index']}/{cfg['id']}",
         Body(tuple((o, n) for o, n in cfg["ranges"])),
         f'"{s.pub.pack_sha256}:{shard["index"]}:{cfg["id"]}"'),
    ]


def inside(segment: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether pack bytes [off, off+n) lie inside the union of ``spans``."""
    merged: list[list[int]] = []
    for o, n in sorted((o, n) for o, n in spans if n > 0):
        if merged and o <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], o + n)
        else:
            merged.append([o, o + n])
    off, n = segment
    return any(lo <= off and off + n <= hi for lo, hi in merged)


def check_response(s: Served, url: str, body: Body, etag: str, range_header: str | None,
                   if_range: str | None) -> None:
    headers = {}
    if range_header is not None:
        headers["Range"] = range_header
    if if_range is not None:
        headers["If-Range"] = if_range
    r = s.get(url, headers)
    data = b"".join(s.pack[o : o + n] for o, n in body.spans)  # the body's bytes, from disk
    size = len(data)
    effective = range_header
    if if_range is not None and not strong_match(if_range.strip(), etag):
        effective = None  # a stale validator or a date: the full body
    try:
        wanted = parse_range(effective, size, max_ranges=MAX_RANGES)
    except RangeRejected:
        assert r.status_code == 400, (range_header, r.status_code)
        assert r.json()["code"] == "bad_range"
        return
    if wanted.kind is RangeKind.UNSATISFIABLE:
        assert r.status_code == 416, (range_header, r.status_code)
        assert r.json()["code"] == "range_not_satisfiable"
        assert r.headers["content-range"] == f"bytes */{size}"
        return
    if wanted.kind in (RangeKind.NONE, RangeKind.IGNORED):
        assert r.status_code == 200, (range_header, r.status_code)
        parts = [((0, size), r.content)]
    elif len(wanted.ranges) == 1:
        rng = wanted.ranges[0]
        assert r.status_code == 206, (range_header, r.status_code)
        assert r.headers["content-range"] == rng.content_range(size)
        parts = [((rng.start, rng.stop), r.content)]
    else:
        assert r.status_code == 206, (range_header, r.status_code)
        got = parse_multipart(r.content, r.headers["content-type"])
        assert [cr for cr, _ in got] == [rng.content_range(size) for rng in wanted.ranges]
        parts = [((rng.start, rng.stop), d) for rng, (_cr, d) in zip(wanted.ranges, got)]
    assert "last-modified" not in r.headers  # ETags only, on every route
    for (start, stop), got_bytes in parts:
        assert got_bytes == data[start:stop], (range_header, start, stop)
        for segment in body.segments(start, stop):  # the pack bytes this part carries
            assert inside(segment, s.verified), (range_header, segment, s.verified)


# well-formed range specs over a ~25 KB pack, reversed, open, suffix, far past the end
_pos = st.one_of(st.integers(0, 40), st.integers(0, 30_000), st.integers(0, 10**22))
_spec = st.one_of(
    st.tuples(_pos, _pos).map(lambda ab: f"{ab[0]}-{ab[1]}"),  # either order: reversed too
    _pos.map(lambda a: f"{a}-"),
    _pos.map(lambda n: f"-{n}"),
)
_many = st.one_of(
    st.lists(_spec, min_size=1, max_size=12),
    st.lists(_spec, min_size=60, max_size=160),  # around the limits (ours 64, Starlette's 100)
    st.integers(60, 160).flatmap(lambda k: st.just(["0-1"] * k)),  # overlapping duplicates
)
well_formed = st.tuples(_many, st.sampled_from([",", ", ", " ,\t"]),
                        st.sampled_from(["bytes=", "Bytes=", " bytes = "])).map(
    lambda t: t[2] + t[1].join(t[0]))
garbage = st.text(alphabet="bytesBYTES=0123456789-,; \t*x", max_size=80)
printable = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=120)
range_headers = st.one_of(st.none(), well_formed, garbage, printable)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=range_headers, if_range_kind=st.sampled_from([None, "etag", "stale", "date"]),
       route=st.integers(0, 2))
@example(header="bytes=" + ",".join(["0-1"] * 101), if_range_kind=None, route=0)
@example(header="bytes=" + ",".join(f"{i}-{i + 50}" for i in range(101)), if_range_kind=None,
         route=0)
@example(header="bytes=5-3", if_range_kind=None, route=0)
@example(header="bytes=0-9", if_range_kind="date", route=0)
def test_every_served_byte_was_verified_and_is_the_files(served, header, if_range_kind,
                                                        route):
    name, url, body, etag = routes(served)[route]
    if_range = {None: None, "etag": etag, "stale": '"stale"', "date": DATE}[if_range_kind]
    check_response(served, url, body, etag, header, if_range)


def test_the_issue_cases_on_the_layout_route(served):
    """101 overlapping ranges (once verified over their coalesced span and then sent whole),
    ``bytes=5-3`` (a 400 in Starlette), a date If-Range: one meaning, our parser's."""
    url = routes(served)[0][1]
    r = served.get(url, {"Range": "bytes=" + ",".join(["0-1"] * 101)})
    assert r.status_code == 400 and r.json()["code"] == "bad_range"
    assert "too many ranges (101 > 64)" in r.json()["error"] and served.verified == []
    r = served.get(url, {"Range": "bytes=" + ",".join(["0-1"] * 64)})
    assert r.status_code == 206 and r.content == served.pack[:2]
    assert r.headers["content-range"] == f"bytes 0-1/{len(served.pack)}"
    assert served.verified == [(0, 2)]
    r = served.get(url, {"Range": "bytes=5-3"})  # invalid syntax: ignored as RFC 9110 says
    assert r.status_code == 200 and r.content == served.pack
    assert served.verified == [(0, len(served.pack))]
    r = served.get(url, {"Range": "bytes=0-9", "If-Range": DATE})
    assert r.status_code == 200 and r.content == served.pack and "last-modified" not in r.headers
    r = served.get(url, {"Range": "bytes=0-9", "If-Range": served.etag})
    assert r.status_code == 206 and r.content == served.pack[:10]


def test_a_damaged_unit_outside_the_ranges_is_never_sent(tmp_path):
    """The issue's attack: ranges over good units in a header over Starlette's limit. The
    old route verified the ranges and then sent the whole file, damaged unit included."""
    s = Served(tmp_path / "catalog")
    pack_path = tmp_path / "catalog" / s.pub.pack_key
    last_unit = s.manifest["units"][-1]
    bad = bytearray(s.pack)
    bad[last_unit[0] + 1] ^= 0xFF
    pack_path.write_bytes(bytes(bad))
    url = routes(s)[0][1]
    with s.client:
        for count in (65, 100, 101, 150):
            r = s.get(url, {"Range": "bytes=" + ",".join(["0-99"] * count)})
            assert r.status_code == 400 and r.json()["code"] == "bad_range"
            assert s.pack[last_unit[0]:last_unit[0] + 16] not in r.content
        r = s.get(url, {"Range": "bytes=" + ",".join(["0-99"] * 64)})
        assert r.status_code == 206 and r.content == s.pack[:100]
        r = s.get(url, {"Range": "bytes=5-3"})  # the whole file: refused, not sent
        assert r.status_code == 500 and r.json()["code"] == "pack_damaged"
        assert re.search(r"damaged: unit \d+ \(bytes \d+-\d+\) fails its checksum",
                         r.json()["error"])
