"""The device bundle (issue 31, items 1 and 5): graphs exported in the cloud, published beside
the packs, served verified, downloaded once by the device, checked and used instead of an
export on the device.

One small bundle of the tiny world (its graphs through a module-scoped export; the tiny
model's prompts come from the tests' fake encoder, so this bundle has no text encoder; the
shipped model's bundle with MiniLM's program is what ``sakura bench bundle`` measures),
served by ``sakura serve``'s app over real sockets.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import httpx
import pytest
from sakura.cloud.build import has_bundle
from sakura.cloud.bundle import publish_bundle
from sakura.cloud.publish import update_catalog
from sakura.codec.manifest import bundle_key, parse_bundle
from sakura.edge.backends.base import BackendConfig, weights_sha256
from sakura.edge.bundle import TABLE_ARRAYS, DeviceBundles, bundle_is_current, export_bundle
from sakura.edge.errors import EdgeError, IntegrityError, OriginError
from sakura.edge.retry import RetryPolicy
from sakura.edge.runtime import EdgeRuntime, EditOptions

from sakura.bundle_cli import export_for_build
from tests.edge.helpers import TEMPLATE_ID, FakeEncoder, FaultyApp, RecordingApp, serve_catalog
from tests.edge.test_edit import PROMPT, SEED

STREAM_ONLY = EditOptions(local_fallback=False)
BPS = 2  # the world's packs' blocks per shard


@pytest.fixture(scope="module")
def bundled(world, tmp_path_factory, compiled_dir):
    """A copy of the world's catalog with the template's device bundle published (exported
    through the session's compiled-graph folder: the builder's cache, so graphs the native
    tests exported already are not exported twice)."""
    root = tmp_path_factory.mktemp("bundled")
    catalog = root / "catalog"
    shutil.copytree(world.catalog_dir, catalog)
    req = world.runtime().request(PROMPT, SEED)
    made = export_bundle(world.model, weights_sha256(world.model), world.template, req, BPS,
                         cache_dir_=compiled_dir, text_encoder=False,
                         work=root / "work")
    entry = publish_bundle(catalog, made.files, made.doc)
    update_catalog(catalog, {TEMPLATE_ID: {"bundle": entry}})
    return catalog, entry


def device(world, cache: Path) -> EdgeRuntime:
    return EdgeRuntime(world.model, encoder=FakeEncoder(), runtime="native",
                       backend_config=BackendConfig(cache_dir=cache))


def copy_of(catalog: Path, tmp_path: Path) -> Path:
    out = tmp_path / "catalog"
    shutil.copytree(catalog, out)
    return out


def test_catalog_lists_every_file_with_its_checksum(bundled):
    catalog, entry = bundled
    names = {f["name"] for f in entry["files"]}
    assert {"cached-step_in.pte", "cached-group0.pte", "cached-step_out.pte",
            "full-step_in.pte", "full-group0.pte", "template-step_in.pte",
            "template-group0.pte", "tables.bin"} <= names
    for f in entry["files"]:
        assert f["key"] == f"bundles/{f['sha256'][:16]}/{f['name']}"
        assert (catalog / f["key"]).stat().st_size == f["bytes"]
    published = json.loads((catalog / "catalog.json").read_text())
    assert published["templates"][TEMPLATE_ID]["bundle"] == entry


def test_native_edit_uses_the_bundle_and_exports_nothing(world, bundled, native_runtime,
                                                         tmp_path):
    catalog, entry = bundled
    req = native_runtime.request(PROMPT, SEED)
    with serve_catalog(world.catalog_dir) as server:  # no bundle: exported on the device
        exported = native_runtime.edit(server.url, TEMPLATE_ID, world.template, req, "fp16",
                                       options=STREAM_ONLY)
    recorder = None

    def wrap(app):
        nonlocal recorder
        recorder = RecordingApp(app)
        return recorder

    dev = device(world, tmp_path / "phone")
    with serve_catalog(catalog, wrap=wrap) as server:
        got = dev.edit(server.url, TEMPLATE_ID, world.template, req, "fp16",
                       options=STREAM_ONLY)
    engine = dev.native
    assert engine.compiles == 0  # every graph came from the bundle
    assert dev.runner.bundles.downloaded == len(entry["files"])
    assert (got.image - exported.image).abs().max().item() <= 1e-5
    # the bundle's requests name only content addresses: nothing of the request
    keys = {f["key"] for f in entry["files"]}
    bundle_requests = [r for r in recorder.requests if r["path"].startswith("/bundles/")]
    assert {r["path"].lstrip("/") for r in bundle_requests} == keys
    for r in recorder.requests:
        assert r["query"] == "" and r["body"] == b""
        assert PROMPT not in json.dumps(r["headers"]) and str(SEED) not in r["path"]
    # a second device process on the same cache downloads nothing
    again = device(world, tmp_path / "phone")
    with serve_catalog(catalog) as server:
        again.edit(server.url, TEMPLATE_ID, world.template, req, "fp16", options=STREAM_ONLY)
    assert again.runner.bundles.downloaded == 0 and again.native.compiles == 0


def test_a_corrupted_bundle_file_is_one_clear_error(world, bundled, tmp_path):
    """An origin that does not check (a corrupted transfer, a bad mirror) hands the device
    wrong bytes: one line naming the file, nothing cached, no export."""
    catalog, _entry = bundled
    dev = device(world, tmp_path / "phone")
    req = dev.request(PROMPT, SEED)
    with serve_catalog(catalog, wrap=lambda app: FaultyApp(app, "full-group0.pte",
                                                           "corrupt")) as server:
        with pytest.raises(IntegrityError) as err:
            dev.edit(server.url, TEMPLATE_ID, world.template, req, "fp16",
                     options=STREAM_ONLY)
    text = str(err.value)
    assert "\n" not in text and "full-group0.pte" in text and "checksum" in text
    assert dev.native.compiles == 0
    assert not any((tmp_path / "phone" / "bundles").rglob("full-group0.pte"))


def test_the_server_refuses_to_vouch_for_a_damaged_bundle_file(world, bundled, tmp_path):
    catalog = copy_of(bundled[0], tmp_path)
    entry = bundled[1]
    f = next(f for f in entry["files"] if f["name"] == "cached-group0.pte")
    path = catalog / f["key"]
    good = path.read_bytes()
    path.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    with serve_catalog(catalog) as server:
        r = httpx.get(f"{server.url}/{f['key']}")
        assert r.status_code == 500 and r.json()["code"] == "pack_damaged"
        assert f["key"] in r.json()["error"]
        health = httpx.get(f"{server.url}/healthz").json()
        assert health["status"] == "degraded"
        assert [d["pack"] for d in health["damaged"]] == [f["key"]]
        dev = device(world, tmp_path / "phone")
        with pytest.raises(OriginError) as err:
            dev.edit(server.url, TEMPLATE_ID, world.template, dev.request(PROMPT, SEED),
                     "fp16", options=STREAM_ONLY)
        assert "cached-group0.pte" in str(err.value) and "\n" not in str(err.value)
        path.write_bytes(good)  # repaired: served again, health ok
        path.touch()
        r = httpx.get(f"{server.url}/{f['key']}")
        assert r.status_code == 200 and r.content == good
        assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"
        # a file no template lists is not served
        assert httpx.get(f"{server.url}/bundles/{'0' * 16}/x.pte").status_code == 404


def test_a_bundle_for_another_graphs_format_or_model_is_refused(world, bundled, tmp_path):
    catalog = copy_of(bundled[0], tmp_path)
    for field, value, words in (("graphs_format", 99, "graphs format is 99"),
                                ("weights_sha256", "f" * 64, "model weights ffffffffffff")):
        doc = dict(bundled[1], **{field: value})
        update_catalog(catalog, {TEMPLATE_ID: {"bundle": doc}})
        dev = device(world, tmp_path / f"phone-{field}")
        with serve_catalog(catalog) as server:
            with pytest.raises(EdgeError, match="refused") as err:
                dev.edit(server.url, TEMPLATE_ID, world.template,
                         dev.request(PROMPT, SEED), "fp16", options=STREAM_ONLY)
        assert words in str(err.value)
        assert dev.runner.bundles.downloaded == 0 and dev.native.compiles == 0


def test_without_a_bundle_the_device_exports_and_says_so_once(world, native_runtime):
    """The note comes with the export: once when this device exports graphs, never when
    its graphs are in the compiled cache already (a warm `sakura edit` printed it too)."""
    said: list[str] = []
    bundles = native_runtime.runner.bundles
    saved = bundles.say
    bundles.say = said.append
    native = native_runtime.native
    try:
        req = native_runtime.request(PROMPT, SEED)
        with serve_catalog(world.catalog_dir) as server:
            for _ in range(2):
                before = native.compiles
                native_runtime.edit(server.url, TEMPLATE_ID, world.template, req, "fp16",
                                    options=STREAM_ONLY)
                exported = native.compiles > before
                assert len(said) == int(exported) and all("no device bundle" in s
                                                          for s in said)
                said.clear()
    finally:
        bundles.say = saved
    assert native._bundled == {}  # the device's own graphs ran


def test_files_with_the_same_bytes_are_kept_under_every_name(bundled, tmp_path):
    """An int8 bundle's graph sets reuse the fp32 sets' step_in / step_out bytes under
    other names: the device downloads those bytes once and keeps them under both names
    (it stored one folder per checksum and rewrote it per name, losing the first)."""
    catalog, entry = bundled
    doc = json.loads(json.dumps(entry))
    first = next(f for f in doc["files"] if f["name"].endswith("step_in.pte"))
    alias = "alias-" + first["name"]  # listed after the first: its key is the one fetched
    doc["files"].append({**first, "name": alias, "key": bundle_key(alias, first["sha256"])})
    bundle = parse_bundle(doc)
    device = DeviceBundles(tmp_path / "bundles", say=lambda _l: None)
    with serve_catalog(catalog) as server:
        paths = device.fetch(bundle, server.url, TEMPLATE_ID, None, RetryPolicy())
        assert device.downloaded == len(entry["files"])  # the alias's bytes: not again
        again = DeviceBundles(tmp_path / "bundles", say=lambda _l: None)
        assert again.fetch(bundle, server.url, TEMPLATE_ID, None, RetryPolicy()) == paths
        assert again.downloaded == 0
    a, b = paths[first["name"]], paths[alias]
    assert a.parent == b.parent and a.read_bytes() == b.read_bytes()
    assert a.stat().st_size == first["bytes"]


def test_a_stale_published_bundle_is_exported_again(bundled, tmp_path):
    """A bundle published before the exporter wrote txt_in or the recompute step's
    ``template`` graphs (or for another graphs format) is not current, so ``sakura build`` re-exports it instead of skipping the template
    (sakura-edge refuses such a bundle and tells the user to run ``sakura build``)."""
    catalog, entry = bundled
    assert tuple(entry["tables"]["arrays"]) == TABLE_ARRAYS  # the rule names what is written
    assert bundle_is_current(entry) and export_for_build.is_current(entry)
    assert has_bundle(catalog, TEMPLATE_ID, export_for_build.is_current)
    old = copy.deepcopy(entry)
    del old["tables"]["arrays"]["txt_in_weight"], old["tables"]["arrays"]["txt_in_bias"]
    other = dict(entry, graphs_format=entry["graphs_format"] + 1)
    # before the recompute step's graphs (2026-12-06)
    no_template = dict(entry, graph_sets=[gs for gs in entry["graph_sets"]
                                          if gs["name"] != "template"])
    assert len(no_template["graph_sets"]) == len(entry["graph_sets"]) - 1
    assert not any(bundle_is_current(e) for e in (old, other, no_template))
    out = copy_of(catalog, tmp_path)
    doc = json.loads((out / "catalog.json").read_text())
    doc["templates"][TEMPLATE_ID]["bundle"] = old
    (out / "catalog.json").write_text(json.dumps(doc))
    assert has_bundle(out, TEMPLATE_ID)  # files all there: only the exporter's rule sees it
    assert not has_bundle(out, TEMPLATE_ID, export_for_build.is_current)
