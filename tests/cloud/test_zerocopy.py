"""Verified pack ranges sent by sendfile (``cloud/zerocopy.py``, issue 29 item 7), over real
uvicorn on 127.0.0.1: the zero-copy path is the one taken, it sends exactly the verified
bytes (the hypothesis property of ``test_served_is_verified.py``, now through sockets), and
a file cut short after its check never yields a complete-looking body."""

from __future__ import annotations

import http.client
import os

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sakura.cloud import zerocopy
from sakura.cloud.auth import TokenSet
from sakura.cloud.runner import serve_in_thread
from sakura.cloud.server import PackResponse, create_app
from sakura.cloud.storage import LocalStorage
from sakura.cloud.synthetic import SyntheticSpec, build_catalog

from tests.cloud.test_served_is_verified import (
    DATE,
    Served,
    check_response,
    range_headers,
    routes,
)


class LiveServed(Served):
    """:class:`Served` answered by uvicorn over a socket instead of the in-process client."""

    http: httpx.Client | None = None
    base_url = ""

    def get(self, url: str, headers: dict[str, str]):
        self.verified.clear()
        assert self.http is not None
        return self.http.get(url, headers=headers)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    s = LiveServed(tmp_path_factory.mktemp("zerocopy") / "catalog")
    with serve_in_thread(s.app) as url, httpx.Client(base_url=url, timeout=30) as client:
        s.http = client
        s.base_url = url
        yield s


@pytest.fixture
def no_streaming(monkeypatch):
    """Fail any response that reads pack bytes into Python to send them (a shard body the
    server has just read whole to hash it is sent from that buffer: no reader there)."""
    stream = PackResponse._stream

    async def refuse(self, send):
        if any(not isinstance(piece, bytes) for piece in self.pieces):
            raise AssertionError("the pack bytes went through Python, not sendfile")
        await stream(self, send)

    monkeypatch.setattr(PackResponse, "_stream", refuse)


def test_ranges_leave_by_sendfile(live, no_streaming):
    url = routes(live)[0][1]
    r = live.get(url, {"Range": "bytes=100-5099"})
    assert r.status_code == 206 and r.content == live.pack[100:5100]
    assert r.headers["content-length"] == "5000"
    r = live.get(url, {"Range": "bytes=0-9,-20"})  # multipart: literal parts and sendfile
    assert r.status_code == 206 and live.pack[:10] in r.content and live.pack[-20:] in r.content
    r = live.get(url, {})
    assert r.status_code == 200 and r.content == live.pack
    r = live.http.head(url)
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-length"] == str(len(live.pack))
    metrics = live.http.get("/metrics").text
    route = "/templates/{template_id}/{codec}/{name}"
    assert f'sakura_http_response_bytes_total{{route="{route}"}}' in metrics


def test_keep_alive_survives_many_sendfile_responses(live, no_streaming):
    """One connection, many responses: h11's framing stays right after each zero-copy body."""
    host, port = live.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    url = routes(live)[0][1]
    for i in range(50):
        start = (i * 97) % (len(live.pack) - 400)
        conn.request("GET", url, headers={"Range": f"bytes={start}-{start + 399}"})
        resp = conn.getresponse()
        assert resp.status == 206 and resp.read() == live.pack[start : start + 400]
    conn.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(header=range_headers, if_range_kind=st.sampled_from([None, "etag", "stale", "date"]),
       route=st.integers(0, 2))
@example(header="bytes=" + ",".join(["0-1"] * 101), if_range_kind=None, route=0)
@example(header="bytes=0-9,20-29,-5", if_range_kind="etag", route=0)
@example(header="bytes=5-3", if_range_kind=None, route=1)
def test_every_byte_sent_by_sendfile_was_verified(live, no_streaming, header, if_range_kind,
                                                  route):
    if header is not None:
        header = header.strip(" \t")  # HTTP clients refuse, and servers strip, edge whitespace
    name, url, body, etag = routes(live)[route]
    if_range = {None: None, "etag": etag, "stale": '"stale"', "date": DATE}[if_range_kind]
    check_response(live, url, body, etag, header, if_range)


def test_a_pack_cut_after_its_check_is_never_sent_complete(tmp_path, no_streaming):
    """The file is truncated in place between the unit check and sendfile: the kernel sends
    what is left and the server closes the connection, so the client sees a body shorter
    than Content-Length (an error), never a 206 that looks whole."""
    s = Served(tmp_path / "catalog")
    pack_path = tmp_path / "catalog" / s.pub.pack_key
    verifier = s.app.state.sakura.verifier
    checked = verifier.verify

    def check_then_cut(reader, resolved, spans):
        checked(reader, resolved, spans)
        os.truncate(pack_path, 1000)

    verifier.verify = check_then_cut
    url = routes(s)[0][1]
    with serve_in_thread(s.app) as base:
        host, port = base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", url, headers={"Range": "bytes=500-2999"})
        resp = conn.getresponse()
        assert resp.status == 206 and resp.headers["content-length"] == "2500"
        with pytest.raises(http.client.IncompleteRead) as caught:
            resp.read()
        assert caught.value.partial == s.pack[500:1000]
        conn.close()


def test_the_extension_is_offered_on_every_request(live):
    seen = []
    app = live.app

    async def probe(scope, receive, send):
        seen.append(dict(scope.get("extensions", {})))
        await app(scope, receive, send)

    with serve_in_thread(probe) as base:
        assert httpx.get(base + "/healthz").status_code == 200
        assert httpx.get(base + "/healthz").status_code == 200
    assert seen and all(zerocopy.EXTENSION in ext for ext in seen)


def test_the_layout_route_still_checks_tokens(tmp_path):
    """The pack route lost FastAPI's Security dependency (its cost), not the check: a
    missing, wrong or out-of-scope token never gets a byte, over real HTTP."""
    root = tmp_path / "catalog"
    pubs = build_catalog(root, ["face-a", "face-b"], spec=SyntheticSpec(2, 2, 512, 1))
    admin, partner = "a" * 24, "p" * 24
    app = create_app(LocalStorage(root), TokenSet.parse(f"{admin}\n{partner} face-a\n"))
    url = f"/templates/face-b/sakura/{pubs['face-b'].pack_file}"
    pack = (root / pubs["face-b"].pack_key).read_bytes()
    with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=10) as client:
        for headers, status in [({}, 401), ({"Authorization": "Bearer " + "x" * 24}, 401),
                                ({"Authorization": f"Bearer {partner}"}, 403)]:
            r = client.get(url, headers={**headers, "Range": "bytes=0-99"})
            assert r.status_code == status and pack[:100] not in r.content
        r = client.get(url, headers={"Authorization": f"Bearer {admin}", "Range": "bytes=0-99"})
        assert r.status_code == 206 and r.content == pack[:100]
        spec = client.get("/openapi.json").json()
        assert spec["paths"]["/templates/{template_id}/{codec}/{name}"]["get"]["security"] == [
            {"HTTPBearer": []}]


def test_pack_ranges_take_the_fast_path(tmp_path, monkeypatch, no_streaming):
    """``PackFastPath`` answers the layout pack route on the event loop once the range's
    units have passed, in a worker thread before (the first check reads them), and a
    damaged pack still answers 500 ``pack_damaged`` there; the metric label is the route's."""
    from sakura.cloud import layout_routes

    calls = []
    layout_pack = layout_routes.layout_pack

    def recording(request, template_id, codec, name, *, inline=False):
        calls.append(inline)
        return layout_pack(request, template_id, codec, name, inline=inline)

    monkeypatch.setattr(layout_routes, "layout_pack", recording)
    s = Served(tmp_path / "catalog")
    url = routes(s)[0][1]
    assert url.startswith("/templates/")
    with serve_in_thread(s.app) as base, httpx.Client(base_url=base, timeout=10) as client:
        for _ in range(2):
            r = client.get(url, headers={"Range": "bytes=0-999"})
            assert r.status_code == 206 and r.content == s.pack[:1000]
        assert calls == [True, False, True]  # cold: retried off the loop; warm: inline
        metrics = client.get("/metrics").text
        assert ('sakura_http_requests_total{method="GET",'
                'route="/templates/{template_id}/{codec}/{name}",status="206"} 2.0') in metrics
        pack_path = tmp_path / "catalog" / s.pub.pack_key
        data = bytearray(pack_path.read_bytes())
        data[-10] ^= 0xFF
        pack_path.write_bytes(bytes(data))  # a new version on disk: checked again
        r = client.get(url, headers={"Range": f"bytes={len(data) - 20}-"})
        assert r.status_code == 500 and r.json()["code"] == "pack_damaged"
        assert r.content.find(bytes(data[-20:])) < 0
