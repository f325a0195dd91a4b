"""The pack client against three real origins of one published catalog: `sakura serve`,
nginx (the distribution's nginx-light with the repository's own site locations, on a
loopback port) and S3 (the moto server, the catalog uploaded with mirror_to_storage): the
same configurations come back byte-identical, each as ONE single-range GET. Plus how the
client meets origins that misbehave: one that ignores Range, a 403 from S3, a truncated or
replaced object, a 416."""

from __future__ import annotations

import asyncio
import shutil
import urllib.error
import urllib.request

import pytest
from sakura.cloud.origins import MotoS3, NginxOrigin
from sakura.cloud.publish import mirror_to_storage
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage, S3Storage
from sakura.edge.client import PackClient, RetryPolicy
from sakura.edge.errors import IntegrityError, OriginError

from tests.edge.helpers import TEMPLATE_ID, RecordingApp, Server

FAST = RetryPolicy(connect_timeout_s=1.0, read_timeout_s=3.0, window_s=1.0, max_attempts=3,
                   backoff_s=0.05, backoff_max_s=0.2)
BUCKET = "sakura-packs"
PREFIX = "prod/v1"


@pytest.fixture(scope="module")
def nginx(world):
    with NginxOrigin(world.catalog_dir) as url:
        yield url


@pytest.fixture(scope="module")
def s3(world):
    moto = MotoS3()
    with moto as endpoint:
        moto.create_bucket(BUCKET)
        env = moto.env()
        storage = S3Storage(BUCKET, PREFIX, endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        mirror_to_storage(world.catalog_dir, storage)
        yield moto, storage


@pytest.fixture
def s3_env(s3, monkeypatch):
    moto, _storage = s3
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{BUCKET}/{PREFIX}"


def run(coro):
    return asyncio.run(coro)


def expected(world, codec, shard, config):
    m = world.manifests[codec]
    pack = (world.catalog_dir / "templates" / TEMPLATE_ID / codec / m["pack_file"]).read_bytes()
    (offset, length), = next(c for c in m["shards"][shard]["configs"]
                             if c["id"] == config)["ranges"]
    return pack[offset : offset + length]


async def fetch_some(url, codec="sakura"):
    log = []
    async with PackClient(url, request_log=log) as c:
        entry = await c.template_entry(TEMPLATE_ID)
        m = await c.manifest(TEMPLATE_ID, codec)
        got = {}
        for s in m["shards"][:3]:
            for cfg in (s["configs"][0], s["configs"][-1]):
                got[(s["index"], cfg["id"])] = (
                    await c.fetch_config(TEMPLATE_ID, codec, s["index"], cfg["id"], manifest=m)
                ).data
        return entry, m, got, log


def test_three_origins_serve_identical_configurations(world, nginx, s3_env):
    with Server(create_app(LocalStorage(world.catalog_dir))) as server:
        results = {name: run(fetch_some(url)) for name, url in
                   (("sakura", server.url), ("nginx", nginx), ("s3", s3_env))}
    ref_entry, ref_m, ref_got, _ = results["sakura"]
    for name, (entry, m, got, log) in results.items():
        assert entry == ref_entry and m == ref_m, name
        assert got == ref_got, name
        for (shard, cfg), data in got.items():
            assert data == expected(world, "sakura", shard, cfg)
        ranged = [r for r in log if "Range" in r.headers]
        assert len(ranged) == len(got)  # one request per configuration
        assert all("," not in r.headers["Range"] for r in ranged)
        assert all(m["pack_file"] in r.url for r in ranged)
    s3_log = results["s3"][3]
    assert all("X-Amz-Signature=" in r.url for r in s3_log)  # presigned, no credentials sent
    assert not any("Authorization" in r.headers for r in s3_log)


def test_nginx_speaks_the_http_the_client_relies_on(world, nginx):
    m = world.manifests["fp16"]
    url = f"{nginx}/templates/{TEMPLATE_ID}/fp16/{m['pack_file']}"
    (offset, length), = m["shards"][2]["configs"][0]["ranges"]
    rng = f"bytes={offset}-{offset + length - 1}"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": rng})) as r:
        assert r.status == 206 and r.headers["Content-Range"] == (
            f"bytes {offset}-{offset + length - 1}/{m['pack_bytes']}")
        etag = r.headers["ETag"]
        assert "immutable" in r.headers["Cache-Control"]
        assert r.read() == expected(world, "fp16", 2, 0)
    # If-Range with its ETag keeps the range; another validator gets the whole object
    req = urllib.request.Request(url, headers={"Range": rng, "If-Range": etag})
    with urllib.request.urlopen(req) as r:
        assert r.status == 206
    req = urllib.request.Request(url, headers={"Range": rng, "If-Range": '"other"'})
    with urllib.request.urlopen(req) as r:
        assert r.status == 200 and int(r.headers["Content-Length"]) == m["pack_bytes"]
    # past the end: 416; the publish lock and temp files are not served
    req = urllib.request.Request(url, headers={"Range": f"bytes={m['pack_bytes']}-"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req)
    assert info.value.code == 416
    for hidden in ("/.publish.lock", f"/templates/{TEMPLATE_ID}/fp16/.tmp-x"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(nginx + hidden)
        assert info.value.code == 404
    # manifests: gzip when asked, revalidated with the ETag nginx gives
    req = urllib.request.Request(f"{nginx}/templates/{TEMPLATE_ID}/fp16/manifest.json",
                                 headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req) as r:
        assert r.headers["Content-Encoding"] == "gzip" and "no-cache" in r.headers["Cache-Control"]


def test_manifest_revalidation_works_on_nginx(nginx):
    async def go():
        cache = {}
        async with PackClient(nginx, manifests=cache) as c:
            first = await c.manifest_fetch(TEMPLATE_ID, "sakura")
            second = await c.manifest_fetch(TEMPLATE_ID, "sakura")
            return first, second
    first, second = run(go())
    assert not first.cached and second.cached and second.data == first.data


def test_s3_origin_missing_object_names_the_url_and_the_s3_message(s3_env):
    async def go():
        async with PackClient(s3_env, retry=FAST) as c:
            await c.manifest("no-such-template", "sakura")
    with pytest.raises(OriginError) as info:
        run(go())
    assert s3_env in str(info.value) and "NoSuchKey" in str(info.value)


class _BadOrigin:
    """An ASGI origin that misbehaves on pack requests in one chosen way."""

    def __init__(self, root, mode):
        self.app = create_app(LocalStorage(root))
        self.mode = mode

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith(".pack"):
            await self.app(scope, receive, send)
            return
        if self.mode == "forbidden":  # what S3 answers a request it refuses
            body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                    b"<Message>Access Denied</Message></Error>")
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/xml")]})
            await send({"type": "http.response.body", "body": body})
            return
        if self.mode == "no-range":  # drop the Range header: 200 with the whole object
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                          if k not in (b"range", b"if-range")]}
        await self.app(scope, receive, send)


@pytest.mark.parametrize(("mode", "message"), [
    ("forbidden", "HTTP 403: AccessDenied: Access Denied"),
    ("no-range", "ignored the Range request"),
])
def test_misbehaving_origins_give_one_clear_error(world, mode, message):
    recorder = RecordingApp(_BadOrigin(world.catalog_dir, mode))
    with Server(recorder) as server:
        async def go():
            async with PackClient(server.url, retry=FAST) as c:
                await c.fetch_config(TEMPLATE_ID, "fp16", 0, 0)
        with pytest.raises(OriginError, match=message) as info:
            run(go())
    assert server.url in str(info.value)
    assert sum(r["path"].endswith(".pack") for r in recorder.requests) == 1  # no retries


def test_truncated_or_replaced_object_is_refused_never_decoded(world, tmp_path):
    root = tmp_path / "catalog"
    shutil.copytree(world.catalog_dir, root)
    m = world.manifests["fp16"]
    path = root / "templates" / TEMPLATE_ID / "fp16" / m["pack_file"]
    data = path.read_bytes()
    last = m["shards"][-1]["configs"][0]
    with NginxOrigin(root) as url:
        async def fetch(shard, config):
            async with PackClient(url, retry=FAST) as c:
                return await c.fetch_config(TEMPLATE_ID, "fp16", shard, config, manifest=m)

        path.write_bytes(data[:-10])  # truncated: the range runs past the end
        with pytest.raises(OriginError, match="truncated"):
            run(fetch(m["shards"][-1]["index"], last["id"]))
        path.write_bytes(data[: last["ranges"][0][0]])  # the range starts past the end: 416
        with pytest.raises(OriginError, match="416.*truncated"):
            run(fetch(m["shards"][-1]["index"], last["id"]))
        flipped = bytearray(data)  # replaced by other bytes of the same length
        flipped[m["shards"][1]["configs"][0]["ranges"][0][0]] ^= 1
        path.write_bytes(bytes(flipped))
        with pytest.raises(IntegrityError, match="fails its checksum"):
            run(fetch(1, m["shards"][1]["configs"][0]["id"]))
        path.write_bytes(data)  # repaired: served again, no restart of anything
        assert run(fetch(1, m["shards"][1]["configs"][0]["id"])).data == expected(
            world, "fp16", 1, m["shards"][1]["configs"][0]["id"])


def test_an_edit_gives_the_same_image_from_every_origin(world, nginx, s3_env, runtime):
    import torch
    from sakura.edge.runtime import EditOptions

    req = runtime.request("a private prompt", 7)
    images = {}
    with Server(create_app(LocalStorage(world.catalog_dir))) as server:
        for name, url in (("sakura", server.url), ("nginx", nginx), ("s3", s3_env)):
            log = []
            # a fixed rate budget: every origin gets the same configuration choices
            res = runtime.edit(url, TEMPLATE_ID, world.template, req, "sakura-fixed-config",
                               request_log=log, options=EditOptions(budget_rate_bps=20e6))
            images[name] = (res.image, res.configs)
            assert res.requests == len(log) == 1 + len(res.timeline)
    ref_image, ref_configs = images["sakura"]
    for name, (image, configs) in images.items():
        assert configs == ref_configs, name
        assert torch.equal(image, ref_image), name


def test_a_public_bucket_is_read_without_credentials(world, s3, s3_env, monkeypatch,
                                                     tmp_path):
    import json as _json

    async def anonymous():
        async with PackClient(s3_env, retry=FAST) as c:
            return await c.catalog()

    _moto, storage = s3
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    # a private bucket refuses plain URLs, with a hint
    with pytest.raises(OriginError, match="403.*credentials and the bucket policy"):
        run(anonymous())
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
        "Resource": f"arn:aws:s3:::{BUCKET}/{PREFIX}/*"}]}
    storage.client.put_bucket_policy(Bucket=BUCKET, Policy=_json.dumps(policy))
    entry, m, got, log = run(fetch_some(s3_env))
    for (shard, cfg), data in got.items():
        assert data == expected(world, "sakura", shard, cfg)
    assert not any("X-Amz-Signature" in r.url for r in log)  # plain URLs


def test_sakura_serve_verifies_a_real_packs_header_without_torch(world):
    """`pip install .` (no torch) is enough for `sakura serve`: a fresh process with torch
    blocked answers a range that covers a real pack's preamble and embedded header
    (checked against the manifest before it is sent) and never imports torch (the pack's
    preamble constants live in the torch-free schema, sakura.codec.manifest; the check used
    to import them from sakura.codec.pack, which imports torch: a 500 on a torch-free
    server)."""
    import json
    import subprocess
    import sys
    import textwrap

    manifest = json.loads((world.catalog_dir / "templates" / TEMPLATE_ID / "sakura"
                           / "manifest.json").read_text())
    key = f"templates/{TEMPLATE_ID}/sakura/{manifest['pack_file']}"
    first_unit = manifest["units"][0][0]
    assert first_unit > 0  # the range below covers the header, not only units
    script = textwrap.dedent(f"""
        import json, sys, urllib.request
        sys.modules["torch"] = None
        from sakura.cloud.runner import serve_in_thread
        from sakura.cloud.server import create_app
        from sakura.cloud.storage import LocalStorage
        with serve_in_thread(create_app(LocalStorage({str(world.catalog_dir)!r}))) as url:
            req = urllib.request.Request(url + "/" + {key!r},
                                         headers={{"Range": "bytes=0-{first_unit + 9}"}})
            with urllib.request.urlopen(req) as r:
                status, body = r.status, r.read()
        print(json.dumps({{"status": status, "body": body.hex(),
                           "torch": sys.modules.get("torch") is not None}}))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["status"] == 206 and not doc["torch"]
    pack = (world.catalog_dir / key).read_bytes()
    assert bytes.fromhex(doc["body"]) == pack[: first_unit + 10]
