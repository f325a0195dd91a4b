"""Atomic publishing of packs into a catalog directory, content hashes and garbage collection.

The publish protocol (every file write is temp file + fsync + rename + directory fsync):

1. :func:`publish_pack` copies the pack to its immutable, content-addressed name
   ``templates/<id>/<codec>/<codec>-<sha16>.pack`` and writes that version's manifest
   ``<codec>-<sha16>.manifest.json`` beside it. Only *new names* appear, nothing the catalog
   references changes, so nothing a client can see changes.
2. :func:`update_catalog` then replaces each ``manifest.json`` with the new version's
   manifest and finally replaces ``catalog.json`` (the commit point). An exception anywhere
   before the catalog rename restores the previous ``manifest.json`` files, so a failed
   build leaves every file the catalog references exactly as it was. (A process *killed*
   between step 2's first rename and the catalog rename can leave a ``manifest.json`` ahead
   of ``catalog.json``; the server resolves manifests through ``catalog.json``'s
   ``pack_file`` and the versioned manifest, so what it serves is still the old catalog, and
   the next publish repairs the file.)

Superseded packs and manifests stay readable (clients holding the old ETag keep consistent
bytes) until :func:`collect_garbage` removes files that the catalog no longer references and
that were retired longer ago than the grace period (default one hour). Retiring a file
touches its mtime, so the grace period counts from the moment it was superseded.

:func:`template_content_hash` and :func:`is_up_to_date` let a builder skip templates whose
inputs have not changed; :class:`CatalogTransaction` bundles the steps for a build loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sakura.cloud import layout
from sakura.cloud.bundle import bundle_keys
from sakura.cloud.errors import ManifestError, PublishError, StorageError
from sakura.cloud.storage import TMP_PREFIX, Storage, atomic_write, open_storage

DEFAULT_GRACE_S = 3600.0
LOCK_NAME = ".publish.lock"


def sha256_file(path: str | os.PathLike[str], chunk_size: int = 1 << 20) -> tuple[str, int]:
    """(sha256 hex, size) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as src:
        while block := src.read(chunk_size):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no spaces) for hashing."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str
    ).encode()


def template_content_hash(
    spec: Mapping[str, Any],
    files: Iterable[str | os.PathLike[str]] = (),
    *,
    salt: str = "",
) -> str:
    """The content hash of a template build: its spec, its input files' bytes, and a salt.

    ``spec`` is everything that determines the pack (template fields, model id, codec
    options, steps...), hashed as canonical JSON; ``files`` are hashed by content in the
    order given (so renaming a file does not change the hash); ``salt`` is for a builder
    version string. Returns ``"sha256:<hex>"``.
    """
    digest = hashlib.sha256(b"sakura-template-v1\x00")
    digest.update(canonical_json(spec))
    for path in files:
        file_hash, size = sha256_file(path)
        digest.update(f"\x00file:{size}:{file_hash}".encode())
    digest.update(b"\x00salt:" + salt.encode())
    return "sha256:" + digest.hexdigest()


def _dump(value: Any) -> bytes:
    # compact: manifests hold thousands of unit entries and travel to every device
    return (json.dumps(value, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


BUILD_PREFIX = ".build-"
BUILD_LOCK = ".lock"
UNLOCKED_GRACE_S = 60.0  # a build dir younger than this may not hold its lock yet


@contextlib.contextmanager
def build_workdir(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """A private ``.build-*`` work folder in the catalog directory (same filesystem, so
    publishing renames), locked while the build runs and removed when it ends. Folders of
    builds that were killed (no process holds their lock) are removed first."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale_builds(root)
    path = Path(tempfile.mkdtemp(dir=root, prefix=BUILD_PREFIX))
    fd = os.open(path / BUILD_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def sweep_stale_builds(out_dir: str | os.PathLike[str], *, dry_run: bool = False,
                       now: float | None = None) -> list[str]:
    """Remove ``.build-*`` folders whose build is gone: their lock is free (a killed build's
    lock dies with its process), or they have no lock and are older than a minute. A running
    build's folder is never touched. Returns the removed folder names."""
    now = time.time() if now is None else now
    removed = []
    for path in sorted(Path(out_dir).glob(BUILD_PREFIX + "*")):
        if not path.is_dir() or path.is_symlink():
            continue
        try:
            fd = os.open(path / BUILD_LOCK, os.O_RDWR)
        except FileNotFoundError:
            try:
                stale = now - path.stat().st_mtime > UNLOCKED_GRACE_S
            except OSError:
                continue
            if stale:
                if not dry_run:
                    shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a running build holds it
        else:
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        finally:
            os.close(fd)
    return removed


def published_files(out_dir: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every published file of a catalog directory (relative path -> bytes; work folders
    and locks left out), to compare two builds: a manifest's bytes are taken without its
    configurations' ``decode_ms``, which the pack writer *measures* (one timed decode of
    each Pareto configuration), so that two builds of the same inputs, local or on Ray,
    differ there and nowhere else (packs, the rest of the manifests, catalog.json)."""
    root = Path(out_dir)
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        data = path.read_bytes()
        if path.name.endswith("manifest.json"):
            doc = json.loads(data)
            for shard in doc.get("shards", []):
                for config in shard.get("configs", []):
                    config.pop("decode_ms", None)
            data = _dump(doc)
        files[str(rel)] = data
    return files


def read_catalog(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The published catalog (an empty one if there is none yet)."""
    path = Path(out_dir) / layout.CATALOG_KEY
    if not path.exists():
        return {"version": layout.CATALOG_VERSION, "templates": {}}
    try:
        catalog = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from exc
    return layout.validate_catalog(catalog)


@contextlib.contextmanager
def catalog_lock(out_dir: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive advisory lock on the catalog directory (one publisher at a time)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_NAME, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@dataclass(frozen=True)
class PublishedPack:
    """A pack written under its immutable name, with its versioned manifest, not yet live."""

    template_id: str
    codec: str
    pack_file: str
    pack_sha256: str
    pack_bytes: int
    stored_bytes: int

    @property
    def manifest_key(self) -> str:
        return layout.manifest_key(self.template_id, self.codec)

    @property
    def versioned_manifest_key(self) -> str:
        return layout.versioned_manifest_key(self.template_id, self.codec, self.pack_file)

    @property
    def pack_key(self) -> str:
        return layout.pack_key(self.template_id, self.codec, self.pack_file)

    def catalog_entry(self) -> dict[str, Any]:
        """The ``codecs[<codec>]`` entry of ``catalog.json`` for this pack."""
        return {
            "manifest": self.manifest_key,
            "pack_file": self.pack_file,
            "pack_sha256": self.pack_sha256,
            "pack_bytes": self.pack_bytes,
            "stored_bytes": self.stored_bytes,
        }


def publish_pack(
    out_dir: str | os.PathLike[str],
    template_id: str,
    codec: str,
    manifest_dict: Mapping[str, Any],
    pack_path: str | os.PathLike[str],
) -> PublishedPack:
    """Write a pack and its versioned manifest under content-addressed names (not yet live).

    The pack is hashed; ``pack_file``, ``pack_bytes``, ``pack_sha256``, ``template_id`` and
    ``codec`` of the manifest are filled in (a conflicting value already there is an error),
    and the manifest is validated against the pack. Call :func:`update_catalog` to make it
    live. Publishing identical bytes again is a no-op.
    """
    try:
        layout.check_ids(template_id, codec)
    except ManifestError as exc:
        raise PublishError(str(exc)) from exc
    pack_path = Path(pack_path)
    if not pack_path.is_file():
        raise PublishError(f"pack {pack_path} does not exist")
    sha, size = sha256_file(pack_path)
    manifest = dict(manifest_dict)
    expected = {"template_id": template_id, "codec": codec, "pack_bytes": size, "pack_sha256": sha}
    for key, value in expected.items():
        if manifest.get(key) is not None and manifest[key] != value:
            raise PublishError(
                f"manifest {key}={manifest[key]!r:.80} does not match the pack ({value!r})"
            )
        manifest[key] = value
    name = layout.pack_file_name(codec, sha)
    manifest["pack_file"] = name
    manifest.setdefault("stored_bytes", size)
    try:
        layout.validate_manifest(manifest, template_id=template_id, codec=codec, pack_size=size)
    except ManifestError as exc:
        raise PublishError(f"manifest of {template_id}/{codec} is invalid: {exc}") from exc
    stored = manifest.get("stored_bytes", size)
    directory = Path(out_dir) / layout.template_dir(template_id, codec)
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / name
    vpath = directory / layout.versioned_manifest_name(name)
    intact = dest.is_file() and dest.stat().st_size == size and sha256_file(dest)[0] == sha
    if not (intact and vpath.is_file()):
        if not intact:  # absent, or damaged on disk: (re)write it
            atomic_write(dest, pack_path)
        atomic_write(vpath, _dump(manifest))
    # else: this exact pack is published already (a rebuild of the same inputs); its
    # versioned manifest is immutable once published (caches keep it forever), so it stays
    return PublishedPack(
        template_id, codec, name, sha, size, int(stored) if isinstance(stored, int) else size
    )


def _entry_pack_file(entry: Any) -> str | None:
    if isinstance(entry, PublishedPack):
        return entry.pack_file
    if isinstance(entry, Mapping):
        value = entry.get("pack_file")
        return value if isinstance(value, str) else None
    return None


def update_catalog(
    out_dir: str | os.PathLike[str],
    entries: Mapping[str, Mapping[str, Any]],
    *,
    remove: Iterable[str] = (),
) -> dict[str, Any]:
    """Make published packs live: swap each ``manifest.json``, then ``catalog.json`` last.

    ``entries`` maps template id -> ``{"codecs": {codec: PublishedPack | entry dict}, ...}``
    where the other keys are free-form template metadata (``workload``, ``mask_ratio``,
    ``resolution``, ``content_hash``...). A template's metadata is updated key by key and its
    codecs merged (codecs not mentioned stay as they were); ``remove`` drops templates.
    On any error nothing the catalog references is changed. Returns the new catalog.
    """
    root = Path(out_dir)
    with catalog_lock(root):
        old = read_catalog(root)
        new = json.loads(json.dumps(old))  # deep copy
        templates: dict[str, Any] = new["templates"]
        swaps: list[tuple[Path, bytes]] = []  # (manifest.json path, new content)
        retired: list[Path] = []
        for template_id, spec in entries.items():
            try:
                layout.check_ids(template_id)
            except ManifestError as exc:
                raise PublishError(str(exc)) from exc
            spec = dict(spec)
            codecs_in = spec.pop("codecs", {}) or {}
            entry = dict(templates.get(template_id, {}))
            entry.update(spec)
            codecs = dict(entry.get("codecs", {}))
            for codec, value in codecs_in.items():
                centry = value.catalog_entry() if isinstance(value, PublishedPack) else dict(value)
                pack_file = _entry_pack_file(value)
                if pack_file is None:
                    raise PublishError(f"catalog entry {template_id}/{codec} has no pack_file")
                try:
                    vkey = layout.versioned_manifest_key(template_id, codec, pack_file)
                    pkey = layout.pack_key(template_id, codec, pack_file)
                except ManifestError as exc:
                    raise PublishError(str(exc)) from exc
                vpath, ppath = root / vkey, root / pkey
                if not vpath.is_file() or not ppath.is_file():
                    raise PublishError(
                        f"{template_id}/{codec}: {pack_file} was not published (call publish_pack first)"
                    )
                centry.setdefault("manifest", layout.manifest_key(template_id, codec))
                previous = _entry_pack_file(codecs.get(codec))
                if previous and previous != pack_file:
                    with contextlib.suppress(ManifestError):
                        retired.append(root / layout.pack_key(template_id, codec, previous))
                        retired.append(
                            root / layout.versioned_manifest_key(template_id, codec, previous)
                        )
                codecs[codec] = centry
                swaps.append((root / layout.manifest_key(template_id, codec), vpath.read_bytes()))
            entry["codecs"] = codecs
            templates[template_id] = entry
        for template_id in remove:
            templates.pop(template_id, None)
        layout.validate_catalog(new)

        backups: list[tuple[Path, bytes | None]] = []
        try:
            for path, content in swaps:
                backups.append((path, path.read_bytes() if path.exists() else None))
                atomic_write(path, content)
            atomic_write(root / layout.CATALOG_KEY, _dump(new))
        except BaseException as exc:
            _restore(backups)
            if isinstance(exc, Exception) and not isinstance(exc, PublishError):
                raise PublishError(
                    f"publishing the catalog failed, nothing changed: {exc}"
                ) from exc
            raise
        now = time.time()
        for path in retired:
            with contextlib.suppress(OSError):
                os.utime(path, (now, now))
        return new


def _restore(backups: list[tuple[Path, bytes | None]]) -> None:
    for path, content in reversed(backups):
        with contextlib.suppress(OSError):
            if content is None:
                path.unlink(missing_ok=True)
            elif not path.exists() or path.read_bytes() != content:
                atomic_write(path, content)


def is_up_to_date(
    out_dir: str | os.PathLike[str],
    template_id: str,
    content_hash: str,
    codecs: Iterable[str] = ("sakura",),
    *,
    verify: bool = False,
) -> bool:
    """True if the published catalog already holds ``template_id`` built from ``content_hash``
    for every codec in ``codecs``, with its pack and manifest files present and of the right
    size (``verify=True`` also re-hashes the packs)."""
    root = Path(out_dir)
    try:
        catalog = read_catalog(root)
    except ManifestError:
        return False
    entry = catalog["templates"].get(template_id)
    if not entry or entry.get("content_hash") != content_hash:
        return False
    for codec in codecs:
        centry = entry.get("codecs", {}).get(codec)
        pack_file = _entry_pack_file(centry)
        if not pack_file:
            return False
        try:
            ppath = root / layout.pack_key(template_id, codec, pack_file)
            vpath = root / layout.versioned_manifest_key(template_id, codec, pack_file)
        except ManifestError:
            return False
        if not ppath.is_file() or not vpath.is_file():
            return False
        expected = centry.get("pack_bytes")
        if isinstance(expected, int) and ppath.stat().st_size != expected:
            return False
        if verify and sha256_file(ppath)[0] != centry.get("pack_sha256"):
            return False
    return True


def referenced_keys(catalog: Mapping[str, Any]) -> set[str]:
    """Storage keys the catalog needs: catalog.json, manifests, packs, versioned manifests,
    device bundle files."""
    keys = {layout.CATALOG_KEY}
    for template_id, entry in catalog.get("templates", {}).items():
        for codec, centry in entry.get("codecs", {}).items():
            keys.add(layout.manifest_key(template_id, codec))
            pack_file = _entry_pack_file(centry)
            if pack_file:
                keys.add(layout.pack_key(template_id, codec, pack_file))
                keys.add(layout.versioned_manifest_key(template_id, codec, pack_file))
    return keys | bundle_keys(catalog)  # device bundle files (cloud.bundle)


def collect_garbage(
    out_dir: str | os.PathLike[str],
    *,
    grace_s: float = DEFAULT_GRACE_S,
    now: float | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Delete packs, versioned manifests and temp files under ``templates/`` that the catalog
    does not reference and that were retired more than ``grace_s`` seconds ago, and the work
    folders of killed builds (:func:`sweep_stale_builds`).

    Returns the removed keys (build folders as ``.build-xxx/``). ``manifest.json`` files are
    never removed.
    """
    root = Path(out_dir)
    now = time.time() if now is None else now
    removed: list[str] = [name + "/" for name in sweep_stale_builds(root, dry_run=dry_run,
                                                                    now=now)]
    with catalog_lock(root):
        keep = referenced_keys(read_catalog(root))
        base = root / "templates"
        if not base.is_dir():
            return removed
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                path = Path(dirpath, name)
                key = path.relative_to(root).as_posix()
                collectable = name.startswith(TMP_PREFIX) or name.endswith(
                    (".pack", ".manifest.json")
                )
                if key in keep or name == layout.MANIFEST_NAME or not collectable:
                    continue
                try:
                    age = now - path.stat().st_mtime
                except OSError:
                    continue
                if age >= grace_s:
                    if not dry_run:
                        path.unlink(missing_ok=True)
                    removed.append(key)
    return sorted(removed)


def mirror_to_storage(out_dir: str | os.PathLike[str], storage: Storage) -> list[str]:
    """Upload a published catalog to another storage (e.g. S3 behind a CDN), in publish
    order: packs and versioned manifests first, then ``manifest.json`` files, then
    ``catalog.json`` last, so readers of the target never see a catalog ahead of its files.
    Packs already present with the same size are skipped. Returns the uploaded keys."""
    root = Path(out_dir)
    catalog = read_catalog(root)
    keys = referenced_keys(catalog) - {layout.CATALOG_KEY}
    immutable = sorted(k for k in keys if not k.endswith("/" + layout.MANIFEST_NAME))
    mutable = sorted(k for k in keys if k.endswith("/" + layout.MANIFEST_NAME))
    uploaded: list[str] = []
    for key in [*immutable, *mutable]:
        path = root / key
        if not path.is_file():
            raise PublishError(f"{key} is referenced by the catalog but missing from {root}")
        if key in immutable and (key.endswith(".pack") or key.startswith("bundles/")):
            try:
                if storage.size(key) == path.stat().st_size:
                    continue
            except Exception:  # noqa: BLE001 - absent or unreadable: upload it
                pass
        storage.put_atomic(key, path)
        uploaded.append(key)
    storage.put_atomic(layout.CATALOG_KEY, (root / layout.CATALOG_KEY).read_bytes())
    uploaded.append(layout.CATALOG_KEY)
    return uploaded


def publish_catalog(out_dir: str | os.PathLike[str], location: str) -> list[str]:
    """Upload a published catalog to a storage URL (``s3://bucket/prefix``, optionally
    ``?endpoint_url=...&region=...``; credentials from the standard AWS environment), in
    publish order (:func:`mirror_to_storage`). Returns the uploaded keys."""
    try:
        storage = open_storage(location)
        return mirror_to_storage(out_dir, storage)
    except StorageError as exc:
        raise PublishError(f"cannot publish {out_dir} to {location}: {exc}") from exc


@dataclass
class CatalogTransaction:
    """Publish several packs and commit them to the catalog at once.

    ``with CatalogTransaction(out) as txn: txn.publish(...)`` commits on a clean exit and
    commits nothing if the block raises (new immutable files are left for GC).
    """

    out_dir: Path
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    committed: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)

    def publish(
        self,
        template_id: str,
        codec: str,
        manifest: Mapping[str, Any],
        pack_path: str | os.PathLike[str],
        metadata: Mapping[str, Any] | None = None,
    ) -> PublishedPack:
        published = publish_pack(self.out_dir, template_id, codec, manifest, pack_path)
        entry = self.entries.setdefault(template_id, {"codecs": {}})
        entry.update(metadata or {})
        entry.setdefault("codecs", {})[codec] = published
        return published

    def set_metadata(self, template_id: str, **metadata: Any) -> None:
        self.entries.setdefault(template_id, {"codecs": {}}).update(metadata)

    def commit(self) -> dict[str, Any]:
        self.committed = update_catalog(self.out_dir, self.entries)
        return self.committed

    def __enter__(self) -> CatalogTransaction:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
