"""sakura.cloud.publish: atomic publish, the catalog written last, failure injection, GC, hashes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import sakura.cloud.publish as publish
from sakura.cloud import layout
from sakura.cloud.errors import PublishError
from sakura.cloud.publish import (
    CatalogTransaction,
    collect_garbage,
    is_up_to_date,
    mirror_to_storage,
    publish_pack,
    read_catalog,
    template_content_hash,
    update_catalog,
)
from sakura.cloud.synthetic import SyntheticSpec, make_pack

SPEC = SyntheticSpec(shards=3, configs=2, unit_bytes=512)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root except the lock file (bytes by relative path)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != publish.LOCK_NAME
    }


def published_view(root: Path) -> dict[str, bytes]:
    """What a reader of the catalog can reach: catalog.json and every file it references."""
    catalog = read_catalog(root)
    return {k: (root / k).read_bytes() for k in sorted(publish.referenced_keys(catalog))}


def new_pack(work: Path, template_id: str, seed: int):
    return make_pack(
        work, template_id, "sakura", SyntheticSpec(SPEC.shards, SPEC.configs, SPEC.unit_bytes, seed)
    )


def publish_one(root: Path, work: Path, template_id: str, seed: int, **meta):
    manifest, pack = new_pack(work, template_id, seed)
    pub = publish_pack(root, template_id, "sakura", manifest, pack)
    return update_catalog(root, {template_id: {"codecs": {"sakura": pub}, **meta}}), pub


def test_publish_then_update_writes_the_layout(tmp_path: Path):
    root, work = tmp_path / "out", tmp_path / "work"
    manifest, pack = new_pack(work, "face-a", 1)
    manifest["pack_file"] = "whatever-the-codec-wrote.pack"
    pub = publish_pack(root, "face-a", "sakura", manifest, pack)
    assert pub.pack_file == layout.pack_file_name("sakura", pub.pack_sha256)
    assert (root / pub.pack_key).read_bytes() == pack.read_bytes()
    assert not (root / layout.CATALOG_KEY).exists()  # not live yet
    assert not (root / pub.manifest_key).exists()
    catalog = update_catalog(
        root, {"face-a": {"codecs": {"sakura": pub}, "workload": "face-swap", "mask_ratio": 0.1}}
    )
    on_disk = json.loads((root / "catalog.json").read_text())
    assert on_disk == catalog
    entry = on_disk["templates"]["face-a"]
    assert entry["workload"] == "face-swap"
    assert entry["codecs"]["sakura"] == {
        "manifest": "templates/face-a/sakura/manifest.json",
        "pack_file": pub.pack_file,
        "pack_sha256": pub.pack_sha256,
        "pack_bytes": pub.pack_bytes,
        "stored_bytes": pub.stored_bytes,
    }
    live = json.loads((root / "templates/face-a/sakura/manifest.json").read_text())
    assert live["pack_file"] == pub.pack_file and live["pack_sha256"] == pub.pack_sha256
    assert (root / pub.versioned_manifest_key).read_bytes() == (
        root / pub.manifest_key
    ).read_bytes()
    assert not [p for p in root.rglob(".tmp-*")]


def test_publish_rejects_a_manifest_that_does_not_match_the_pack(tmp_path: Path):
    manifest, pack = new_pack(tmp_path, "face-a", 1)
    with pytest.raises(PublishError, match="pack_sha256"):
        publish_pack(
            tmp_path / "o", "face-a", "sakura", {**manifest, "pack_sha256": "0" * 64}, pack
        )
    with pytest.raises(PublishError, match="template_id"):
        publish_pack(tmp_path / "o", "face-b", "sakura", manifest, pack)
    with pytest.raises(PublishError, match="invalid template id"):
        publish_pack(tmp_path / "o", "../x", "sakura", manifest, pack)
    bad = json.loads(json.dumps(manifest))
    bad["shards"][0]["configs"][0]["ranges"][0] = [10**9, 5]
    with pytest.raises(PublishError, match="outside the pack"):
        publish_pack(tmp_path / "o", "face-a", "sakura", bad, pack)
    with pytest.raises(PublishError, match="does not exist"):
        publish_pack(tmp_path / "o", "face-a", "sakura", manifest, tmp_path / "nope.pack")
    with pytest.raises(PublishError, match="was not published"):
        update_catalog(
            tmp_path / "o",
            {"face-a": {"codecs": {"sakura": {"pack_file": "sakura-0000000000000000.pack"}}}},
        )


@pytest.mark.parametrize("fail_on", ["catalog", "second-manifest", "first-manifest"])
def test_a_failure_while_committing_leaves_the_published_catalog_as_it_was(
    tmp_path: Path, monkeypatch, fail_on
):
    root, work = tmp_path / "out", tmp_path / "work"
    publish_one(root, work, "face-a", 1)
    publish_one(root, work, "tryon-b", 2)
    before_files = snapshot(root)
    before_view = published_view(root)
    new = {}
    for i, tid in enumerate(["face-a", "tryon-b"]):
        manifest, pack = new_pack(work, tid, 10 + i)
        new[tid] = {
            "codecs": {"sakura": publish_pack(root, tid, "sakura", manifest, pack)},
            "resolution": 128,
        }
    assert published_view(root) == before_view  # publish_pack alone changes nothing visible

    real = publish.atomic_write
    calls = {"manifest": 0}

    def failing(path, data, **kw):
        if path.name == "catalog.json" and fail_on == "catalog":
            raise OSError("injected: disk full")
        if path.name == "manifest.json":
            calls["manifest"] += 1
            if (fail_on == "second-manifest" and calls["manifest"] == 2) or (
                fail_on == "first-manifest" and calls["manifest"] == 1
            ):
                raise OSError("injected: I/O error")
        return real(path, data, **kw)

    monkeypatch.setattr(publish, "atomic_write", failing)
    with pytest.raises(PublishError, match="injected"):
        update_catalog(root, new)
    monkeypatch.setattr(publish, "atomic_write", real)
    assert published_view(root) == before_view
    after = snapshot(root)
    # the only new files are the immutable, unreferenced new versions (left for GC)
    assert {k: v for k, v in after.items() if k in before_files} == before_files
    extra = set(after) - set(before_files)
    assert extra and all(
        k.endswith((".pack", ".manifest.json")) and "/manifest.json" not in k for k in extra
    )
    assert not [p for p in root.rglob(".tmp-*")]


def test_an_exception_inside_a_transaction_commits_nothing(tmp_path: Path):
    root, work = tmp_path / "out", tmp_path / "work"
    publish_one(root, work, "face-a", 1)
    before = published_view(root)
    with pytest.raises(RuntimeError, match="model run crashed"):
        with CatalogTransaction(root) as txn:
            manifest, pack = new_pack(work, "face-a", 5)
            txn.publish("face-a", "sakura", manifest, pack, {"resolution": 256})
            raise RuntimeError("model run crashed")
    assert published_view(root) == before
    with CatalogTransaction(root) as txn:
        manifest, pack = new_pack(work, "face-a", 5)
        pub = txn.publish("face-a", "sakura", manifest, pack, {"resolution": 256})
    assert (
        read_catalog(root)["templates"]["face-a"]["codecs"]["sakura"]["pack_file"] == pub.pack_file
    )
    assert read_catalog(root)["templates"]["face-a"]["resolution"] == 256


def test_update_merges_metadata_and_codecs_and_removes(tmp_path: Path):
    root, work = tmp_path / "out", tmp_path / "work"
    publish_one(root, work, "face-a", 1, workload="face-swap", note="keep")
    manifest, pack = make_pack(work, "face-a", "intq", SPEC)
    pub = publish_pack(root, "face-a", "intq", manifest, pack)
    catalog = update_catalog(root, {"face-a": {"codecs": {"intq": pub}, "workload": "face-swap-2"}})
    entry = catalog["templates"]["face-a"]
    assert set(entry["codecs"]) == {"sakura", "intq"}
    assert entry["workload"] == "face-swap-2" and entry["note"] == "keep"
    catalog = update_catalog(root, {}, remove=["face-a"])
    assert catalog["templates"] == {}


def test_republishing_identical_bytes_is_idempotent(tmp_path: Path):
    root, work = tmp_path / "out", tmp_path / "work"
    _, first = publish_one(root, work, "face-a", 1)
    before = snapshot(root)
    _, second = publish_one(root, work, "face-a", 1)
    assert first == second
    assert snapshot(root) == before


def test_content_hash_and_up_to_date(tmp_path: Path):
    root, work = tmp_path / "out", tmp_path / "work"
    image = tmp_path / "template.png"
    image.write_bytes(b"pixels")
    spec = {"id": "face-a", "prompt": "a face", "steps": 8, "mask_ratio": 0.12}
    h1 = template_content_hash(spec, [image], salt="builder-1")
    assert h1.startswith("sha256:") and len(h1) == 71
    assert (
        template_content_hash(dict(reversed(list(spec.items()))), [image], salt="builder-1") == h1
    )
    assert template_content_hash({**spec, "steps": 9}, [image], salt="builder-1") != h1
    assert template_content_hash(spec, [image], salt="builder-2") != h1
    assert not is_up_to_date(root, "face-a", h1)
    publish_one(root, work, "face-a", 1, content_hash=h1)
    assert is_up_to_date(root, "face-a", h1)
    assert is_up_to_date(root, "face-a", h1, verify=True)
    assert not is_up_to_date(root, "face-a", h1, codecs=("sakura", "intq"))
    image.write_bytes(b"other pixels")
    h2 = template_content_hash(spec, [image], salt="builder-1")
    assert h2 != h1 and not is_up_to_date(root, "face-a", h2)
    pack = root / read_catalog(root)["templates"]["face-a"]["codecs"]["sakura"]["pack_file"]
    pack = root / "templates/face-a/sakura" / pack.name
    with open(pack, "r+b") as f:
        f.write(b"\x00\x01")
    assert is_up_to_date(root, "face-a", h1)  # size unchanged: only verify re-hashes
    assert not is_up_to_date(root, "face-a", h1, verify=True)
    os.truncate(pack, 10)
    assert not is_up_to_date(root, "face-a", h1)


def test_garbage_collection_respects_the_grace_period(tmp_path: Path):
    root, work = tmp_path / "out", tmp_path / "work"
    _, old = publish_one(root, work, "face-a", 1)
    (root / "templates/face-a/sakura/.tmp-stale").write_bytes(b"x")
    _, new = publish_one(root, work, "face-a", 2)
    assert (root / old.pack_key).exists()  # superseded, still readable
    assert collect_garbage(root, grace_s=3600) == []
    later = time.time() + 3601
    removed = collect_garbage(root, grace_s=3600, now=later, dry_run=True)
    assert removed == sorted(
        [old.pack_key, old.versioned_manifest_key, "templates/face-a/sakura/.tmp-stale"]
    )
    assert (root / old.pack_key).exists()
    assert collect_garbage(root, grace_s=3600, now=later) == removed
    assert not (root / old.pack_key).exists()
    assert (root / new.pack_key).exists() and (root / new.manifest_key).exists()


def test_mirror_to_storage_uploads_catalog_last(tmp_path: Path):
    root, work = tmp_path / "out", tmp_path / "work"
    publish_one(root, work, "face-a", 1)

    class Recorder(publish.Storage):
        def __init__(self):
            self.keys = []

        def put_atomic(self, key, data):
            self.keys.append(key)

        def size(self, key):
            raise publish.ManifestError("absent")

        stat = open = list = delete = describe = None

    rec = Recorder()
    uploaded = mirror_to_storage(root, rec)
    assert rec.keys == uploaded and uploaded[-1] == "catalog.json"
    assert uploaded.index("templates/face-a/sakura/manifest.json") > max(
        i for i, k in enumerate(uploaded) if k.endswith(".pack")
    )
