"""The HTTP API through FastAPI's TestClient: catalog, manifests, Range semantics, shards."""

from __future__ import annotations

import hashlib
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sakura.cloud import layout
from sakura.cloud.publish import publish_pack, update_catalog
from sakura.cloud.synthetic import SyntheticSpec, make_pack

from tests.cloud.helpers import parse_multipart, shard_bytes

PACK = "/v1/templates/face-a/sakura/pack"
MANIFEST = "/v1/templates/face-a/sakura/manifest"


def shard_url(s: int, c: int, tid: str = "face-a") -> str:
    return f"/v1/templates/{tid}/sakura/shards/{s}/{c}"


def test_healthz_openapi_and_docs(client):
    assert client.get("/healthz").json() == {"status": "ok", "damaged": []}
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path in [
        "/v1/templates",
        "/v1/templates/{template_id}",
        "/v1/templates/{template_id}/{codec}/manifest",
        "/v1/templates/{template_id}/{codec}/pack",
        "/v1/templates/{template_id}/{codec}/shards/{shard}/{config}",
        "/healthz",
        "/metrics",
    ]:
        assert path in paths
    assert "head" in paths["/v1/templates/{template_id}/{codec}/pack"]
    assert client.get("/docs").status_code == 200


def test_catalog_and_template_entry(client, published):
    r = client.get("/v1/templates")
    assert r.status_code == 200
    catalog = json.loads((published.root / "catalog.json").read_text())
    assert r.json() == catalog
    assert (
        client.get("/v1/templates", headers={"If-None-Match": r.headers["etag"]}).status_code == 304
    )
    entry = client.get("/v1/templates/tryon-b").json()
    assert entry == catalog["templates"]["tryon-b"]
    r = client.get("/v1/templates/nope")
    assert r.status_code == 404
    assert r.json() == {"error": "unknown template 'nope'", "code": "unknown_template"}


def test_manifest_etag_and_304(client, published):
    r = client.get(MANIFEST, headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    pub = published.packs["face-a"]
    assert r.headers["etag"] == f'"{pub.pack_sha256}"'
    assert "no-cache" in r.headers["cache-control"]
    assert r.content == (published.root / pub.manifest_key).read_bytes()
    assert r.json()["pack_file"] == pub.pack_file
    r2 = client.get(MANIFEST, headers={"If-None-Match": f'"x", {r.headers["etag"]}',
                                       "Accept-Encoding": "identity"})
    assert r2.status_code == 304 and r2.content == b"" and r2.headers["etag"] == r.headers["etag"]
    assert client.get(MANIFEST, headers={"If-None-Match": "*"}).status_code == 304
    assert client.get(MANIFEST, headers={"If-None-Match": '"stale"'}).status_code == 200
    assert client.get("/v1/templates/face-a/intq/manifest").status_code == 404


def test_full_pack_get_and_head(client, published):
    pack = published.pack("face-a")
    r = client.get(PACK)
    assert r.status_code == 200
    assert r.content == pack
    assert r.headers["accept-ranges"] == "bytes"
    assert r.headers["content-length"] == str(len(pack))
    assert r.headers["etag"] == f'"{published.packs["face-a"].pack_sha256}"'
    assert r.headers["content-type"] == "application/octet-stream"
    h = client.head(PACK)
    assert h.status_code == 200 and h.content == b""
    assert h.headers["content-length"] == str(len(pack)) and h.headers["etag"] == r.headers["etag"]
    # Range is defined for GET only: HEAD with Range describes the full representation
    h = client.head(PACK, headers={"Range": "bytes=0-9"})
    assert h.status_code == 200 and h.headers["content-length"] == str(len(pack))


@pytest.mark.parametrize(
    ("header", "span"),
    [
        ("bytes=0-0", (0, 1)),
        ("bytes=10-1033", (10, 1034)),
        ("bytes=100-", (100, None)),
        ("bytes=-77", (-77, None)),
        ("bytes=5-999999999", (5, None)),
        ("bytes=-999999999", (0, None)),
        ("bytes=0-9,5-20", (0, 21)),  # overlapping -> coalesced into one plain 206
        ("bytes=0-9,10-20", (0, 21)),  # adjacent -> coalesced
    ],
)
def test_single_range(client, published, header, span):
    pack = published.pack("face-a")
    r = client.get(PACK, headers={"Range": header})
    assert r.status_code == 206
    expected = pack[span[0] : span[1]]
    assert r.content == expected
    start = span[0] % len(pack)
    assert r.headers["content-range"] == f"bytes {start}-{start + len(expected) - 1}/{len(pack)}"
    assert r.headers["content-length"] == str(len(expected))
    assert r.headers["content-type"] == "application/octet-stream"


def test_multi_range_multipart(client, published):
    pack = published.pack("face-a")
    n = len(pack)
    r = client.get(PACK, headers={"Range": "bytes=500-599,0-9,-10,50-60,55-70"})
    assert r.status_code == 206
    assert r.headers["content-type"].startswith("multipart/byteranges; boundary=")
    parts = parse_multipart(r.content, r.headers["content-type"])
    assert parts == [
        (f"bytes 0-9/{n}", pack[0:10]),
        (f"bytes 50-70/{n}", pack[50:71]),
        (f"bytes 500-599/{n}", pack[500:600]),
        (f"bytes {n - 10}-{n - 1}/{n}", pack[-10:]),
    ]
    assert int(r.headers["content-length"]) == len(r.content)


def test_sixty_four_ranges_are_served_and_sixty_five_rejected(client, published):
    pack = published.pack("face-a")
    specs = [f"{i * 100}-{i * 100 + 9}" for i in range(64)]
    r = client.get(PACK, headers={"Range": "bytes=" + ",".join(specs)})
    assert r.status_code == 206
    parts = parse_multipart(r.content, r.headers["content-type"])
    assert [p[1] for p in parts] == [pack[i * 100 : i * 100 + 10] for i in range(64)]
    r = client.get(PACK, headers={"Range": "bytes=" + ",".join(specs + ["9000-9001"])})
    assert r.status_code == 400
    assert "too many ranges" in r.json()["error"]


def test_overlapping_ranges_do_not_amplify(client, published):
    pack = published.pack("face-a")
    r = client.get(PACK, headers={"Range": "bytes=" + ",".join(["0-"] * 64)})
    assert r.status_code == 206 and r.content == pack  # one coalesced range, not 64 copies


@pytest.mark.parametrize("header", ["bytes=999999999-", "bytes=-0", "bytes=999999999-999999999,-0"])
def test_unsatisfiable_is_416(client, published, header):
    n = len(published.pack("face-a"))
    r = client.get(PACK, headers={"Range": header})
    assert r.status_code == 416
    assert r.headers["content-range"] == f"bytes */{n}"
    assert "not satisfiable" in r.json()["error"]


@pytest.mark.parametrize(
    "header",
    ["bytes=5-1", "bytes=abc", "pages=0-1", "bytes=-1-2", "bytes=", "bytes=1--2", "garbage"],
)
def test_malformed_range_is_ignored_with_full_200(client, published, header):
    r = client.get(PACK, headers={"Range": header})
    assert r.status_code == 200 and r.content == published.pack("face-a")


def test_overlong_range_header_is_400(client):
    r = client.get(PACK, headers={"Range": "bytes=0-1" + "," * 5000})
    assert r.status_code == 400 and "too long" in r.json()["error"]


def test_if_range(client, published):
    pack = published.pack("face-a")
    etag = client.head(PACK).headers["etag"]
    r = client.get(PACK, headers={"Range": "bytes=0-9", "If-Range": etag})
    assert r.status_code == 206 and r.content == pack[:10]
    for stale in ['"0000"', f"W/{etag}", "Wed, 21 Oct 2015 07:28:00 GMT"]:
        r = client.get(PACK, headers={"Range": "bytes=0-9", "If-Range": stale})
        assert r.status_code == 200 and r.content == pack, stale


def test_if_match_and_if_none_match_on_pack(client, published):
    etag = client.head(PACK).headers["etag"]
    assert client.get(PACK, headers={"If-None-Match": etag}).status_code == 304
    assert client.get(PACK, headers={"If-Match": etag, "Range": "bytes=0-0"}).status_code == 206
    r = client.get(PACK, headers={"If-Match": '"old"', "Range": "bytes=0-0"})
    assert r.status_code == 412 and "changed" in r.json()["error"]


def test_shard_endpoint_returns_exactly_the_config_bytes(client, published):
    pack = published.pack("face-a")
    manifest = published.manifest("face-a")
    for shard in manifest["shards"]:
        for cfg in shard["configs"]:
            r = client.get(shard_url(shard["index"], cfg["id"]))
            expected = shard_bytes(pack, manifest, shard["index"], cfg["id"])
            assert r.status_code == 200
            assert r.content == expected and len(expected) == cfg["bytes"]
            assert r.headers["x-sakura-sha256"] == hashlib.sha256(expected).hexdigest()
            assert r.headers["x-sakura-pack-etag"] == f'"{manifest["pack_sha256"]}"'
            assert r.headers["content-type"] == "application/octet-stream"
            assert r.headers["etag"] == f'"{manifest["pack_sha256"]}:{shard["index"]}:{cfg["id"]}"'


def test_shard_resume_with_range_and_if_range(client, published):
    pack, manifest = published.pack("face-a"), published.manifest("face-a")
    full = shard_bytes(pack, manifest, 1, 2)
    first = client.get(shard_url(1, 2))
    etag, sha = first.headers["etag"], first.headers["x-sakura-sha256"]
    cut = len(full) // 3
    r = client.get(shard_url(1, 2), headers={"Range": f"bytes={cut}-", "If-Range": etag})
    assert r.status_code == 206
    assert r.headers["content-range"] == f"bytes {cut}-{len(full) - 1}/{len(full)}"
    assert (
        r.headers["x-sakura-sha256"] == sha
    )  # checksum of the whole body, for the assembled result
    assert full[:cut] + r.content == full
    # a range crossing the boundary between two units of the config
    cfg = manifest["shards"][1]["configs"][2]
    boundary = manifest["units"][cfg["units"][0]][1]
    r = client.get(shard_url(1, 2), headers={"Range": f"bytes={boundary - 5}-{boundary + 4},-3"})
    parts = parse_multipart(r.content, r.headers["content-type"])
    assert [p[1] for p in parts] == [full[boundary - 5 : boundary + 5], full[-3:]]
    assert (
        client.get(shard_url(1, 2), headers={"Range": "bytes=0-0", "If-Range": '"other"'}).content
        == full
    )
    assert client.get(shard_url(1, 2), headers={"If-None-Match": etag}).status_code == 304
    h = client.head(shard_url(1, 2))
    assert (
        h.status_code == 200 and h.headers["content-length"] == str(len(full)) and h.content == b""
    )
    assert h.headers["x-sakura-sha256"] == sha


@pytest.mark.parametrize(
    ("url", "status", "message"),
    [
        (shard_url(99, 0), 404, "has no shard 99"),
        (shard_url(0, 99), 404, "has no config 99"),
        ("/v1/templates/face-a/sakura/shards/-1/0", 400, "invalid shard"),
        ("/v1/templates/face-a/sakura/shards/1/x", 400, "invalid config"),
        ("/v1/templates/face-a/sakura/shards/9999999999/0", 400, "invalid shard"),
        ("/v1/templates/face-a/nocodec/shards/0/0", 404, "has no codec"),
        ("/v1/templates/unknown/sakura/shards/0/0", 404, "unknown template"),
        ("/v1/templates/face-a/sakura/shards/0", 404, "no such route"),
    ],
)
def test_shard_errors(client, url, status, message):
    r = client.get(url)
    assert r.status_code == status
    assert message in r.json()["error"]


def test_republish_keeps_old_version_reachable_and_if_range_falls_back(client, published, tmp_path):
    old_pack = published.pack("face-a")
    old = published.packs["face-a"]
    old_etag = client.head(PACK).headers["etag"]
    manifest, path = make_pack(
        tmp_path / "w", "face-a", "sakura", SyntheticSpec(4, 3, 1024, seed=42)
    )
    pub = publish_pack(published.root, "face-a", "sakura", manifest, path)
    update_catalog(published.root, {"face-a": {"codecs": {"sakura": pub}}})
    new_pack = path.read_bytes()
    # a client resuming with the old validator gets the full new pack, never mixed bytes
    r = client.get(PACK, headers={"Range": "bytes=100-", "If-Range": old_etag})
    assert (
        r.status_code == 200
        and r.content == new_pack
        and r.headers["etag"] == f'"{pub.pack_sha256}"'
    )
    assert client.get(MANIFEST).json()["pack_sha256"] == pub.pack_sha256
    r = client.get(PACK, headers={"If-Match": old_etag})
    assert r.status_code == 412
    # the old version stays readable, pinned by pack file name, until GC
    r = client.get(f"{PACK}?pack={old.pack_file}", headers={"Range": "bytes=100-"})
    assert r.status_code == 206 and r.content == old_pack[100:] and r.headers["etag"] == old_etag
    assert "immutable" in r.headers["cache-control"]
    pinned_manifest = client.get(f"{MANIFEST}?pack={old.pack_file}").json()
    assert pinned_manifest["pack_sha256"] == old.pack_sha256
    r = client.get(shard_url(0, 1) + f"?pack={old.pack_file}")
    assert r.content == shard_bytes(old_pack, pinned_manifest, 0, 1)
    assert r.headers["x-sakura-pack-etag"] == old_etag
    r = client.get(f"{PACK}?pack=sakura-0123456789abcdef.pack")
    assert r.status_code == 404 and "not available" in r.json()["error"]
    assert client.get(f"{PACK}?pack=../../catalog.json").status_code == 400


def test_served_state_follows_catalog_json_not_a_stray_manifest_json(client, published, tmp_path):
    """A build killed after swapping manifest.json but before catalog.json changes nothing served."""
    manifest, path = make_pack(
        tmp_path / "w", "face-a", "sakura", SyntheticSpec(4, 3, 1024, seed=7)
    )
    pub = publish_pack(published.root, "face-a", "sakura", manifest, path)
    live = published.root / layout.manifest_key("face-a", "sakura")
    live.write_bytes(
        (published.root / pub.versioned_manifest_key).read_bytes()
    )  # catalog not updated
    r = client.get(MANIFEST)
    assert r.json()["pack_sha256"] == published.packs["face-a"].pack_sha256
    assert client.get(PACK).content == published.pack("face-a")


def test_corrupt_or_missing_files_give_json_errors(client, published):
    pub = published.packs["tryon-b"]
    (published.root / pub.versioned_manifest_key).write_text("{not json")
    r = client.get("/v1/templates/tryon-b/sakura/manifest")
    assert r.status_code == 500 and "invalid" in r.json()["error"]
    assert r.json()["code"] == "publish_broken"
    bad = published.manifest("face-a")
    bad["shards"][0]["configs"][0]["ranges"] = [[0, 10**12]]
    (published.root / published.packs["face-a"].versioned_manifest_key).write_text(json.dumps(bad))
    r = client.get(shard_url(0, 0))
    assert r.status_code == 500 and "outside the pack" in r.json()["error"]
    assert r.json()["code"] == "publish_broken"
    (published.root / pub.versioned_manifest_key).write_bytes(
        (published.root / pub.manifest_key).read_bytes()
    )
    pack_path = published.root / pub.pack_key
    data = pack_path.read_bytes()
    pack_path.write_bytes(data[:-10])  # truncated pack
    r = client.get("/v1/templates/tryon-b/sakura/pack")
    assert r.status_code == 500 and "truncated or corrupt" in r.json()["error"]
    assert r.json()["code"] == "pack_damaged"
    assert f"has {len(data) - 10} bytes, its manifest says {len(data)}" in r.json()["error"]
    pack_path.unlink()
    r = client.get("/v1/templates/tryon-b/sakura/pack")
    assert r.status_code == 500 and "missing" in r.json()["error"]
    assert r.json()["code"] == "publish_broken"
    (published.root / "catalog.json").unlink()
    r = client.get("/v1/templates")
    assert r.status_code == 503 and "catalog.json" in r.json()["error"]
    assert r.json()["code"] == "catalog_missing"


def test_errors_are_json_never_tracebacks(client):
    for method, url in [
        ("GET", "/nope"),
        ("POST", PACK),
        ("DELETE", "/v1/templates"),
        ("GET", "/v1/templates/a/b/c/d/e/f/g"),
    ]:
        r = client.request(method, url)
        assert r.status_code in (404, 405)
        assert set(r.json()) == {"error", "code"}
        assert r.json()["code"] == ("not_found" if r.status_code == 404 else "method_not_allowed")
        assert "Traceback" not in r.text


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a text exposition: (name, its labels) -> value (label order aside)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_bytes_and_latency(client, published):
    client.get(PACK, headers={"Range": "bytes=0-99"})
    client.get(shard_url(0, 0))
    client.get("/v1/templates/zzz")
    text = client.get("/metrics").text
    assert client.get("/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    got = _samples(text)
    pack_route = "/v1/templates/{template_id}/{codec}/pack"
    shard_route = "/v1/templates/{template_id}/{codec}/shards/{shard}/{config}"

    def value(name: str, **labels: str) -> float | None:
        return got.get((name, frozenset(labels.items())))

    assert value("sakura_http_requests_total", route=pack_route, method="GET", status="206") == 1
    assert value("sakura_http_requests_total", route="/v1/templates/{template_id}",
                 method="GET", status="404") == 1
    size = len(shard_bytes(published.pack("face-a"), published.manifest("face-a"), 0, 0))
    assert value("sakura_http_response_bytes_total", route=shard_route) == size
    assert value("sakura_http_response_bytes_total", route=pack_route) == 100
    assert value("sakura_http_request_duration_seconds_bucket", route=pack_route, le="+Inf") == 1
    assert value("sakura_http_requests_in_flight") == 1  # this /metrics request itself


def test_duplicate_range_headers_are_ignored(client, published):
    r = client.get(PACK, headers=[("Range", "bytes=0-0"), ("Range", "bytes=1-1")])
    assert r.status_code == 200 and r.content == published.pack("face-a")



def test_manifest_is_gzipped_when_accepted_and_identical_after_decoding(client):
    plain = client.get(MANIFEST, headers={"Accept-Encoding": "identity"})
    zipped = client.get(MANIFEST, headers={"Accept-Encoding": "gzip"})
    assert plain.status_code == zipped.status_code == 200
    assert "content-encoding" not in plain.headers
    assert zipped.headers["content-encoding"] == "gzip"
    assert zipped.headers["vary"] == "Accept-Encoding"
    # two representations, two strong ETags; each revalidates only itself
    assert zipped.headers["etag"] == plain.headers["etag"][:-1] + '-gzip"'
    assert zipped.content == plain.content  # decoded transparently, byte-identical
    for etag, coding, status in ((zipped, "gzip", 304), (plain, "identity", 304),
                                 (zipped, "identity", 200), (plain, "gzip", 200)):
        r = client.get(MANIFEST, headers={"Accept-Encoding": coding,
                                          "If-None-Match": etag.headers["etag"]})
        assert r.status_code == status, (coding, status)
    for refuse in ("gzip;q=0", "*;q=0.5, gzip;q=0", "identity", "br", "gzip; q=0.000"):
        r = client.get(MANIFEST, headers={"Accept-Encoding": refuse})
        assert "content-encoding" not in r.headers, refuse
    for accept in ("*", "br;q=1, *;q=0.1", "GZIP;q=0.5", "x-gzip"):
        r = client.get(MANIFEST, headers={"Accept-Encoding": accept})
        assert r.headers["content-encoding"] == "gzip", accept


def test_healthz_names_a_truncated_or_missing_pack(client, published):
    """A pack whose size is not its manifest's pack_bytes is degraded at once, before any
    request has failed on it (issue 29: it used to stay ok after 58 such errors)."""
    pub = published.packs["tryon-b"]
    path = published.root / pub.pack_key
    good = path.read_bytes()
    path.write_bytes(good[:-100])
    health = client.get("/healthz").json()
    assert health["status"] == "degraded"
    [entry] = health["damaged"]
    assert entry["pack"] == pub.pack_key and entry["code"] == "pack_damaged"
    assert f"has {len(good) - 100} bytes, its manifest says {len(good)}" in entry["error"]
    path.unlink()
    [entry] = client.get("/healthz").json()["damaged"]
    assert entry["pack"] == pub.pack_key and entry["code"] == "publish_broken"
    assert "missing" in entry["error"]
    path.write_bytes(good)  # repaired: healthy again, no restart
    assert client.get("/healthz").json() == {"status": "ok", "damaged": []}


def test_every_error_body_has_a_documented_code(client, published):
    from sakura.cloud.errors import ErrorCode

    cases = [
        ("/v1/templates/Bad!", 400, "bad_request"),
        ("/v1/templates/face-a/sakura/shards/x/0", 400, "bad_request"),
        ("/v1/templates/nope/sakura/pack", 404, "unknown_template"),
        ("/v1/templates/face-a/nope/pack", 404, "unknown_codec"),
        ("/v1/templates/face-a/sakura/shards/99/0", 404, "not_found"),
        ("/v1/templates/face-a/sakura/pack?pack=sakura-0123456789abcdef.pack", 404,
         "version_gone"),
        ("/nope", 404, "not_found"),
    ]
    for url, status, code in cases:
        r = client.get(url)
        assert (r.status_code, r.json()["code"]) == (status, code), url
    r = client.get(PACK, headers={"Range": "bytes=" + ",".join(["0-0"] * 65)})
    assert (r.status_code, r.json()["code"]) == (400, "bad_range")
    r = client.get(PACK, headers={"Range": "bytes=999999-"})
    assert (r.status_code, r.json()["code"]) == (416, "range_not_satisfiable")
    r = client.get(PACK, headers={"If-Match": '"other"'})
    assert (r.status_code, r.json()["code"]) == (412, "precondition_failed")
    r = client.post(PACK)
    assert (r.status_code, r.json()["code"]) == (405, "method_not_allowed")
    assert set(ErrorCode.PERMANENT) | set(ErrorCode.TRANSIENT) | {ErrorCode.VERSION_GONE} == set(
        ErrorCode.ALL)
