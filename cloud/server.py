"""The SAKURA template server: catalog, manifests, raw packs with HTTP Range, shard bodies.

``create_app(storage, tokens=None)`` returns a FastAPI app; all state lives on
``app.state.sakura`` (:class:`ServerState`). See ``cloud/README.md`` for the API table and
the Range decisions; :mod:`cloud.ranges` holds the header parsing.

What is served is decided by ``catalog.json`` alone: a template's manifest is the versioned
manifest of the ``pack_file`` the catalog names (falling back to ``manifest.json`` for
hand-written catalogs without ``pack_file``). Packs are immutable and named by content
hash, so a reader holding a version keeps consistent bytes after a republish; old versions
stay reachable with ``?pack=<pack_file>`` until garbage collection.

Bodies come from one reader pinned to one version of the pack (a local file descriptor, or
S3 ``If-Match``); the reader is closed when the response ends, fails or the client
disconnects. From a local folder, the verified spans leave by sendfile on that descriptor
(ASGI zero-copy send, :mod:`cloud.zerocopy`, offered by :mod:`cloud.runner`'s protocol):
profiled under ``sakura bench serve``, copying each body through Python (1 MiB ``pread``
chunks in worker threads, then ``socket.send``) was most of the server's time, not the
checking, which the verified-unit cache makes a set lookup per request; with sendfile the
one process went from 0.32 to 0.40-0.43 GB/s against nginx's 0.75-0.85 on the same host.
Pack ranges of the layout route are then answered by :class:`_PackFastPath` in front of
FastAPI's routing (the reasons and measurements are in its docstring): on a quiet host
1.01 GB/s against nginx's 2.36, 0.43x, where it was 0.57 against 2.07, 0.28x
(``docs/bench/serve.json`` has the recorded run). Elsewhere (a bucket, the in-process test
client) they stream in chunks as before. Every route that sends pack bytes builds its response in
:func:`_serve_body` from ONE parse of ``Range``/``If-Range`` (:func:`cloud.ranges.parse_range`
with ``ServerSettings.max_ranges``): the pack spans it sends are the spans it hands the
:class:`UnitVerifier`, so what is checked is exactly what is sent.

Errors are ``{"error": message, "code": code}``; the codes are
:class:`sakura.cloud.errors.ErrorCode`'s (the table is in ``cloud/README.md``).
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sakura.cloud import layout, zerocopy
from sakura.cloud.auth import Grant, TokenSet, bearer_token
from sakura.cloud.errors import ErrorCode, ManifestError, ObjectNotFound, StorageError
from sakura.cloud.layout import ManifestIndex
from sakura.cloud.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from sakura.cloud.metrics import METHODS, Metrics, MetricsMiddleware
from sakura.cloud.ranges import (
    ByteRange,
    RangeKind,
    RangeRejected,
    parse_etag_list,
    parse_range,
    strong_match,
    unsatisfied_content_range,
    weak_match,
)
from sakura.cloud.storage import LocalStorage, ObjectReader, Storage
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("sakura.cloud.server")

_INT_RE = re.compile(r"^[0-9]{1,9}$")
OCTET = "application/octet-stream"


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


class ApiError(Exception):
    """An error answered as ``{"error": message, "code": code}`` with ``status`` (and extra
    headers); ``code`` is one of :class:`~sakura.cloud.errors.ErrorCode`'s."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *,
                 code: str) -> None:
        super().__init__(message)
        assert code in ErrorCode.ALL, code
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.code = code


# ------------------------------------------------------------------------- JSON caches


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


class UnitVerifier:
    """Checks the manifest's unit checksums on the bytes in storage before any is served.

    What passed is remembered per (pack key, storage change token: inode, size and mtime
    for a folder, the ETag in a bucket), bounded LRU: a file repaired or replaced on disk
    has a new token and is checked again, so the repair is served without a restart, and a
    damaged file is never vouched for (``500`` with the reason). Damaged packs are listed
    for ``/healthz`` until a check of a newer version passes.
    """

    HEADER = -1  # the pseudo-unit of the pack's preamble and embedded header

    def __init__(self, max_versions: int = 4096) -> None:
        self.max_versions = max_versions
        self._ok: collections.OrderedDict[tuple[str, str], set[int]] = collections.OrderedDict()
        self._damaged: dict[str, tuple[str, str]] = {}  # pack key -> (token, reason)
        self._lock = threading.Lock()

    def damaged(self) -> list[dict[str, str]]:
        with self._lock:
            return [{"pack": k, "error": why, "code": ErrorCode.PACK_DAMAGED}
                    for k, (_t, why) in sorted(self._damaged.items())]

    def verify(self, reader: ObjectReader, resolved: Resolved,
               spans: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> None:
        """Raise :class:`ApiError` (500, ``pack_damaged``) unless every unit overlapping
        ``spans`` (pack offsets, lengths) of the version ``reader`` holds hashes to the
        manifest's value. Callers pass exactly the spans they are about to send."""
        index = resolved.index
        key = (resolved.pack_key, reader.info.etag)
        first_unit = index.units[0][0] if index.units else index.pack_bytes
        wanted = {i for off, n in spans if n > 0 for i in index.units_in(off, off + n)}
        with self._lock:
            ok = self._ok.get(key)
            if ok is None:
                ok = self._ok[key] = set()
                while len(self._ok) > self.max_versions:
                    self._ok.popitem(last=False)
            self._ok.move_to_end(key)
            # what is left to check, without copying the set of passed units (thousands in
            # a real pack) on every request
            todo = sorted(wanted - ok)
            header = self.HEADER not in ok and any(off < first_unit for off, n in spans
                                                   if n > 0)
        try:
            if header:
                self._check_header(reader, first_unit)
                with self._lock:
                    ok.add(self.HEADER)
            for run in _runs(todo):
                start = index.units[run[0]][0]
                stop = index.units[run[-1]][0] + index.units[run[-1]][1]
                data = reader.read_range(start, stop)
                for i in run:
                    off, length, sha = index.units[i]
                    if hashlib.sha256(data[off - start : off - start + length]).hexdigest() != sha:
                        raise _Damaged(f"unit {i} (bytes {off}-{off + length - 1}) fails its "
                                       "checksum")
                    with self._lock:
                        ok.add(i)
        except _Damaged as exc:
            why = (f"the pack of {resolved.template_id}/{resolved.codec} is damaged: {exc}; "
                   "it is not served until it is repaired")
            log.error("%s (%s)", why, resolved.pack_key)
            with self._lock:
                self._damaged[resolved.pack_key] = (reader.info.etag, why)
            raise ApiError(500, why, code=ErrorCode.PACK_DAMAGED) from None
        except StorageError as exc:
            log.error("reading %s failed: %s", resolved.pack_key, exc)
            raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
        with self._lock:
            seen = self._damaged.get(resolved.pack_key)
            if seen is not None and seen[0] != reader.info.etag:
                del self._damaged[resolved.pack_key]  # a newer version passed: repaired

    def cached(self, reader: ObjectReader, resolved: Resolved,
               spans: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> bool:
        """Whether every unit overlapping ``spans`` of the version ``reader`` holds has
        passed already (so :meth:`verify` reads nothing: a set lookup). Only a hint for
        where to run :meth:`verify`, which is always called."""
        index = resolved.index
        first_unit = index.units[0][0] if index.units else index.pack_bytes
        with self._lock:
            ok = self._ok.get((resolved.pack_key, reader.info.etag))
            if ok is None:
                return False
            for off, n in spans:
                if n <= 0:
                    continue
                if off < first_unit and self.HEADER not in ok:
                    return False
                if any(i not in ok for i in index.units_in(off, off + n)):
                    return False
        return True

    @staticmethod
    def _check_header(reader: ObjectReader, first_unit: int) -> None:
        from sakura.codec.pack import MAGIC, PREAMBLE

        head = reader.read_range(0, min(first_unit, reader.size))
        if len(head) < PREAMBLE.size or head[:4] != MAGIC:
            raise _Damaged("the preamble is not a SAKURA pack's")
        _magic, _version, _flags, _size, header_len, header_sha = PREAMBLE.unpack_from(head)
        body = head[PREAMBLE.size : PREAMBLE.size + header_len]
        if len(body) != header_len or hashlib.sha256(body).digest() != header_sha:
            raise _Damaged("the embedded header fails its checksum")


class _Damaged(Exception):
    """Bytes in storage that do not match the manifest."""


def _runs(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted unit indices (read with one storage request each)."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


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


@dataclass(frozen=True)
class Resolved:
    """A template/codec resolved through the catalog to one manifest and pack version."""

    template_id: str
    codec: str
    manifest_raw: bytes
    index: ManifestIndex
    pack_key: str
    pinned: bool

    @property
    def etag(self) -> str:
        return f'"{self.index.pack_sha256}"'


# ------------------------------------------------------------------------------ bodies


@dataclass(frozen=True)
class Body:
    """A virtual body made of (offset, length) spans of one pack, in order."""

    spans: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(length for _, length in self.spans)

    def segments(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The pack spans (offset, length) holding body bytes ``[start, stop)``, merged."""
        out: list[tuple[int, int]] = []
        pos = 0
        for offset, length in self.spans:
            lo, hi = max(start, pos), min(stop, pos + length)
            if lo < hi:
                piece = (offset + lo - pos, hi - lo)
                if out and out[-1][0] + out[-1][1] == piece[0]:
                    out[-1] = (out[-1][0], out[-1][1] + piece[1])
                else:
                    out.append(piece)
            pos += length
            if pos >= stop:
                break
        return out


Piece = bytes | tuple[int, int]  # literal bytes, or (pack offset, length) to read


class PackResponse(Response):
    """Streams pieces of one pinned pack reader; closes the reader however it ends."""

    def __init__(
        self,
        reader: ObjectReader | None,
        pieces: list[Piece],
        *,
        status_code: int,
        headers: dict[str, str],
        send_body: bool,
        chunk_size: int,
    ) -> None:
        self.reader = reader
        self.pieces = pieces
        self.send_body = send_body
        self.chunk_size = chunk_size
        self.status_code = status_code
        self.background = None
        self.media_type = None
        self.body = b""
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                    zerocopy.CORK: True,
                }
            )
            if not self.send_body:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            fd = self.reader.fileno() if self.reader is not None else None
            if fd is not None and zerocopy.EXTENSION in scope.get("extensions", {}):
                await self._sendfile(send, fd)
                return
            async with anyio.create_task_group() as group:

                async def watch_disconnect() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            group.cancel_scope.cancel()
                            return

                group.start_soon(watch_disconnect)
                await self._stream(send)
                group.cancel_scope.cancel()
        finally:
            if self.reader is not None:
                self.reader.close()

    async def _sendfile(self, send: Any, fd: int) -> None:
        """The pieces by ASGI zero-copy send (:mod:`cloud.zerocopy`): the kernel copies
        the verified spans from the pinned reader's descriptor to the socket. A client
        that goes away ends the response here (no final message: counted a disconnect)."""
        with open(fd, "rb", buffering=0, closefd=False) as file:
            try:
                for piece in self.pieces:
                    if isinstance(piece, bytes):
                        if piece:
                            await send({"type": "http.response.body", "body": piece,
                                        "more_body": True})
                        continue
                    offset, length = piece
                    await send({"type": zerocopy.EXTENSION, "file": file, "offset": offset,
                                "count": length, "more_body": True})
            except zerocopy.ClientDisconnected:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream(self, send: Any) -> None:
        for piece in self.pieces:
            if isinstance(piece, bytes):
                if piece:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                continue
            assert self.reader is not None
            offset, length = piece
            chunks = self.reader.iter_range(offset, offset + length, self.chunk_size)
            while True:
                chunk = await anyio.to_thread.run_sync(next, chunks, None)
                if chunk is None:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# ------------------------------------------------------------------------------ the app


def _error(status: int, message: str, headers: dict[str, str] | None = None, *,
           code: str) -> JSONResponse:
    """The JSON error body of every failed request: the message for people, the stable
    ``code`` (:class:`~sakura.cloud.errors.ErrorCode`) for programs."""
    return JSONResponse({"error": message, "code": code}, status_code=status, headers=headers)


def _state(request: Request) -> ServerState:
    return request.app.state.sakura


def _check_template_id(template_id: str) -> None:
    if not layout.valid_template_id(template_id):
        raise ApiError(
            400,
            f"invalid template id {template_id[:80]!r}: must match {layout.TEMPLATE_ID_RE.pattern}",
            code=ErrorCode.BAD_REQUEST,
        )


def _check_codec(codec: str) -> None:
    if not layout.valid_codec(codec):
        raise ApiError(400, f"invalid codec {codec[:80]!r}: must match {layout.CODEC_RE.pattern}",
                       code=ErrorCode.BAD_REQUEST)


def _int_param(value: str, what: str) -> int:
    if not _INT_RE.fullmatch(value):
        raise ApiError(400, f"invalid {what} {value[:40]!r}: must be a non-negative integer",
                       code=ErrorCode.BAD_REQUEST)
    return int(value)


def _grant(request: Request) -> Grant:
    state = _state(request)
    if state.tokens is None:
        return Grant(None)
    header = request.headers.get("authorization")
    token = bearer_token(header)
    grant = state.tokens.verify(token)
    if grant is None:
        if header is None:
            raise ApiError(
                401, "missing bearer token", {"WWW-Authenticate": 'Bearer realm="sakura"'},
                code=ErrorCode.UNAUTHORIZED,
            )
        raise ApiError(
            401,
            "invalid bearer token",
            {"WWW-Authenticate": 'Bearer realm="sakura", error="invalid_token"'},
            code=ErrorCode.UNAUTHORIZED,
        )
    return grant


def _authorize(request: Request, template_id: str) -> Grant:
    grant = _grant(request)
    if not grant.allows(template_id):
        raise ApiError(403, f"this token may not access template {template_id!r}",
                       code=ErrorCode.FORBIDDEN)
    return grant


def _catalog(state: ServerState) -> dict[str, Any]:
    assert state.json_cache is not None
    try:
        _raw, catalog = state.json_cache.get(layout.CATALOG_KEY, layout.validate_catalog)
    except ObjectNotFound as exc:
        raise ApiError(503, "no catalog is published yet (catalog.json is missing)",
                       code=ErrorCode.CATALOG_MISSING) from exc
    except ManifestError as exc:
        log.error("catalog.json is invalid: %s", exc)
        raise ApiError(500, f"the published catalog is invalid: {exc}",
                       code=ErrorCode.PUBLISH_BROKEN) from exc
    except StorageError as exc:
        log.error("cannot read catalog.json: %s", exc)
        raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
    return catalog


def _resolve(state: ServerState, template_id: str, codec: str, pinned: str | None) -> Resolved:
    catalog = _catalog(state)
    entry = catalog["templates"].get(template_id)
    if entry is None:
        raise ApiError(404, f"unknown template {template_id!r}", code=ErrorCode.UNKNOWN_TEMPLATE)
    centry = entry.get("codecs", {}).get(codec)
    if centry is None:
        raise ApiError(404, f"template {template_id!r} has no codec {codec!r}",
                       code=ErrorCode.UNKNOWN_CODEC)
    if pinned is not None and not layout.valid_pack_file(pinned):
        raise ApiError(400, f"invalid pack version {pinned[:80]!r}", code=ErrorCode.BAD_REQUEST)
    pack_file = pinned or centry.get("pack_file")
    candidates: list[tuple[str, bool]] = []
    if pack_file:
        candidates.append((layout.versioned_manifest_key(template_id, codec, pack_file), True))
    if not pinned:
        candidates.append((layout.manifest_key(template_id, codec), False))

    def parse(document: Any) -> ManifestIndex:
        return layout.validate_manifest(document, template_id=template_id, codec=codec)

    assert state.json_cache is not None
    for key, immutable in candidates:
        try:
            raw, index = state.json_cache.get(key, parse, immutable=immutable)
        except ObjectNotFound:
            continue
        except ManifestError as exc:
            log.error("manifest %s is invalid: %s", key, exc)
            raise ApiError(500, f"the manifest of {template_id}/{codec} is invalid: {exc}",
                           code=ErrorCode.PUBLISH_BROKEN) from exc
        except StorageError as exc:
            log.error("cannot read %s: %s", key, exc)
            raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
        if pack_file and index.pack_file != pack_file:
            continue  # manifest.json not (yet) matching the catalog's version
        return Resolved(
            template_id,
            codec,
            raw,
            index,
            layout.pack_key(template_id, codec, index.pack_file),
            bool(pinned),
        )
    if pinned:
        raise ApiError(404, _gone(template_id, codec, pinned), code=ErrorCode.VERSION_GONE)
    raise ApiError(500, f"the manifest of {template_id}/{codec} is missing from storage",
                   code=ErrorCode.PUBLISH_BROKEN)


def _manifest_response(request: Request, state: ServerState, resolved: Resolved) -> Response:
    """The manifest bytes exactly as published (gzip when accepted), ETag the pack sha256."""
    gzipped = _accepts_gzip(request.headers.get("accept-encoding", ""))
    # each content coding is its own representation with its own strong ETag
    etag = f'"{resolved.index.pack_sha256}-gzip"' if gzipped else resolved.etag
    headers = {
        "ETag": etag,
        "Cache-Control": _cache_control(state, resolved.pinned),
        "X-Sakura-Pack-File": resolved.index.pack_file,
        "Vary": "Accept-Encoding",
    }
    early = _preconditions(request, etag, headers)
    if early:
        return early
    body = resolved.manifest_raw
    if gzipped:
        # manifests are mostly hex checksums and unit lists: gzip shrinks them several
        # times, which is start-up latency on a slow link (packs are never compressed)
        body = state.gzip_manifest(resolved.etag, body)
        headers["Content-Encoding"] = "gzip"
    return Response(body, media_type="application/json", headers=headers)


def _pack_file_response(request: Request, state: ServerState, resolved: Resolved, *,
                        inline: bool = False) -> Response:
    """The layout's immutable pack: the same response as ``/v1/.../pack`` (one Range parse
    decides both what is verified and what is sent; see :func:`_serve_body`)."""
    headers = {"X-Sakura-Pack-File": resolved.index.pack_file}
    body = Body(((0, resolved.index.pack_bytes),))
    return _serve_body(request, state, resolved, body, resolved.etag, headers, inline=inline)


def _resolve_request(
    request: Request, template_id: str, codec: str, pack: str | None
) -> tuple[ServerState, Resolved]:
    _check_template_id(template_id)
    _check_codec(codec)
    _authorize(request, template_id)
    state = _state(request)
    return state, _resolve(state, template_id, codec, pack)


def _layout_pack(request: Request, template_id: str, codec: str, name: str, *,
                 inline: bool = False) -> Response:
    """``GET /templates/<id>/<codec>/<pack_file>``: the route the edge reads packs by."""
    state, resolved = _resolve_request(request, template_id, codec, name)
    return _pack_file_response(request, state, resolved, inline=inline)


class _Blocking(Exception):
    """Raised by ``inline`` work that would read storage (units not checked yet): the fast
    path then runs it in a worker thread instead, as FastAPI runs the route."""


def _pack_sizes(state: ServerState, catalog: dict[str, Any]) -> list[dict[str, str]]:
    """``/healthz``'s size check: every pack the catalog names, against its manifest's
    ``pack_bytes`` (a stat each; kept for the catalog cache's TTL, 0 s for a folder).
    Entries ``{"pack", "error", "code"}`` for the packs that are not servable."""
    assert state.json_cache is not None
    now = time.monotonic()
    cached = state.health_sizes
    if cached is not None and cached[0] is catalog and now - cached[1] < state.json_cache.ttl_s:
        return cached[2]
    problems: list[dict[str, str]] = []
    for template_id, entry in sorted(catalog["templates"].items()):
        for codec, centry in sorted(entry.get("codecs", {}).items()):
            pack_file = centry.get("pack_file")
            where = (layout.pack_key(template_id, codec, pack_file) if pack_file
                     else f"templates/{template_id}/{codec}")
            try:
                resolved = _resolve(state, template_id, codec, None)
                where = resolved.pack_key
                size = state.storage.stat(resolved.pack_key).size
            except ApiError as exc:
                problems.append({"pack": where, "error": exc.message, "code": exc.code})
                continue
            except ObjectNotFound:
                problems.append({"pack": where, "error": _pack_missing(resolved),
                                 "code": ErrorCode.PUBLISH_BROKEN})
                continue
            except StorageError as exc:
                problems.append({"pack": where, "error": f"storage unavailable: {exc}"[:300],
                                 "code": ErrorCode.STORAGE_UNAVAILABLE})
                continue
            if size != resolved.index.pack_bytes:
                problems.append({"pack": where, "error": _size_mismatch(resolved, size),
                                 "code": ErrorCode.PACK_DAMAGED})
    state.health_sizes = (catalog, now, problems)
    return problems


def _gone(template_id: str, codec: str, pack_file: str) -> str:
    return (
        f"pack version {pack_file!r} of {template_id}/{codec} is not available "
        "(superseded and collected); fetch the current manifest"
    )


def _accepts_gzip(accept_encoding: str) -> bool:
    """Whether gzip is acceptable (RFC 9110 section 12.5.3): its own entry decides, else
    ``*``; ``q=0`` means not acceptable."""
    explicit: float | None = None
    star: float | None = None
    for item in accept_encoding.split(","):
        name, _, params = item.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
        name = name.strip().lower()
        if name in ("gzip", "x-gzip"):
            explicit = q if explicit is None else max(explicit, q)
        elif name == "*":
            star = q
    q = explicit if explicit is not None else star
    return q is not None and q > 0


def _cache_control(state: ServerState, immutable: bool) -> str:
    scope = "private" if state.tokens is not None else "public"
    if immutable:
        return f"{scope}, max-age={state.settings.max_age_immutable}, immutable"
    return f"{scope}, no-cache"


def _preconditions(request: Request, etag: str, headers: dict[str, str]) -> Response | None:
    """If-Match (412) and If-None-Match (304), RFC 9110 section 13.2.2 order."""
    if_match = parse_etag_list(request.headers.get("if-match"))
    if if_match is not None and not (
        "*" in if_match or any(strong_match(t, etag) for t in if_match)
    ):
        return _error(412, "If-Match precondition failed: the representation has changed", headers,
                      code=ErrorCode.PRECONDITION_FAILED)
    if_none_match = parse_etag_list(request.headers.get("if-none-match"))
    if if_none_match is not None and (
        "*" in if_none_match or any(weak_match(t, etag) for t in if_none_match)
    ):
        return Response(status_code=304, headers=headers)
    return None


def _open_pack(state: ServerState, resolved: Resolved) -> ObjectReader:
    try:
        reader = state.storage.open(resolved.pack_key)
    except ObjectNotFound as exc:
        if resolved.pinned:
            raise ApiError(
                404, _gone(resolved.template_id, resolved.codec, resolved.index.pack_file),
                code=ErrorCode.VERSION_GONE,
            ) from exc
        log.error("pack %s is missing", resolved.pack_key)
        raise ApiError(
            500, _pack_missing(resolved), code=ErrorCode.PUBLISH_BROKEN
        ) from exc
    except StorageError as exc:
        log.error("cannot open %s: %s", resolved.pack_key, exc)
        raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
    if reader.size != resolved.index.pack_bytes:
        reader.close()
        why = _size_mismatch(resolved, reader.size)
        log.error("%s (%s)", why, resolved.pack_key)
        raise ApiError(500, why, code=ErrorCode.PACK_DAMAGED)
    return reader


def _size_mismatch(resolved: Resolved, size: int) -> str:
    return (f"the pack of {resolved.template_id}/{resolved.codec} is damaged: it has {size} "
            f"bytes, its manifest says {resolved.index.pack_bytes} (truncated or corrupt); it "
            "is not served until it is repaired")


def _pack_missing(resolved: Resolved) -> str:
    return f"the pack of {resolved.template_id}/{resolved.codec} is missing from storage"


def _serve_body(
    request: Request,
    state: ServerState,
    resolved: Resolved,
    body: Body,
    etag: str,
    extra_headers: dict[str, str],
    prefetched: bytes | None = None,
    *,
    inline: bool = False,
) -> Response:
    """The full/206/multipart/416/304/412 response for ``body`` of ``resolved``'s pack.

    ``inline``: the caller runs on the event loop (:class:`_PackFastPath`), so raise
    :class:`_Blocking` rather than read and hash units that have not passed yet."""
    size = body.size
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "Cache-Control": _cache_control(state, resolved.pinned),
        "X-Content-Type-Options": "nosniff",
        **extra_headers,
    }
    early = _preconditions(request, etag, headers)
    if early is not None:
        return early
    method = request.method
    range_headers = request.headers.getlist("range") if method == "GET" else []
    range_header = range_headers[0] if len(range_headers) == 1 else None  # duplicates: ignored
    if range_header is not None:
        if_range = request.headers.get("if-range")
        if if_range is not None and not strong_match(if_range.strip(), etag):
            range_header = None  # stale validator (or a date): send the full representation
    try:
        wanted = parse_range(range_header, size, max_ranges=state.settings.max_ranges)
    except RangeRejected as exc:
        raise ApiError(400, f"Range header rejected: {exc}", code=ErrorCode.BAD_RANGE) from exc
    if wanted.kind is RangeKind.UNSATISFIABLE:
        headers["Content-Range"] = unsatisfied_content_range(size)
        return _error(416, f"range not satisfiable: the body has {size} bytes", headers,
                      code=ErrorCode.RANGE_NOT_SATISFIABLE)

    def read_pieces(rng: ByteRange) -> list[Piece]:
        if prefetched is not None:
            return [prefetched[rng.start : rng.stop]]
        return list(body.segments(rng.start, rng.stop))

    if wanted.kind is RangeKind.PARTIAL and len(wanted.ranges) == 1:
        rng = wanted.ranges[0]
        status, pieces = 206, read_pieces(rng)
        headers["Content-Range"] = rng.content_range(size)
        headers["Content-Type"] = OCTET
        length = rng.length
    elif wanted.kind is RangeKind.PARTIAL:
        boundary = secrets.token_hex(16)
        pieces = []
        length = 0
        for i, rng in enumerate(wanted.ranges):
            head = (
                ("\r\n" if i else "")
                + f"--{boundary}\r\nContent-Type: {OCTET}\r\nContent-Range: {rng.content_range(size)}\r\n\r\n"
            ).encode("ascii")
            pieces.append(head)
            pieces.extend(read_pieces(rng))
            length += len(head) + rng.length
        tail = f"\r\n--{boundary}--\r\n".encode("ascii")
        pieces.append(tail)
        length += len(tail)
        status = 206
        headers["Content-Type"] = f"multipart/byteranges; boundary={boundary}"
    else:
        status, pieces, length = 200, read_pieces(ByteRange(0, size)) if size else [], size
        headers["Content-Type"] = OCTET
    headers["Content-Length"] = str(length)
    send_body = method != "HEAD" and length > 0
    needs_reader = any(not isinstance(p, bytes) for p in pieces)
    reader = _open_pack(state, resolved) if needs_reader else None
    if reader is not None and send_body:
        spans = [p for p in pieces if isinstance(p, tuple)]
        if inline and not state.verifier.cached(reader, resolved, spans):
            reader.close()
            raise _Blocking
        try:  # never send bytes the manifest's checksums do not vouch for
            state.verifier.verify(reader, resolved, spans)
        except BaseException:
            reader.close()
            raise
    return PackResponse(
        reader,
        pieces,
        status_code=status,
        headers=headers,
        send_body=send_body,
        chunk_size=state.settings.chunk_size,
    )


def _shard_hash(
    state: ServerState, resolved: Resolved, shard: int, config: int, body: Body
) -> tuple[str, bytes | None]:
    """sha256 of a shard body whose units passed their checksums (cached per version on
    storage); returns the body too when it was read to hash it."""
    assert state.hashes is not None
    reader = _open_pack(state, resolved)
    try:
        state.verifier.verify(reader, resolved, body.spans)
        key = (resolved.pack_key, reader.info.etag, shard, config)
        cached = state.hashes.get(key)
        if cached is not None:
            return cached, None
        digest = hashlib.sha256()
        keep = body.size <= state.settings.buffer_limit
        parts: list[bytes] = []
        for offset, length in body.segments(0, body.size):
            for chunk in reader.iter_range(offset, offset + length, state.settings.chunk_size):
                digest.update(chunk)
                if keep:
                    parts.append(chunk)
    except StorageError as exc:
        log.error("reading %s failed: %s", resolved.pack_key, exc)
        raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
    finally:
        reader.close()
    value = digest.hexdigest()
    state.hashes.put(key, value)
    return value, b"".join(parts) if keep else None


def create_app(
    storage: Storage,
    tokens: TokenSet | None = None,
    *,
    settings: ServerSettings | None = None,
) -> FastAPI:
    """The SAKURA template server over ``storage``; ``tokens`` enables bearer auth."""
    settings = settings or ServerSettings()
    app = FastAPI(
        title="SAKURA template server",
        version="1",
        summary="Template catalog, pack manifests, raw packs with HTTP Range, and shard bodies.",
        description=(
            "Serves published SAKURA template packs. `/v1/*` routes need `Authorization: Bearer "
            "<token>` when the server runs with tokens; `/healthz`, `/metrics` and the OpenAPI "
            'documents are always open. Errors are JSON objects `{"error": "...", "code": "..."}`; '
            "`code` is stable (see cloud/README.md), the message is for people."
        ),
    )
    app.state.sakura = ServerState(storage, tokens, settings)
    app.add_middleware(_PackFastPath, fastapi_app=app)  # innermost: behind the guard, counted
    app.add_middleware(_PathGuard)
    app.add_middleware(MetricsMiddleware, metrics=app.state.sakura.metrics)
    bearer = HTTPBearer(
        auto_error=False, description="Bearer token (only when the server runs with tokens)"
    )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.headers, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such route: {request.url.path[:200]}"
        return _error(exc.status_code, message, getattr(exc, "headers", None),
                      code=ErrorCode.for_status(exc.status_code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(400, f"invalid request: {where}: {first.get('msg', 'invalid')}",
                      code=ErrorCode.BAD_REQUEST)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error(500, "internal server error", code=ErrorCode.INTERNAL)

    def get_head(path: str, **kwargs: Any) -> Any:
        """Register a route for GET and HEAD (distinct OpenAPI operation ids)."""

        def deco(endpoint: Any) -> Any:
            for method in ("GET", "HEAD"):
                app.add_api_route(path, endpoint, methods=[method],
                                  operation_id=f"{method.lower()}_{endpoint.__name__}", **kwargs)
            return endpoint

        return deco

    @get_head("/healthz", tags=["operations"],
              summary="Health: the catalog is readable (503 otherwise); damaged packs (failed "
                      "checksums, or a size other than the manifest's) listed (no auth)")
    def healthz(request: Request) -> JSONResponse:
        state = _state(request)
        try:
            catalog = _catalog(state)
        except ApiError as exc:
            return JSONResponse({"status": "error", "error": exc.message, "code": exc.code},
                                status_code=503)
        damaged = {d["pack"]: d for d in state.verifier.damaged()}
        damaged.update((d["pack"], d) for d in _pack_sizes(state, catalog))  # the newer news
        listed = [damaged[k] for k in sorted(damaged)]
        return JSONResponse({"status": "degraded" if listed else "ok", "damaged": listed})

    @get_head(
        "/metrics",
        tags=["operations"],
        summary="Prometheus metrics (no auth)",
        response_class=PlainTextResponse,
    )
    def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @get_head(
        "/v1/templates",
        tags=["catalog"],
        summary="The template catalog (catalog.json, filtered by token scope)",
    )
    def list_templates(
        request: Request, _c: HTTPAuthorizationCredentials | None = Security(bearer)
    ) -> Response:
        state = _state(request)
        grant = _grant(request)
        catalog = _catalog(state)
        visible = {k: v for k, v in catalog["templates"].items() if grant.allows(k)}
        document = {**catalog, "templates": visible}
        raw = json.dumps(document, separators=(",", ":")).encode()
        etag = '"' + hashlib.sha256(raw).hexdigest()[:32] + '"'
        headers = {"ETag": etag, "Cache-Control": _cache_control(state, False)}
        return _preconditions(request, etag, headers) or Response(
            raw, media_type="application/json", headers=headers
        )

    @get_head(
        "/v1/templates/{template_id}", tags=["catalog"], summary="One template's catalog entry"
    )
    def get_template(
        request: Request,
        template_id: str,
        _c: HTTPAuthorizationCredentials | None = Security(bearer),
    ) -> Response:
        _check_template_id(template_id)
        _authorize(request, template_id)
        state = _state(request)
        entry = _catalog(state)["templates"].get(template_id)
        if entry is None:
            raise ApiError(404, f"unknown template {template_id!r}", code=ErrorCode.UNKNOWN_TEMPLATE)
        return JSONResponse(entry, headers={"Cache-Control": _cache_control(state, False)})

    @get_head(
        "/v1/templates/{template_id}/{codec}/manifest",
        tags=["packs"],
        summary="The manifest (JSON); ETag is the quoted pack sha256",
    )
    def get_manifest(
        request: Request,
        template_id: str,
        codec: str,
        pack: str | None = None,
        _c: HTTPAuthorizationCredentials | None = Security(bearer),
    ) -> Response:
        state, resolved = _resolve_request(request, template_id, codec, pack)
        return _manifest_response(request, state, resolved)

    def get_pack(
        request: Request,
        template_id: str,
        codec: str,
        pack: str | None = None,
        _c: HTTPAuthorizationCredentials | None = Security(bearer),
    ) -> Response:
        state, resolved = _resolve_request(request, template_id, codec, pack)
        body = Body(((0, resolved.index.pack_bytes),))
        extra = {"X-Sakura-Pack-File": resolved.index.pack_file}
        return _serve_body(request, state, resolved, body, resolved.etag, extra)

    _add_get_head(
        app,
        "/v1/templates/{template_id}/{codec}/pack",
        get_pack,
        "pack",
        "The raw pack with full HTTP Range support (206, multipart/byteranges, 416, If-Range)",
    )

    def get_shard(
        request: Request,
        template_id: str,
        codec: str,
        shard: str,
        config: str,
        pack: str | None = None,
        _c: HTTPAuthorizationCredentials | None = Security(bearer),
    ) -> Response:
        shard_i, config_i = _int_param(shard, "shard"), _int_param(config, "config")
        state, resolved = _resolve_request(request, template_id, codec, pack)
        entry = resolved.index.config(shard_i, config_i)
        if entry is None:
            if not any(s == shard_i for s, _ in resolved.index.configs):
                raise ApiError(404, f"{template_id}/{codec} has no shard {shard_i}",
                               code=ErrorCode.NOT_FOUND)
            raise ApiError(
                404, f"shard {shard_i} of {template_id}/{codec} has no config {config_i}",
                code=ErrorCode.NOT_FOUND,
            )
        body = Body(entry.ranges)
        etag = f'"{resolved.index.pack_sha256}:{shard_i}:{config_i}"'
        sha, prefetched = _shard_hash(state, resolved, shard_i, config_i, body)
        extra = {
            "X-Sakura-Sha256": sha,
            "X-Sakura-Pack-Etag": resolved.etag,
            "X-Sakura-Pack-File": resolved.index.pack_file,
        }
        return _serve_body(request, state, resolved, body, etag, extra, prefetched)

    _add_get_head(
        app,
        "/v1/templates/{template_id}/{codec}/shards/{shard}/{config}",
        get_shard,
        "shard",
        "Exactly the bytes of one configuration of one shard (Range supported for resume)",
    )

    # the published layout itself, as nginx or an S3 bucket serve it (what the edge reads)
    def get_layout_catalog(
        request: Request, _c: HTTPAuthorizationCredentials | None = Security(bearer)
    ) -> Response:
        return list_templates(request)

    _add_get_head(
        app,
        "/" + layout.CATALOG_KEY,
        get_layout_catalog,
        "layout_catalog",
        "catalog.json of the published layout (filtered by token scope)",
        json_body=True,
    )

    def get_layout_file(
        request: Request,
        template_id: str,
        codec: str,
        name: str,
    ) -> Response:
        # the route the edge reads packs by: no FastAPI Security dependency (its solving
        # was a fifth of the server's CPU per range under `sakura bench serve`); the token
        # is checked by _authorize in _resolve_request as on every route, and the OpenAPI
        # document still lists the bearer requirement (openapi_extra below)
        if name == layout.MANIFEST_NAME:
            state, resolved = _resolve_request(request, template_id, codec, None)
            return _manifest_response(request, state, resolved)
        if name.endswith(".manifest.json"):
            pack_file = name.removesuffix(".manifest.json") + ".pack"
            state, resolved = _resolve_request(request, template_id, codec, pack_file)
            return _manifest_response(request, state, resolved)
        if layout.valid_pack_file(name):
            return _layout_pack(request, template_id, codec, name)
        _check_template_id(template_id)
        _check_codec(codec)
        raise ApiError(404, f"no file {name[:80]!r} in the layout of {template_id}/{codec}",
                       code=ErrorCode.NOT_FOUND)

    _add_get_head(
        app,
        "/templates/{template_id}/{codec}/{name}",
        get_layout_file,
        "layout_file",
        "A file of the published layout: manifest.json, <pack>.manifest.json or the "
        "immutable pack itself (the Range rules of /v1/.../pack)",
        openapi_extra={"security": [{"HTTPBearer": []}]},
    )
    return app


def _add_get_head(
    app: FastAPI, path: str, endpoint: Any, name: str, summary: str, json_body: bool = False,
    openapi_extra: dict[str, Any] | None = None,
) -> None:
    """Register ``endpoint`` for GET and HEAD with distinct OpenAPI operation ids."""
    responses: dict[int | str, dict[str, Any]] = {
        200: {
            "description": "The full body",
            "content": {"application/json" if json_body else OCTET: {}},
        },
        206: {"description": "Partial content (one range, or multipart/byteranges)"},
        304: {"description": "Not modified (If-None-Match)"},
        400: {"description": "Invalid id or rejected Range header"},
        404: {"description": "Unknown template, codec, shard or config"},
        412: {"description": "If-Match failed"},
        416: {"description": "Range not satisfiable"},
    }
    for method in ("GET", "HEAD"):
        app.add_api_route(
            path,
            endpoint,
            methods=[method],
            tags=["packs"],
            summary=summary,
            response_class=Response,
            responses=responses,
            operation_id=f"{method.lower()}_{name}",
            openapi_extra=openapi_extra,
        )


class _PathGuard:
    """Rejects methods other than GET and HEAD (405, or 501 for unknown ones) and request
    targets with encoded slashes/backslashes/NULs or dot segments (400)."""

    _BAD_RAW = (b"%2f", b"%5c", b"%00", b"\\")

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD"):
            method = str(scope.get("method", ""))
            response = _error(
                405 if method in METHODS else 501,
                f"method {method[:16]!r} is not supported: this server answers GET and HEAD",
                {"Allow": "GET, HEAD"},
                code=ErrorCode.METHOD_NOT_ALLOWED,
            )
            await response(scope, receive, send)
            return
        if scope["type"] == "http":
            raw = (
                scope.get("raw_path") or scope.get("path", "").encode("utf-8", "surrogateescape")
            ).lower()
            path = scope.get("path", "")
            segments = path.split("/")
            if (
                any(bad in raw for bad in self._BAD_RAW)
                or "\x00" in path
                or any(s in (".", "..") for s in segments)
            ):
                response = _error(
                    400,
                    "invalid request path: encoded slashes, backslashes, NULs and dot segments are not allowed",
                    code=ErrorCode.BAD_REQUEST,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _PackFastPath:
    """ASGI middleware answering ``GET``/``HEAD /templates/<id>/<codec>/<pack_file>`` (the
    route the edge reads every configuration by) without FastAPI's routing, ``Request``
    dependency solving and worker-thread hop; everything else goes to FastAPI unchanged.

    It sits inside :class:`_PathGuard` and the metrics middleware (so both apply as to any
    route; ``scope["route"]`` is set to the FastAPI route, so the metrics label is the
    same), and builds the response with the functions the FastAPI route calls
    (:func:`_layout_pack`: token check, catalog resolution, one Range parse, the unit
    check), so what is verified, what is sent and every error stay those of the route.
    The work runs on the event loop: for a local folder it is a ``stat`` of catalog.json,
    an ``open`` of the pack and a set lookup in the verified-unit cache (catalog.json and a
    new manifest are read and parsed there once per change, as the JSON caches do). A
    range with units not checked yet raises :class:`_Blocking` before any is read, and the
    request is done again in a worker thread, as FastAPI would run it. A bucket (S3) is
    never served here: its reads are network calls.

    Why (issue 29 item 7): profiled under ``sakura bench serve`` (py-spy, one process),
    FastAPI's handling around this one route (routing over every route, ``Request`` and
    dependency solving, exception wrappers) and the worker-thread hop with its GIL
    hand-over (``Condition.notify`` alone 7% of the GIL-holding samples) were most of the
    Python per range that was not the send. Measured as the server's CPU time per range
    (``/proc/<pid>/stat``, 32 clients, the same build otherwise): 1829 -> 1311 and
    1432 -> 862 us in two alternating runs on the shared 2-core host.
    """

    ROUTE = "/templates/{template_id}/{codec}/{name}"

    def __init__(self, app: Any, fastapi_app: FastAPI) -> None:
        self.app = app
        self.fastapi_app = fastapi_app
        self.routes: dict[str, Any] | None = None

    def _routes(self) -> dict[str, Any]:
        if self.routes is None:  # the routes are added after the middleware
            self.routes = {
                method: route for route in self.fastapi_app.router.routes
                if getattr(route, "path", None) == self.ROUTE
                for method in getattr(route, "methods", ())
            }
        return self.routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        parts = scope["path"].split("/")
        state: ServerState = self.fastapi_app.state.sakura
        route = self._routes().get(scope["method"])
        if (
            len(parts) != 5
            or parts[1] != "templates"
            or route is None
            or not (parts[2] and parts[3] and layout.valid_pack_file(parts[4]))
            or not isinstance(state.storage, LocalStorage)
        ):
            await self.app(scope, receive, send)
            return
        _, _, template_id, codec, name = parts
        scope["route"] = route
        scope["endpoint"] = route.endpoint
        scope["path_params"] = {"template_id": template_id, "codec": codec, "name": name}
        request = Request(scope, receive)
        try:
            try:
                response = _layout_pack(request, template_id, codec, name, inline=True)
            except _Blocking:
                response = await anyio.to_thread.run_sync(
                    _layout_pack, request, template_id, codec, name)
        except ApiError as exc:
            response = _error(exc.status, exc.message, exc.headers, code=exc.code)
        await response(scope, receive, send)
