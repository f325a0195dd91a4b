"""sakura.cloud.storage: the same contract for the local folder and an S3 server (moto on loopback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sakura.cloud.errors import ObjectChanged, ObjectNotFound, StorageError, UnsafeKey
from sakura.cloud.storage import LocalStorage, S3Storage, open_storage, validate_key


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path: Path):
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"b-{abs(hash(request.node.name)) % 10**8}"
    make_bucket(endpoint, bucket)
    return S3Storage(bucket, "some/prefix", endpoint)


def test_put_read_stat_list_delete(storage, tmp_path: Path):
    data = os.urandom(700_000)
    info = storage.put_atomic("templates/a/sakura/x.pack", data)
    assert info.size == len(data)
    assert storage.size("templates/a/sakura/x.pack") == len(data)
    assert storage.exists("templates/a/sakura/x.pack")
    assert storage.read_bytes("templates/a/sakura/x.pack") == data
    chunks = list(storage.open_range("templates/a/sakura/x.pack", 1000, 300_000, chunk_size=65536))
    assert all(len(c) <= 65536 for c in chunks)
    assert b"".join(chunks) == data[1000:300_000]
    assert b"".join(storage.open_range("templates/a/sakura/x.pack", 699_990)) == data[699_990:]
    src = tmp_path / "src.bin"
    src.write_bytes(b"hello")
    storage.put_atomic("catalog.json", src)
    assert storage.read_bytes("catalog.json") == b"hello"
    assert storage.list() == ["catalog.json", "templates/a/sakura/x.pack"]
    assert storage.list("templates/a") == ["templates/a/sakura/x.pack"]
    assert storage.list("nothing/here") == []
    old = storage.etag("catalog.json")
    storage.put_atomic("catalog.json", b"hello, world")
    assert storage.etag("catalog.json") != old
    storage.delete("catalog.json")
    storage.delete("catalog.json")  # absent: no error
    assert not storage.exists("catalog.json")
    with pytest.raises(ObjectNotFound):
        storage.stat("catalog.json")
    with pytest.raises(ObjectNotFound):
        storage.open("missing/key")


def test_reader_ranges_are_checked(storage):
    storage.put_atomic("k", b"0123456789")
    with storage.open("k") as reader:
        assert reader.size == 10
        assert reader.read_range(2, 5) == b"234"
        assert reader.read_range(3, 3) == b""
        with pytest.raises(StorageError):
            reader.read_range(5, 11)
        with pytest.raises(StorageError):
            reader.read_range(-1, 2)


@pytest.mark.parametrize(
    "key",
    ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/.", "a\\b", "a\x00b", "x" * 2000],
)
def test_unsafe_keys_are_refused(storage, key):
    with pytest.raises(UnsafeKey):
        validate_key(key)
    with pytest.raises(UnsafeKey):
        storage.stat(key)
    with pytest.raises(UnsafeKey):
        storage.put_atomic(key, b"x")


def test_local_symlink_out_of_root_is_refused(tmp_path: Path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").write_text("secret")
    (root / "link").symlink_to(tmp_path / "secret")
    storage = LocalStorage(root)
    with pytest.raises(UnsafeKey):
        storage.read_bytes("link")
    (root / "d").mkdir()
    with pytest.raises(ObjectNotFound):  # a directory is not an object
        storage.open("d")


def test_local_reader_keeps_its_version_across_rename_and_unlink(tmp_path: Path):
    storage = LocalStorage(tmp_path)
    storage.put_atomic("pack", b"A" * 1000)
    reader = storage.open("pack")
    storage.put_atomic("pack", b"B" * 2000)  # replaced by rename
    assert reader.read_range(0, 1000) == b"A" * 1000
    (tmp_path / "pack").unlink()
    assert reader.read_range(990, 1000) == b"A" * 10
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(StorageError):
        reader.read_range(0, 1)


def test_local_atomic_write_leaves_no_temp_file_on_failure(tmp_path: Path, monkeypatch):
    storage = LocalStorage(tmp_path)
    storage.put_atomic("f", b"old")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        storage.put_atomic("f", b"new")
    monkeypatch.undo()
    assert storage.read_bytes("f") == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_local_truncation_is_detected(tmp_path: Path):
    storage = LocalStorage(tmp_path)
    storage.put_atomic("p", b"x" * 100)
    reader = storage.open("p")
    os.truncate(tmp_path / "p", 50)
    with pytest.raises(StorageError, match="truncated"):
        reader.read_range(0, 100)
    reader.close()


def test_s3_reader_detects_a_replaced_object(s3_endpoint):
    make_bucket(s3_endpoint, "changing")
    storage = S3Storage("changing", "", s3_endpoint)
    storage.put_atomic("obj", b"v1" * 100)
    reader = storage.open("obj")
    assert reader.read_range(0, 4) == b"v1v1"
    storage.put_atomic("obj", b"v2" * 100)
    with pytest.raises(ObjectChanged):
        reader.read_range(0, 4)


def test_open_storage_urls(tmp_path: Path, s3_endpoint):
    assert isinstance(open_storage(tmp_path), LocalStorage)
    assert open_storage(f"file://{tmp_path}").root == tmp_path.resolve()
    s3 = open_storage(f"s3://bkt/pre/fix?endpoint_url={s3_endpoint}")
    assert isinstance(s3, S3Storage) and s3.bucket == "bkt" and s3.prefix == "pre/fix/"
    with pytest.raises(StorageError, match="unknown storage scheme"):
        open_storage("ftp://x/y")


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_s3_endpoint_from_the_environment_is_botocore_s_and_named_in_errors(
        s3_endpoint, monkeypatch, variable):
    """No endpoint given: botocore reads the standard variable (sakura.s3), addresses the
    bucket path-style on it, and the storage names the endpoint it resolved."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, s3_endpoint)
    make_bucket(s3_endpoint, "from-env")
    storage = open_storage("s3://from-env/p")
    assert storage.endpoint_url == s3_endpoint
    storage.put_atomic("k", b"data")
    assert storage.read_bytes("k") == b"data"
    with pytest.raises(ObjectNotFound, match=f"no object 'gone' in S3 bucket from-env/p/ at "
                                             f"{s3_endpoint}"):
        storage.stat("gone")
