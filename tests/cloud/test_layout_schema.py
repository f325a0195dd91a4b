"""The serving layout validates manifests through the codec's schema (issue 30 item 2):
one definition of the constants, the codec's reader and ``layout.validate_manifest`` agree
on every document, and the synthetic catalogs the serve bench publishes are valid."""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import os
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sakura.cloud import layout
from sakura.cloud.errors import ManifestError
from sakura.cloud.synthetic import SyntheticSpec, make_pack
from sakura.codec import get_codec
from sakura.codec import manifest as schema
from sakura.codec.errors import PackError
from sakura.codec.pack import Manifest, write_pack
from sakura.dit.synthetic import synthetic_cache
from sakura.edge import client
from sakura.edge.errors import EdgeError

from tests.sakura.test_fuzz_inputs import json_values, mutated

SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None,
                    database=None, suppress_health_check=[HealthCheck.too_slow,
                                                          HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def codec_doc(tmp_path_factory) -> dict[str, Any]:
    """A manifest as the builder writes it (sakura codec, 2 steps x 3 blocks)."""
    cache = synthetic_cache(steps=2, blocks=3, grid=4, channels=16, heads=2, rank=4, seed=1)
    m = write_pack(tmp_path_factory.mktemp("pack"), "tpl", cache, get_codec("sakura"),
                   blocks_per_shard=2, model={"name": "synthetic"})
    return json.loads(m.to_json())


def test_the_constants_and_patterns_are_defined_once():
    assert layout.MANIFEST_FORMAT is schema.FORMAT and layout.MANIFEST_VERSION is schema.VERSION
    assert client.MANIFEST_FORMAT is schema.FORMAT and client.MANIFEST_VERSION is schema.VERSION
    assert layout.TEMPLATE_ID_RE.pattern == schema.TEMPLATE_ID_PATTERN
    assert layout.CODEC_RE.pattern == schema.CODEC_PATTERN
    assert layout.PACK_FILE_RE.pattern == schema.PACK_FILE_PATTERN
    assert layout.SHA256_RE.pattern == schema.SHA256_PATTERN


def test_the_synthetic_packs_of_the_serve_bench_are_valid(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    doc, path = make_pack(tmp_path, "face-a", "sakura", SyntheticSpec(5, 3, 1024, seed=7))
    jsonschema.Draft202012Validator(json.loads(schema.SCHEMA_PATH.read_text())).validate(doc)
    model = schema.PackManifest.model_validate(doc)
    index = layout.validate_manifest(doc, template_id="face-a", codec="sakura",
                                     pack_size=path.stat().st_size)
    assert index.units == tuple(tuple(u) for u in doc["units"])
    assert index.configs == {
        (s.index, c.id): layout.ConfigEntry(s.index, c.id, tuple(tuple(r) for r in c.ranges),
                                            c.bytes, tuple(c.units))
        for s in model.shards for c in s.configs}


def test_the_index_of_a_builder_manifest(codec_doc):
    index = layout.validate_manifest(codec_doc, template_id="tpl", codec="sakura",
                                     pack_size=codec_doc["pack_bytes"])
    assert (index.pack_file, index.pack_bytes) == (codec_doc["pack_file"],
                                                   codec_doc["pack_bytes"])
    cfg = codec_doc["shards"][1]["configs"][-1]
    entry = index.config(1, cfg["id"])
    assert entry.ranges == (tuple(cfg["ranges"][0]),) and entry.nbytes == cfg["bytes"]
    assert entry.units == tuple(cfg["units"])


@pytest.mark.parametrize("kwargs,match", [
    ({"template_id": "other"}, "manifest is for template 'tpl', expected 'other'"),
    ({"codec": "fp16"}, "manifest is for codec 'sakura', expected 'fp16'"),
    ({"pack_size": 1}, r"has 1 bytes but the manifest says \d+"),
])
def test_the_serving_checks_beyond_the_schema(codec_doc, kwargs, match):
    with pytest.raises(ManifestError, match=match):
        layout.validate_manifest(codec_doc, **kwargs)


def test_a_schema_error_reads_the_same_in_cloud_and_codec(codec_doc):
    bad = json.loads(json.dumps(codec_doc))
    bad["shards"][0]["configs"][0]["ranges"] = [[0, 10**12]]
    with pytest.raises(ManifestError) as cloud:
        layout.validate_manifest(bad)
    with pytest.raises(PackError) as codec:
        Manifest.from_dict(bad)
    assert str(cloud.value) == str(codec.value)
    assert "shard 0 config 0 range [0, +1000000000000) lies outside the pack" in str(cloud.value)


@SETTINGS
@given(data=st.data())
def test_cloud_and_codec_agree_on_any_manifest(codec_doc, data):
    """Whatever the document: only the projects' errors come out; what the codec's reader
    accepts the server accepts; what the server refuses the codec refuses, with the same
    message (the server adds no rule of its own without ``template_id``/``codec``/
    ``pack_size``; the codec adds the shard layout)."""
    doc = data.draw(st.one_of(json_values, mutated(codec_doc)))
    try:
        Manifest.from_dict(doc)
        codec_error = None
    except PackError as exc:
        codec_error = str(exc)
    try:
        layout.validate_manifest(doc)
        cloud_error = None
    except ManifestError as exc:
        cloud_error = str(exc)
    if codec_error is None:
        assert cloud_error is None
    if cloud_error is not None:
        assert codec_error == cloud_error


CATALOG = {"version": 1, "templates": {"face-a": {"workload": "face-swap", "codecs": {
    "sakura": {"manifest": "templates/face-a/sakura/manifest.json",
               "pack_file": "sakura-0123456789abcdef.pack"}}}}}


@SETTINGS
@given(doc=st.one_of(json_values, mutated(CATALOG)))
def test_any_catalog_is_checked_or_refused(doc):
    try:
        layout.validate_catalog(doc)
    except ManifestError:
        pass


def test_a_deeply_nested_manifest_from_a_plain_origin_is_an_edge_error(tmp_path):
    """A static origin (no server-side check) serving nesting json.loads cannot take: the
    client's one EdgeError, not a RecursionError."""
    folder = tmp_path / "templates" / "tpl" / "sakura"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_bytes(b'{"format": "sakura-pack", "shards": '
                                           + b"[" * 100_000)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    async def fetch() -> None:
        async with client.PackClient(f"http://127.0.0.1:{server.server_address[1]}") as c:
            await c.manifest("tpl", "sakura")

    try:
        with pytest.raises(EdgeError, match="manifest.json is not valid JSON"):
            asyncio.run(fetch())
    finally:
        server.shutdown()
        server.server_close()
    assert client._error_code(b"[" * 100_000) is None
    assert client._error_message(b"[" * 100_000).startswith("[[[")
