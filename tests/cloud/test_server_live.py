"""Real uvicorn on 127.0.0.1 (ephemeral port): concurrency, disconnects, republish mid-read."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import os
import socket
import time

import httpx
import pytest
from sakura.cloud.publish import collect_garbage, publish_pack, update_catalog
from sakura.cloud.runner import serve_in_thread
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.cloud.synthetic import SyntheticSpec, build_catalog, config_bytes, make_pack

from tests.cloud.helpers import parse_multipart

BIG = SyntheticSpec(shards=8, configs=4, unit_bytes=50_000, seed=3)  # an 8 MB pack
PACK = "/v1/templates/big/sakura/pack"


@pytest.fixture
def big(tmp_path):
    root = tmp_path / "catalog"
    pub = build_catalog(root, ["big"], spec=BIG)["big"]
    app = create_app(LocalStorage(root))
    with serve_in_thread(app) as url:
        yield root, pub, app, url


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_real_http_round_trip(big):
    root, pub, _app, url = big
    pack = (root / pub.pack_key).read_bytes()
    manifest = httpx.get(f"{url}/v1/templates/big/sakura/manifest").json()
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.get(PACK)
        assert r.status_code == 200 and r.content == pack
        r = client.get(PACK, headers={"Range": "bytes=1000000-1999999,-5"})
        parts = parse_multipart(r.content, r.headers["content-type"])
        assert [p[1] for p in parts] == [pack[1000000:2000000], pack[-5:]]
        r = client.get("/v1/templates/big/sakura/shards/5/3")
        assert r.content == config_bytes(pack, manifest, 5, 3)
        assert hashlib.sha256(r.content).hexdigest() == r.headers["x-sakura-sha256"]


def test_many_concurrent_clients(big):
    import aiohttp

    root, pub, _app, url = big
    pack = (root / pub.pack_key).read_bytes()
    manifest = httpx.get(f"{url}/v1/templates/big/sakura/manifest").json()
    jobs = [(s["index"], c["id"]) for s in manifest["shards"] for c in s["configs"]]

    async def run() -> int:
        ok = 0
        async with aiohttp.ClientSession() as session:

            async def client(i: int) -> None:
                nonlocal ok
                for k in range(3):
                    shard, cfg = jobs[(i * 3 + k) % len(jobs)]
                    async with session.get(
                        f"{url}/v1/templates/big/sakura/shards/{shard}/{cfg}"
                    ) as resp:
                        body = await resp.read()
                    assert resp.status == 200
                    assert body == config_bytes(pack, manifest, shard, cfg)
                    assert hashlib.sha256(body).hexdigest() == resp.headers["X-Sakura-Sha256"]
                    ok += 1

            await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(40))), timeout=60)
        return ok

    assert asyncio.run(run()) == 120


def test_client_disconnects_mid_stream_do_not_crash_or_leak(big):
    root, pub, app, url = big
    host, port = url.removeprefix("http://").split(":")
    httpx.get(f"{url}/healthz")
    baseline = open_fds()
    for i in range(12):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(f"GET {PACK} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        got = 0
        while got < 200_000 + i * 10_000:
            got += len(sock.recv(65536))
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
        )  # RST
        sock.close()
    metrics = app.state.sakura.metrics
    assert wait_until(lambda: metrics.in_flight == 0 and metrics.disconnects >= 12)
    assert wait_until(lambda: open_fds() <= baseline + 1), (open_fds(), baseline)
    r = httpx.get(f"{url}{PACK}", headers={"Range": "bytes=-10"})
    assert r.status_code == 206 and r.content == (root / pub.pack_key).read_bytes()[-10:]
    assert "sakura_http_client_disconnects_total 12" in httpx.get(f"{url}/metrics").text


def test_pack_replaced_and_collected_while_a_client_reads(big, tmp_path):
    root, old, _app, url = big
    old_pack = (root / old.pack_key).read_bytes()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", PACK)
    resp = conn.getresponse()
    assert resp.status == 200
    old_etag = resp.getheader("ETag")
    head = resp.read(100_000)
    # republish a new version and garbage-collect the old one with no grace at all
    manifest, path = make_pack(
        tmp_path / "w", "big", "sakura", SyntheticSpec(8, 4, 50_000, seed=99)
    )
    new = publish_pack(root, "big", "sakura", manifest, path)
    update_catalog(root, {"big": {"codecs": {"sakura": new}}})
    assert collect_garbage(root, grace_s=0, now=time.time() + 1) == sorted(
        [old.pack_key, old.versioned_manifest_key]
    )
    body = head + resp.read()
    conn.close()
    assert hashlib.sha256(body).hexdigest() == old.pack_sha256  # consistent old version to the end
    assert body == old_pack
    # resuming with the stale validator falls back to the full new version
    r = httpx.get(f"{url}{PACK}", headers={"Range": f"bytes={len(head)}-", "If-Range": old_etag})
    assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == new.pack_sha256
    assert r.headers["etag"] == f'"{new.pack_sha256}"'
    # and the collected version is gone with a clear error
    r = httpx.get(f"{url}{PACK}?pack={old.pack_file}")
    assert r.status_code == 404 and "not available" in r.json()["error"]


def test_storage_failure_mid_stream_aborts_that_response_only(big):
    root, pub, app, url = big
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", PACK)
    resp = conn.getresponse()
    resp.read(50_000)
    os.truncate(root / pub.pack_key, 1_000_000)  # the file shrinks under the open reader
    with pytest.raises((http.client.IncompleteRead, ConnectionError)):
        resp.read()
    conn.close()
    # the truncated file is named by /healthz (its size is not the manifest's) and refused
    health = httpx.get(f"{url}/healthz").json()
    assert health["status"] == "degraded"
    assert [(d["pack"], d["code"]) for d in health["damaged"]] == [(pub.pack_key, "pack_damaged")]
    r = httpx.get(f"{url}{PACK}")
    assert r.status_code == 500 and "truncated" in r.json()["error"]
    assert r.json()["code"] == "pack_damaged"
    assert wait_until(lambda: app.state.sakura.metrics.in_flight == 0)


@pytest.mark.parametrize("stored", ["manifest", "catalog"])
def test_a_deeply_nested_stored_document_is_a_json_error_not_a_traceback(tmp_path, stored,
                                                                          caplog):
    """A manifest.json or catalog.json nested 100,000 levels deep (json.loads raises
    RecursionError, not ValueError) is answered like any invalid JSON: 500 publish_broken
    with the reason, and the server keeps answering (issue 29)."""
    root = tmp_path / "catalog"
    pub = build_catalog(root, ["small"], spec=SyntheticSpec(shards=2, configs=2,
                                                            unit_bytes=256))["small"]
    # the versioned manifest is the one the catalog names (the one the server reads)
    target = (root / pub.versioned_manifest_key if stored == "manifest"
              else root / "catalog.json")
    target.write_text("[" * 100_000 + "]" * 100_000)
    path = ("/v1/templates/small/sakura/manifest" if stored == "manifest"
            else "/v1/templates")
    with serve_in_thread(create_app(LocalStorage(root))) as url:
        r = httpx.get(url + path, timeout=30)
        assert r.status_code == 500, r.text
        body = r.json()
        assert body["code"] == "publish_broken"
        assert "is not valid JSON" in body["error"] and "Traceback" not in r.text
        assert httpx.get(url + "/healthz", timeout=30).status_code in (200, 503)
