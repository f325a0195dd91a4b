"""Device bundles in the published layout: publishing, and the server's check before it
vouches for the bytes (issue 31, items 1 and 5).

A bundle (what the device executes for one template geometry: graphs, the text encoder
program, its vocabulary, tables; exported by ``sakura.edge.bundle`` and handed to the
builder by the app layer) is published as plain files beside the packs::

    bundles/<first 16 hex of the file's sha256>/<name>

so every file is immutable and content-addressed (a file that several templates share,
the graphs of one geometry, is one object), and any origin (``sakura serve``, nginx, an S3
bucket, a CDN) serves it as bytes. The template's catalog entry lists them under
``bundle`` (schema: ``sakura.codec.manifest.DeviceBundle``: each file's key, length and
sha256, and what the bundle was made for). :func:`publish_bundle` copies the files
(temp file + fsync + rename, skipped when an intact copy is there) and returns that entry;
the catalog transaction makes it live with the packs.

``sakura serve`` answers ``/bundles/<sha16>/<name>`` only for a file some template of the
catalog lists (and, with tokens, only for a template the token may see), and only after a
whole-file sha256 check of the version in storage against the catalog
(:class:`BundleVerifier`, remembered per storage version as the pack units are): a damaged
file is a 500 ``pack_damaged`` naming it, and listed by ``/healthz``.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sakura.cloud.api_errors import ApiError
from sakura.cloud.errors import ErrorCode, ObjectNotFound, PublishError, StorageError
from sakura.cloud.storage import ObjectReader, atomic_write
from sakura.codec.errors import PackError
from sakura.codec.manifest import bundle_key, parse_bundle

log = logging.getLogger("sakura.cloud.server")


def _sha256_file(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def publish_bundle(out_dir: str | os.PathLike[str], files: Iterable[tuple[str, str, Path]],
                   doc: Mapping[str, Any]) -> dict[str, Any]:
    """Copy ``files`` ((name, role, path)) to their content addresses under ``out_dir`` and
    return the catalog's ``bundle`` entry (``doc`` plus ``id`` and ``files``), validated.
    Nothing the catalog references changes (only new names appear)."""
    root = Path(out_dir)
    listed = []
    for name, role, path in files:
        sha, size = _sha256_file(Path(path))
        key = bundle_key(name, sha)
        dest = root / key
        intact = dest.is_file() and dest.stat().st_size == size and _sha256_file(dest)[0] == sha
        if not intact:
            dest.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(dest, Path(path))
        listed.append({"name": name, "role": role, "key": key, "bytes": size, "sha256": sha})
    ident = hashlib.sha256("\n".join(f"{f['name']} {f['sha256']}" for f in listed).encode())
    entry = {**dict(doc), "id": ident.hexdigest()[:16], "files": listed}
    try:
        parse_bundle(entry)
    except PackError as exc:
        raise PublishError(f"the device bundle is invalid: {exc}") from exc
    return entry


def bundle_keys(catalog: Mapping[str, Any]) -> set[str]:
    """Storage keys of every bundle file the catalog lists."""
    keys = set()
    for entry in catalog.get("templates", {}).values():
        bundle = entry.get("bundle") if isinstance(entry, Mapping) else None
        for f in (bundle or {}).get("files", []) if isinstance(bundle, Mapping) else []:
            if isinstance(f, Mapping) and isinstance(f.get("key"), str):
                keys.add(f["key"])
    return keys


def bundle_file(catalog: Mapping[str, Any], key: str) -> tuple[dict[str, Any], list[str]]:
    """The catalog's record of the bundle file at ``key`` and the templates that list it
    (``([], [])``-like ``({}, [])`` when none does)."""
    found: dict[str, Any] = {}
    templates = []
    for tid, entry in catalog.get("templates", {}).items():
        bundle = entry.get("bundle") if isinstance(entry, Mapping) else None
        if not isinstance(bundle, Mapping):
            continue
        for f in bundle.get("files", []):
            if isinstance(f, Mapping) and f.get("key") == key:
                found = dict(f)
                templates.append(tid)
    return found, templates


class BundleVerifier:
    """Whole-file sha256 of bundle files in storage against the catalog, once per storage
    version (the pack verifier's rule: a repaired or replaced file has a new version token
    and is checked again); damaged files are listed for ``/healthz``."""

    def __init__(self, max_versions: int = 4096) -> None:
        self.max_versions = max_versions
        self._ok: collections.OrderedDict[tuple[str, str, str], None] = \
            collections.OrderedDict()
        self._damaged: dict[str, tuple[str, str]] = {}  # key -> (version token, reason)
        self._lock = threading.Lock()

    def damaged(self) -> list[dict[str, str]]:
        with self._lock:
            return [{"pack": k, "error": why, "code": ErrorCode.PACK_DAMAGED}
                    for k, (_t, why) in sorted(self._damaged.items())]

    def verify(self, reader: ObjectReader, key: str, record: Mapping[str, Any]) -> None:
        """Raise :class:`ApiError` (500 ``pack_damaged``) unless the file ``reader`` holds
        has the catalog's length and sha256."""
        token = (key, reader.info.etag, str(record.get("sha256")))
        with self._lock:
            if token in self._ok:
                self._ok.move_to_end(token)
                return
        why = None
        if reader.size != record.get("bytes"):
            why = f"it has {reader.size} bytes, the catalog says {record.get('bytes')}"
        else:
            digest = hashlib.sha256()
            try:
                for chunk in reader.iter_range(0, reader.size):
                    digest.update(chunk)
            except StorageError as exc:
                log.error("reading %s failed: %s", key, exc)
                raise ApiError(503, "storage unavailable",
                               code=ErrorCode.STORAGE_UNAVAILABLE) from exc
            if digest.hexdigest() != record.get("sha256"):
                why = "it fails its sha256 checksum"
        if why:
            text = (f"the device bundle file {key} is damaged: {why}; it is not served until "
                    "it is repaired")
            log.error("%s", text)
            with self._lock:
                self._damaged[key] = (reader.info.etag, text)
            raise ApiError(500, text, code=ErrorCode.PACK_DAMAGED)
        with self._lock:
            self._ok[token] = None
            while len(self._ok) > self.max_versions:
                self._ok.popitem(last=False)
            seen = self._damaged.get(key)
            if seen is not None and seen[0] != reader.info.etag:
                del self._damaged[key]  # a newer version passed: repaired


def bundle_sizes(storage: Any, catalog: Mapping[str, Any]) -> list[dict[str, str]]:
    """``/healthz``'s size check of the catalog's bundle files (a stat each)."""
    problems = []
    for key in sorted(bundle_keys(catalog)):
        record, _t = bundle_file(catalog, key)
        try:
            size = storage.stat(key).size
        except ObjectNotFound:
            problems.append({"pack": key, "error": f"the device bundle file {key} is missing "
                             "from storage", "code": ErrorCode.PUBLISH_BROKEN})
            continue
        except StorageError as exc:
            problems.append({"pack": key, "error": f"storage unavailable: {exc}"[:300],
                             "code": ErrorCode.STORAGE_UNAVAILABLE})
            continue
        if size != record.get("bytes"):
            problems.append({"pack": key, "error": f"the device bundle file {key} is damaged: "
                             f"it has {size} bytes, the catalog says {record.get('bytes')}",
                             "code": ErrorCode.PACK_DAMAGED})
    return problems
