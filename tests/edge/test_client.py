"""The pack client against the real server over real sockets: verification, refetch of
corrupted bodies, resume of dropped ones, manifest revalidation, clear errors."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.edge.client import PackClient, RetryPolicy
from sakura.edge.errors import EdgeError, IntegrityError, ServerUnreachable

from tests.edge.helpers import (
    TEMPLATE_ID,
    FaultyApp,
    RecordingApp,
    Server,
    free_port,
)

FAST = RetryPolicy(connect_timeout_s=1.0, read_timeout_s=3.0, max_attempts=3,
                   backoff_s=0.05, backoff_max_s=0.2)


def expected_body(world, codec: str, shard: int, config: int) -> bytes:
    m = world.manifests[codec]
    pack = (world.catalog_dir / "templates" / TEMPLATE_ID / codec / m["pack_file"]).read_bytes()
    entry = next(c for c in m["shards"][shard]["configs"] if c["id"] == config)
    return b"".join(pack[o : o + n] for o, n in entry["ranges"])


def stack(world, fault=None):
    """RecordingApp(FaultyApp(app)) so the recorder sees every request the server got."""
    app = create_app(LocalStorage(world.catalog_dir))
    faulty = FaultyApp(app, *fault) if fault else None
    recorder = RecordingApp(faulty or app)
    return Server(recorder), recorder, faulty


def run(coro):
    return asyncio.run(coro)


def test_fetch_is_verified_and_every_request_is_logged(world):
    server, recorder, _ = stack(world)
    log = []
    with server:
        async def go():
            async with PackClient(server.url, request_log=log) as c:
                catalog = await c.catalog()
                m = await c.manifest(TEMPLATE_ID, "sakura")
                cfg = m["shards"][2]["configs"][-1]["id"]
                got = await c.fetch_config(TEMPLATE_ID, "sakura", 2, cfg, manifest=m)
                plain = await c.fetch_config(TEMPLATE_ID, "sakura", 2, cfg)  # header sha only
                return catalog, m, cfg, got, plain
        catalog, m, cfg, got, plain = run(go())
    assert TEMPLATE_ID in catalog["templates"]
    assert got.data == plain.data == expected_body(world, "sakura", 2, cfg)
    assert (got.attempts, got.resumes, got.refetches) == (1, 0, 0)
    assert got.start <= got.first_byte <= got.end
    assert [r.method for r in log] == ["GET"] * 4
    assert log[2].url.endswith(f"/v1/templates/{TEMPLATE_ID}/sakura/shards/2/{cfg}"
                               f"?pack={m['pack_file']}")
    assert len(recorder.requests) == 4


def test_manifest_is_revalidated_from_the_cache(world):
    server, recorder, _ = stack(world)
    cache = {}
    with server:
        async def go():
            async with PackClient(server.url, manifests=cache) as c:
                first = await c.manifest_fetch(TEMPLATE_ID, "fp16")
                second = await c.manifest_fetch(TEMPLATE_ID, "fp16")
                return first, second
        first, second = run(go())
    assert not first.cached and first.size > 500
    # the size is the bytes on the wire: the server gzips manifests, aiohttp decodes them
    text = json.dumps(first.data, separators=(",", ":")).encode()
    assert first.size < len(text)
    assert second.cached and second.size == 0 and second.data == first.data
    assert recorder.requests[1]["headers"]["if-none-match"] == first.etag


def test_corrupted_body_is_detected_and_refetched(world):
    server, recorder, faulty = stack(world, ("/shards/1/0", "corrupt"))
    with server:
        async def go():
            async with PackClient(server.url) as c:
                m = await c.manifest(TEMPLATE_ID, "fp16")
                return await c.fetch_config(TEMPLATE_ID, "fp16", 1, 0, manifest=m)
        got = run(go())
    assert faulty.hits == 1
    assert got.refetches == 1 and got.attempts == 2
    assert got.data == expected_body(world, "fp16", 1, 0)


def test_dropped_connection_resumes_with_a_range_request(world):
    server, recorder, faulty = stack(world, ("/shards/3/0", "cut"))
    with server:
        async def go():
            async with PackClient(server.url, retry=FAST) as c:
                m = await c.manifest(TEMPLATE_ID, "fp16")
                return await c.fetch_config(TEMPLATE_ID, "fp16", 3, 0, manifest=m)
        got = run(go())
    body = expected_body(world, "fp16", 3, 0)
    assert got.data == body
    assert got.resumes == 1 and got.refetches == 0
    shard_requests = [r for r in recorder.requests if r["path"].endswith("/shards/3/0")]
    assert len(shard_requests) == 2
    resumed = shard_requests[1]["headers"]
    assert resumed["range"] == f"bytes={len(body) // 2}-"
    assert resumed["if-range"].startswith('"')


def test_corrupted_pack_is_caught_by_unit_checksums(world):
    # the server's own sha256 header matches the corrupted bytes: only the manifest's
    # per-unit checksums can tell, and refetching cannot help
    server, _, faulty = stack(world, ("/shards/0/0", "rehash", 100))
    with server:
        async def go():
            async with PackClient(server.url, retry=FAST) as c:
                m = await c.manifest(TEMPLATE_ID, "fp16")
                await c.fetch_config(TEMPLATE_ID, "fp16", 0, 0, manifest=m)
        with pytest.raises(IntegrityError, match="unit 0 .* fails its checksum"):
            run(go())
    assert faulty.hits == 1 + FAST.max_refetch


def test_unknown_template_is_a_clear_error_without_retries(world):
    server, recorder, _ = stack(world)
    with server:
        async def go():
            async with PackClient(server.url) as c:
                await c.manifest("no-such-template", "sakura")
        with pytest.raises(EdgeError, match="HTTP 404: unknown template 'no-such-template'"):
            run(go())
    assert len(recorder.requests) == 1


def test_unreachable_server_fails_fast_and_clearly():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()

    async def go():
        async with PackClient(url, retry=FAST) as c:
            await c.manifest(TEMPLATE_ID, "sakura")

    with pytest.raises(ServerUnreachable) as info:
        run(go())
    assert time.monotonic() - t0 < 5
    message = str(info.value)
    assert url in message and "gave up after 3 attempts" in message
    assert "sakura serve" in message


def test_bad_url_is_rejected():
    with pytest.raises(EdgeError, match="http://"):
        PackClient("ftp://example.com")
