"""The template server's settings and its one state object, hung on ``app.state.sakura``
(no module globals): storage, tokens, metrics, the catalog/manifest JSON cache, the shard
hash cache, the unit verifier, gzipped manifests and ``/healthz``'s last size check."""

from __future__ import annotations

import collections
import gzip
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from sakura.cloud.auth import TokenSet
from sakura.cloud.bundle import BundleVerifier
from sakura.cloud.errors import ManifestError
from sakura.cloud.metrics import Metrics
from sakura.cloud.storage import LocalStorage, Storage
from sakura.cloud.verify import UnitVerifier


@dataclass(frozen=True)
class ServerSettings:
    """Tunables of the server (defaults suit a phone-facing origin behind a CDN)."""

    chunk_size: int = 1024 * 1024  # bytes per storage read / body message
    max_ranges: int = 64  # more range specs in one Range header -> 400
    # a checked catalog.json / manifest.json is trusted this long before its storage change
    # token is checked again; None: 0 for a local folder (a stat is cheap), 2 s otherwise
    cache_ttl_s: float | None = None
    cache_entries: int = 1024  # parsed manifests kept in memory
    hash_cache_entries: int = 65536  # shard body sha256 values kept in memory
    buffer_limit: int = 16 * 1024 * 1024  # shard bodies up to this size are hashed in memory
    max_age_immutable: int = 31536000  # Cache-Control max-age of version-pinned responses


# --------------------------------------------------------------------------------- caches


@dataclass
class _CacheEntry:
    raw: bytes
    value: Any
    token: str
    checked: float


class JsonCache:
    """Parsed JSON objects from storage, revalidated by storage change token after a TTL."""

    def __init__(self, storage: Storage, ttl_s: float, max_entries: int) -> None:
        self.storage = storage
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, _CacheEntry] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, parse: Any, *, immutable: bool = False) -> tuple[bytes, Any]:
        """(raw bytes, parse(json)) of ``key``; raises ObjectNotFound, ManifestError."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                if immutable or now - entry.checked < self.ttl_s:
                    return entry.raw, entry.value
        if entry is not None:
            token = self.storage.stat(key).etag
            if token == entry.token:
                entry.checked = now
                return entry.raw, entry.value
        with self.storage.open(key) as reader:
            raw = reader.read_range(0, reader.size)
            token = reader.info.etag
        try:
            document = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ManifestError(f"{key} is not valid JSON: {exc}") from exc
        value = parse(document)
        with self._lock:
            self._entries[key] = _CacheEntry(raw, value, token, now)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return raw, value


class HashCache:
    """A bounded LRU of shard body sha256 values keyed by (pack key, storage change token,
    shard, config): what is on storage, not what the manifest says, so a file repaired or
    replaced on disk is hashed again."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple[str, str, int, int], str] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, int, int]) -> str | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: tuple[str, str, int, int], value: str) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)


# ------------------------------------------------------------------------------ state


@dataclass
class ServerState:
    """Everything the app needs, hung on ``app.state.sakura`` (no module globals)."""

    storage: Storage
    tokens: TokenSet | None
    settings: ServerSettings
    metrics: Metrics = field(default_factory=Metrics)
    json_cache: JsonCache | None = None
    hashes: HashCache | None = None
    verifier: UnitVerifier = field(default_factory=UnitVerifier)
    # device bundle files: whole-file sha256 against the catalog (cloud.bundle)
    bundles: BundleVerifier = field(default_factory=BundleVerifier)
    # gzipped manifests by ETag (a manifest version never changes), so each is compressed
    # once rather than on every request
    gzipped: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    # /healthz's last size check: (the catalog object it checked, when, problems)
    health_sizes: tuple[Any, float, list[dict[str, str]]] | None = None

    def gzip_manifest(self, etag: str, raw: bytes) -> bytes:
        body = self.gzipped.get(etag)
        if body is None:
            body = gzip.compress(raw, compresslevel=6, mtime=0)
            self.gzipped[etag] = body
            while len(self.gzipped) > self.settings.cache_entries:
                self.gzipped.popitem(last=False)
        return body

    def __post_init__(self) -> None:
        if self.json_cache is None:
            ttl = self.settings.cache_ttl_s
            if ttl is None:
                ttl = 0.0 if isinstance(self.storage, LocalStorage) else 2.0
            self.json_cache = JsonCache(self.storage, ttl, self.settings.cache_entries)
        if self.hashes is None:
            self.hashes = HashCache(self.settings.hash_cache_entries)


def state_of(request: Request) -> ServerState:
    return request.app.state.sakura
