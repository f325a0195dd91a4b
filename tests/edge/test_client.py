"""The pack client against `sakura serve` over real sockets: one single-range GET per
configuration on the version-pinned pack URL, verification against the manifest, refetch of
corrupted bodies, resume of dropped ones with a narrower Range, manifest revalidation, the
retry window, clear errors. (nginx and S3 origins: tests/edge/test_client_origins.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.edge.client import HEDGE_JSON_ATTEMPTS, PackClient, PackLocation, RetryPolicy
from sakura.edge.errors import EdgeError, OriginError, ServerUnreachable

from tests.edge.helpers import (
    TEMPLATE_ID,
    FaultyApp,
    RecordingApp,
    Server,
    free_port,
)

FAST = RetryPolicy(connect_timeout_s=1.0, read_timeout_s=3.0, window_s=1.0, max_attempts=3,
                   backoff_s=0.05, backoff_max_s=0.2)


def pack_path(world, codec: str):
    m = world.manifests[codec]
    return world.catalog_dir / "templates" / TEMPLATE_ID / codec / m["pack_file"]


def expected_body(world, codec: str, shard: int, config: int) -> bytes:
    m = world.manifests[codec]
    pack = pack_path(world, codec).read_bytes()
    entry = next(c for c in m["shards"][shard]["configs"] if c["id"] == config)
    (offset, length), = entry["ranges"]
    return pack[offset : offset + length]


def stack(world, fault=None):
    """RecordingApp(FaultyApp(app)) so the recorder sees every request the server got."""
    app = create_app(LocalStorage(world.catalog_dir))
    faulty = FaultyApp(app, *fault) if fault else None
    recorder = RecordingApp(faulty or app)
    return Server(recorder), recorder, faulty


def run(coro):
    return asyncio.run(coro)


def test_a_config_is_one_range_get_of_the_pinned_pack_and_is_verified(world):
    server, recorder, _ = stack(world)
    log = []
    with server:
        async def go():
            async with PackClient(server.url, request_log=log) as c:
                catalog = await c.catalog()
                m = await c.manifest(TEMPLATE_ID, "sakura")
                cfg = m["shards"][2]["configs"][-1]["id"]
                got = await c.fetch_config(TEMPLATE_ID, "sakura", 2, cfg, manifest=m)
                plain = await c.fetch_config(TEMPLATE_ID, "sakura", 2, cfg)  # fetches m itself
                return catalog, m, cfg, got, plain
        catalog, m, cfg, got, plain = run(go())
    assert TEMPLATE_ID in catalog["templates"]
    assert got.data == plain.data == expected_body(world, "sakura", 2, cfg)
    assert (got.attempts, got.resumes, got.refetches) == (1, 0, 0)
    assert got.start <= got.first_byte <= got.end
    # one GET each: the catalog, two manifests (the second fetch_config asks itself) and two
    # ranges; a JSON request unanswered after HEDGE_JSON_S goes out once more (a hedge, as a
    # server thread's first answer on a loaded machine can be), a range request never does
    assert {r.method for r in log} == {"GET"}
    ranged_log = [any(k.lower() == "range" for k in r.headers) for r in log]
    json_urls = [r.url for r, ranged_ in zip(log, ranged_log) if not ranged_]
    assert sum(ranged_log) == 2
    assert {u.rsplit("/", 1)[-1] for u in json_urls} == {"catalog.json", "manifest.json"}
    assert 3 <= len(json_urls) <= 3 * HEDGE_JSON_ATTEMPTS, json_urls
    pack_url = f"/templates/{TEMPLATE_ID}/sakura/{m['pack_file']}"
    ranged = [r for r in recorder.requests if "range" in r["headers"]]
    assert [r["path"] for r in ranged] == [pack_url, pack_url]
    (offset, length), = next(c for c in m["shards"][2]["configs"] if c["id"] == cfg)["ranges"]
    assert ranged[0]["headers"]["range"] == f"bytes={offset}-{offset + length - 1}"
    assert "," not in ranged[0]["headers"]["range"]  # never a multi-range request


def test_pack_location_is_the_plain_request_any_receiver_can_send(world):
    import urllib.request

    server, _, _ = stack(world)
    with server:
        async def go():
            async with PackClient(server.url) as c:
                m = await c.manifest(TEMPLATE_ID, "fp16")
                before = c.pack_location(TEMPLATE_ID, "fp16", m)
                await c.fetch_config(TEMPLATE_ID, "fp16", 0, 0, manifest=m)
                return m, before, c.pack_location(TEMPLATE_ID, "fp16", m)
        m, before, loc = run(go())
        assert isinstance(loc, PackLocation) and loc.url.endswith(m["pack_file"])
        assert before.etag is None and loc.etag == f'"{m["pack_sha256"]}"'
        cfg = m["shards"][1]["configs"][0]
        (offset, length), = cfg["ranges"]
        req = urllib.request.Request(loc.url, headers={
            **loc.headers, "Range": f"bytes={offset}-{offset + length - 1}",
            "If-Range": loc.etag})
        with urllib.request.urlopen(req) as resp:
            assert resp.status == 206
            assert resp.read() == expected_body(world, "fp16", 1, cfg["id"])


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
    server, _, faulty = stack(world, (".pack", "corrupt"))
    with server:
        async def go():
            async with PackClient(server.url) as c:
                m = await c.manifest(TEMPLATE_ID, "fp16")
                return await c.fetch_config(TEMPLATE_ID, "fp16", 1, 0, manifest=m)
        got = run(go())
    assert faulty.hits == 1
    assert got.refetches == 1 and got.attempts == 2
    assert got.data == expected_body(world, "fp16", 1, 0)


def test_dropped_connection_resumes_with_a_narrower_range(world):
    server, recorder, faulty = stack(world, (".pack", "cut"))
    with server:
        async def go():
            async with PackClient(server.url, retry=FAST) as c:
                m = await c.manifest(TEMPLATE_ID, "fp16")
                return m, await c.fetch_config(TEMPLATE_ID, "fp16", 3, 0, manifest=m)
        m, got = run(go())
    body = expected_body(world, "fp16", 3, 0)
    assert got.data == body
    assert got.resumes == 1 and got.refetches == 0
    (offset, length), = m["shards"][3]["configs"][0]["ranges"]
    ranged = [r["headers"] for r in recorder.requests if "range" in r["headers"]]
    assert len(ranged) == 2
    assert ranged[0]["range"] == f"bytes={offset}-{offset + length - 1}"
    assert ranged[1]["range"] == f"bytes={offset + length // 2}-{offset + length - 1}"
    assert ranged[1]["if-range"] == f'"{m["pack_sha256"]}"'


def test_corrupted_pack_is_refused_with_the_servers_reason(world, tmp_path, caplog):
    import shutil

    root = tmp_path / "catalog"
    shutil.copytree(world.catalog_dir, root)
    m = world.manifests["fp16"]
    path = root / "templates" / TEMPLATE_ID / "fp16" / m["pack_file"]
    data = bytearray(path.read_bytes())
    (offset, _length), = m["shards"][0]["configs"][0]["ranges"]
    data[offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    caplog.set_level(logging.CRITICAL, logger="sakura.cloud.server")
    with Server(create_app(LocalStorage(root))) as server:
        async def go():
            async with PackClient(server.url, retry=FAST) as c:
                await c.fetch_config(TEMPLATE_ID, "fp16", 0, 0, manifest=m)
        # sakura serve checks the unit checksums itself and refuses to vouch for the bytes:
        # the client reports the server's reason (a static origin cannot check: there the
        # client's own checksums refuse it, test_client_origins.py)
        with pytest.raises(OriginError, match="HTTP 500: the pack of tiny-face/fp16 is "
                                              "damaged: unit .* fails its checksum"):
            run(go())


def test_unknown_template_is_a_clear_error_without_retries(world):
    server, recorder, _ = stack(world)
    with server:
        async def go():
            async with PackClient(server.url) as c:
                await c.manifest("no-such-template", "sakura")
        with pytest.raises(OriginError, match="HTTP 404: unknown template 'no-such-template'"):
            run(go())
    assert len(recorder.requests) == 1


def test_unreachable_server_fails_clearly_after_its_window():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()

    async def go():
        async with PackClient(url, retry=RetryPolicy(window_s=1.0, backoff_s=0.05,
                                                     backoff_max_s=0.2)) as c:
            await c.manifest(TEMPLATE_ID, "sakura")

    with pytest.raises(ServerUnreachable) as info:
        run(go())
    assert 1.0 <= time.monotonic() - t0 < 6
    message = str(info.value)
    assert url in message and "cannot reach" in message and "sakura serve" in message


@pytest.mark.parametrize("named", [True, False])
def test_an_unreachable_s3_origin_names_the_endpoint_botocore_chose(monkeypatch, named):
    pytest.importorskip("boto3")
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    if named:  # ?endpoint_url= in the URL
        url = f"s3://packs/prod?endpoint_url={endpoint}"
    else:  # from the environment, read by botocore
        url = "s3://packs/prod"
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)

    async def go():
        async with PackClient(url, retry=RetryPolicy(window_s=0.5, backoff_s=0.05,
                                                     backoff_max_s=0.1)) as c:
            await c.manifest(TEMPLATE_ID, "sakura")

    with pytest.raises(ServerUnreachable, match=f"at s3://packs/prod.* \\(S3 endpoint "
                                                f"{endpoint}\\): connection refused"):
        run(go())


def test_a_5xx_with_a_reason_is_reported_with_it_not_as_unreachable(world, tmp_path):
    import shutil

    root = tmp_path / "catalog"
    shutil.copytree(world.catalog_dir, root)
    m = world.manifests["fp16"]
    path = root / "templates" / TEMPLATE_ID / "fp16" / m["pack_file"]
    path.write_bytes(path.read_bytes()[:-100])  # truncated on disk
    with Server(create_app(LocalStorage(root))) as server:
        async def go():
            async with PackClient(server.url, retry=FAST) as c:
                await c.fetch_config(TEMPLATE_ID, "fp16", 0, 0, manifest=m)
        with pytest.raises(OriginError) as info:
            run(go())
    message = str(info.value)
    assert server.url in message and "HTTP 500" in message and "truncated or corrupt" in message
    assert "reach" not in message


def test_default_policy_rides_out_a_server_restart(world):
    """The server goes away for ~3 s mid-edit and comes back on the same port: the default
    policy (a 30 s window) waits for it and the body arrives intact."""
    assert RetryPolicy().window_s >= 30
    server, _, _ = stack(world)
    server.start()
    restarted = threading.Event()

    def restart():
        server.stop()
        time.sleep(3.0)
        server.start()
        restarted.set()

    try:
        async def go():
            async with PackClient(server.url) as c:
                m = await c.manifest(TEMPLATE_ID, "fp16")
                t = threading.Thread(target=restart)
                t.start()
                await asyncio.sleep(0.3)  # the server is down now
                got = await c.fetch_config(TEMPLATE_ID, "fp16", 2, 0, manifest=m)
                t.join()
                return got
        got = run(go())
    finally:
        server.stop()
    assert restarted.is_set() and got.attempts >= 2
    assert got.data == expected_body(world, "fp16", 2, 0)


def test_bad_url_is_rejected():
    with pytest.raises(EdgeError, match="http://, https:// or s3://"):
        PackClient("ftp://example.com")


def test_an_origin_that_is_not_there_is_waited_for_visibly_with_jittered_backoff():
    """Nothing listens: one line per retry says what the client waits for and when it gives
    up; each backoff is drawn within [1 - jitter, 1] of its exponential bound."""
    import re

    from sakura.edge.errors import ServerUnreachable

    from tests.edge.helpers import free_port

    lines: list[str] = []
    policy = RetryPolicy(window_s=1.0, backoff_s=0.05, backoff_max_s=0.2)
    url = f"http://127.0.0.1:{free_port()}"

    async def go() -> None:
        async with PackClient(url, retry=policy, on_wait=lines.append) as c:
            await c.catalog()

    with pytest.raises(ServerUnreachable, match="connection refused"):
        asyncio.run(go())
    assert len(lines) >= 3
    for i, line in enumerate(lines, start=1):
        m = re.fullmatch(rf"waiting for {re.escape(url)}: connection refused, retry {i} in "
                         r"([\d.]+) s \(giving up in \d+ s without progress\)", line)
        assert m, line
        bound = policy.delay(i)
        assert (1 - policy.jitter) * bound - 0.05 <= float(m.group(1)) <= bound + 0.05


class SilentFirstManifest:
    """The first manifest request is accepted and never answered (as a lost SYN-ACK or a
    lost request looks to the client); later ones pass."""

    def __init__(self, app, silent=1):
        self.app, self.silent, self.manifests = app, silent, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith("manifest.json"):
            self.manifests += 1
            if self.silent > 0:
                self.silent -= 1
                await asyncio.sleep(30)
                return
        await self.app(scope, receive, send)


def test_an_unanswered_manifest_request_is_hedged_on_a_new_connection(world):
    from sakura.edge.client import HEDGE_JSON_ATTEMPTS, HEDGE_JSON_S

    app = SilentFirstManifest(create_app(LocalStorage(world.catalog_dir)))
    with Server(app) as server:
        async def go():
            async with PackClient(server.url) as c:
                return await c.manifest_fetch(TEMPLATE_ID, "sakura")
        got = run(go())
    # the silent request was hedged and a hedge answered; a loaded host may answer the
    # first hedge later than HEDGE_JSON_S, so a third request is allowed (never a fourth)
    assert 2 <= app.manifests <= HEDGE_JSON_ATTEMPTS
    assert got.data["template_id"] == TEMPLATE_ID
    assert HEDGE_JSON_S < 1.0  # below the 1 s a lost SYN costs


def test_a_hedge_that_is_not_answered_either_is_followed_by_one_more(world):
    """Two handshakes lost in a row (3% loss both ways: ~0.35% of fetches) would still cost
    the 1 s SYN timeout with one hedge: a third request goes out, and no fourth."""
    from sakura.edge.client import HEDGE_JSON_ATTEMPTS

    app = SilentFirstManifest(create_app(LocalStorage(world.catalog_dir)), silent=2)
    with Server(app) as server:
        async def go():
            async with PackClient(server.url) as c:
                return await c.manifest_fetch(TEMPLATE_ID, "sakura")
        got = run(go())
    assert HEDGE_JSON_ATTEMPTS == 3
    assert app.manifests == 3 and got.data["template_id"] == TEMPLATE_ID
