"""The edge's HTTP client (aiohttp): catalog, manifests and shard bodies from a SAKURA server.

Every request names only public things: the template id, the codec (which pack), the
shard index, the configuration id and the pack version (``?pack=<pack_file>`` from the
manifest, so that every shard of one edit comes from the same immutable pack even if the
provider republishes meanwhile). Nothing derived from the user's image, prompt, mask,
seed or embeddings is ever sent: there are no request bodies and no custom headers
besides an optional bearer token. ``request_log`` (a list) receives a
:class:`RequestRecord` for every request actually sent, retries included.

Shard bodies are verified twice: the sha256 of the whole body against the server's
``X-Sakura-Sha256`` header (when the manifest is not known) and, when the manifest is
given, the exact length and the sha256 of every range unit the configuration is made of
(the manifest's ``units`` table), so a corrupted pack on the server is caught too.

Manifests: with a ``manifests`` dict (the device's manifest cache, kept across edits) a
known manifest is revalidated with ``If-None-Match: <etag>`` (the pack sha256) and a 304
answer moves no body, as a video player keeps a stream's manifest.

Failures: a dropped connection or read timeout resumes the body with
``Range: bytes=N-`` and ``If-Range: <etag>`` (a 200 answer restarts from byte 0); a
corrupted body is refetched from scratch; 5xx / 408 / 429 answers and connection errors
are retried with exponential backoff. After ``max_attempts`` consecutive attempts without
progress the client raises :class:`ServerUnreachable` with the URL and the last error; a
4xx answer raises :class:`EdgeError` with the server's message at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
from sakura.edge.errors import EdgeError, IntegrityError, ServerUnreachable

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class RequestRecord:
    """One request as it left the client."""

    method: str
    url: str
    headers: dict[str, str]
    time: float


@dataclass(frozen=True)
class RetryPolicy:
    """Timeouts and retry limits of the client."""

    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0   # longest silence inside one response (outages)
    max_attempts: int = 6          # consecutive attempts without progress before giving up
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0
    max_refetch: int = 3           # refetches of a body that fails verification

    def delay(self, failures: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, failures - 1))


@dataclass(frozen=True)
class BodySpec:
    """What a configuration's body must be: its length and unit (length, sha256) in order."""

    nbytes: int
    units: tuple[tuple[int, str], ...] = ()

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], shard: int, config: int) -> BodySpec:
        entry = config_entry(manifest, shard, config)
        table = manifest.get("units") or []
        units = []
        for u in entry.get("units") or []:
            _off, length, sha = table[int(u)][:3]
            units.append((int(length), str(sha)))
        nbytes = int(entry["bytes"])
        if units and sum(n for n, _ in units) != nbytes:
            raise EdgeError(f"manifest: shard {shard} config {config}: units do not add up "
                            f"to its {nbytes} bytes")
        return cls(nbytes, tuple(units))

    def verify(self, data: bytes) -> str | None:
        """None when ``data`` is the body, else what is wrong."""
        if len(data) != self.nbytes:
            return f"{len(data)} bytes, expected {self.nbytes}"
        pos = 0
        for i, (length, sha) in enumerate(self.units):
            if hashlib.sha256(data[pos : pos + length]).hexdigest() != sha:
                return f"unit {i} (bytes {pos}..{pos + length}) fails its checksum"
            pos += length
        return None


def config_entry(manifest: Mapping[str, Any], shard: int, config: int) -> Mapping[str, Any]:
    for s in manifest.get("shards", []):
        if int(s["index"]) == shard:
            for c in s["configs"]:
                if int(c["id"]) == config:
                    return c
            raise EdgeError(f"manifest: shard {shard} has no configuration {config}")
    raise EdgeError(f"manifest: no shard {shard}")


@dataclass
class Fetched:
    """A verified body and how getting it went (monotonic clock times)."""

    data: bytes
    start: float
    first_byte: float
    end: float
    attempts: int = 1
    resumes: int = 0
    refetches: int = 0


@dataclass
class _Attempt:
    progressed: bool = False
    error: str = ""


@dataclass(frozen=True)
class CachedManifest:
    """A manifest kept on the device, with the ETag (pack sha256) to revalidate it."""

    etag: str
    data: dict[str, Any]
    size: int


@dataclass(frozen=True)
class ManifestFetch:
    """A manifest and how it was obtained (``size`` 0: revalidated from the cache)."""

    data: dict[str, Any]
    size: int
    start: float
    first_byte: float
    end: float
    cached: bool
    etag: str | None


@dataclass(frozen=True)
class _JsonGot:
    data: Any
    size: int
    start: float
    first_byte: float
    end: float
    etag: str | None
    not_modified: bool = False


class _Retry(Exception):
    """An answer worth retrying (5xx, 408, 429, mismatched partial content)."""


@dataclass
class PackClient:
    """Async client of one SAKURA server. Use ``async with PackClient(url) as c: ...``."""

    base_url: str
    token: str | None = None
    request_log: list[RequestRecord] | None = None
    manifests: dict[tuple[str, str], CachedManifest] | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    chunk_size: int = 64 * 1024
    _session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise EdgeError(f"server URL must start with http:// or https://, got "
                            f"{self.base_url[:80]!r}")

    # ------------------------------------------------------------------ session
    async def __aenter__(self) -> PackClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        if self._session is not None:
            return
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._on_request_start)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.retry.connect_timeout_s,
                                        sock_read=self.retry.read_timeout_s)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._session = aiohttp.ClientSession(
            timeout=timeout, headers=headers, trace_configs=[trace],
            connector=aiohttp.TCPConnector(limit=8))

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _on_request_start(self, _session: Any, _ctx: Any,
                                params: aiohttp.TraceRequestStartParams) -> None:
        if self.request_log is not None:
            self.request_log.append(RequestRecord(params.method, str(params.url),
                                                  dict(params.headers), time.monotonic()))

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EdgeError("PackClient is not open (use `async with PackClient(...)`)")
        return self._session

    # ------------------------------------------------------------------ URLs
    def _url(self, *parts: str | int) -> str:
        return self.base_url + "/v1/templates" + "".join(
            "/" + quote(str(p), safe="") for p in parts)

    # ------------------------------------------------------------------ API
    async def catalog(self) -> dict[str, Any]:
        """The server's template catalog (``GET /v1/templates``)."""
        got = await self._get_json(self._url())
        return got.data

    async def template_entry(self, template: str) -> dict[str, Any]:
        """One template's catalog entry (``GET /v1/templates/{id}``): codecs, metadata and
        the template assets the device needs (image, mask, steps, ...)."""
        got = await self._get_json(self._url(template))
        if not isinstance(got.data, dict):
            raise EdgeError(f"{template}: the server's catalog entry is not a JSON object")
        return got.data

    async def manifest(self, template: str, codec: str) -> dict[str, Any]:
        """The current manifest of a template's pack for ``codec``, checked for identity."""
        return (await self.manifest_fetch(template, codec)).data

    async def manifest_fetch(self, template: str, codec: str) -> ManifestFetch:
        """:meth:`manifest` with transfer details. With a :attr:`manifests` cache, a cached
        manifest is revalidated (``If-None-Match``; a 304 moves no body)."""
        key = (template, codec)
        cached = self.manifests.get(key) if self.manifests is not None else None
        got = await self._get_json(self._url(template, codec, "manifest"),
                                   etag=cached.etag if cached else None)
        if got.not_modified and cached is not None:
            return ManifestFetch(cached.data, 0, got.start, got.first_byte, got.end, True,
                                 cached.etag)
        data = got.data
        if not isinstance(data, dict) or data.get("format") != "sakura-pack":
            raise EdgeError(f"{template}/{codec}: the server's manifest is not a sakura-pack")
        if data.get("version") != 1:
            raise EdgeError(f"{template}/{codec}: unsupported pack version "
                            f"{data.get('version')!r} (this client reads version 1)")
        if data.get("template_id") != template or data.get("codec") != codec:
            raise EdgeError(f"asked for {template}/{codec}, the manifest is for "
                            f"{data.get('template_id')}/{data.get('codec')}")
        if self.manifests is not None and got.etag:
            self.manifests[key] = CachedManifest(got.etag, data, got.size)
        return ManifestFetch(data, got.size, got.start, got.first_byte, got.end, False,
                             got.etag)

    async def fetch_config(self, template: str, codec: str, shard: int, config: int, *,
                           manifest: Mapping[str, Any] | None = None,
                           progress: Callable[[int], None] | None = None) -> Fetched:
        """The verified bytes of one configuration of one shard (see the module doc)."""
        url = self._url(template, codec, "shards", int(shard), int(config))
        params = {}
        spec = None
        if manifest is not None:
            spec = BodySpec.from_manifest(manifest, shard, config)
            if manifest.get("pack_file"):
                params["pack"] = str(manifest["pack_file"])
        return await self._fetch_body(url, params, spec, progress)

    # ------------------------------------------------------------------ internals
    async def _get_json(self, url: str, etag: str | None = None) -> _JsonGot:
        failures = 0
        last = ""
        headers = {"If-None-Match": etag} if etag else {}
        start = time.monotonic()
        while True:
            try:
                async with self.session.get(url, headers=headers) as resp:
                    if resp.status == 304 and etag:
                        now = time.monotonic()
                        return _JsonGot(None, 0, start, now, now, etag, True)
                    if resp.status != 200:
                        await self._raise_for(resp, url)
                    first = time.monotonic()
                    raw = await resp.read()
                    end = time.monotonic()
                    try:
                        data = json.loads(raw)
                    except ValueError as exc:
                        raise EdgeError(f"{url}: the server sent invalid JSON ({exc})") from exc
                    # the bytes on the wire (a gzip-encoded manifest is decoded by aiohttp):
                    # the monitor's rate sample must not count the decompressed size
                    wire = resp.headers.get("Content-Length")
                    size = int(wire) if wire and wire.isdigit() else len(raw)
                    return _JsonGot(data, size, start, first, end, resp.headers.get("ETag"))
            except (TimeoutError, _Retry, aiohttp.ClientError, OSError) as exc:
                failures += 1
                last = _describe(exc)
                if failures >= self.retry.max_attempts:
                    raise self._unreachable(url, failures, last) from exc
                await asyncio.sleep(self.retry.delay(failures))

    async def _raise_for(self, resp: aiohttp.ClientResponse, url: str) -> None:
        if resp.status in RETRY_STATUS:
            raise _Retry(f"HTTP {resp.status}")
        try:
            message = (await resp.json(content_type=None)).get("error", "")
        except (ValueError, AttributeError, aiohttp.ClientError):
            message = ""
        raise EdgeError(f"{url}: HTTP {resp.status}" + (f": {message}" if message else ""))

    def _unreachable(self, url: str, attempts: int, last: str) -> ServerUnreachable:
        return ServerUnreachable(
            f"cannot reach the SAKURA server at {self.base_url} ({url}): {last} "
            f"(gave up after {attempts} attempts without progress); check that the server is "
            "running (`sakura serve DIR`) and the URL and network are right")

    async def _fetch_body(self, url: str, params: dict[str, str], spec: BodySpec | None,
                          progress: Callable[[int], None] | None = None) -> Fetched:
        buf = bytearray()
        etag: str | None = None
        sha: str | None = None
        start = time.monotonic()
        first_byte: float | None = None
        failures = attempts = resumes = refetches = 0
        last = ""
        while True:
            attempts += 1
            attempt = _Attempt()
            headers = {}
            if buf and etag:
                headers = {"Range": f"bytes={len(buf)}-", "If-Range": etag}
                resumes += 1
            elif buf:
                buf.clear()
            try:
                async with self.session.get(url, params=params, headers=headers) as resp:
                    if resp.status == 206 and headers:
                        got = resp.headers.get("Content-Range", "")
                        if not got.startswith(f"bytes {len(buf)}-"):
                            message = f"partial content {got!r} does not resume at {len(buf)}"
                            buf.clear()
                            raise _Retry(message)
                    elif resp.status == 200:
                        buf.clear()
                    elif resp.status == 416:
                        buf.clear()
                        etag = None
                        raise _Retry("range not satisfiable")
                    else:
                        await self._raise_for(resp, url)
                    etag = resp.headers.get("ETag") or etag
                    sha = resp.headers.get("X-Sakura-Sha256") or sha
                    async for chunk in resp.content.iter_chunked(self.chunk_size):
                        if first_byte is None:
                            first_byte = time.monotonic()
                        buf += chunk
                        attempt.progressed = True
                        if progress is not None:
                            progress(len(buf))
            except (TimeoutError, _Retry, aiohttp.ClientError, OSError) as exc:
                attempt.error = _describe(exc)
            if not attempt.error:
                data = bytes(buf)
                problem = self._check(data, spec, sha)
                if problem is None:
                    end = time.monotonic()
                    return Fetched(data, start, first_byte or end, end, attempts, resumes,
                                   refetches)
                refetches += 1
                if refetches > self.retry.max_refetch:
                    raise IntegrityError(f"{url}: the body keeps failing verification: {problem}"
                                         f" (after {refetches} fetches)")
                buf.clear()
                etag = None
                continue
            last = attempt.error
            failures = 0 if attempt.progressed else failures + 1
            if failures >= self.retry.max_attempts:
                raise self._unreachable(url, failures, last)
            if failures:
                await asyncio.sleep(self.retry.delay(failures))

    @staticmethod
    def _check(data: bytes, spec: BodySpec | None, sha: str | None) -> str | None:
        if sha is not None and hashlib.sha256(data).hexdigest() != sha.strip().lower():
            return "sha256 differs from X-Sakura-Sha256"
        if spec is not None:
            return spec.verify(data)
        if sha is None:
            return "the server sent no X-Sakura-Sha256 and no manifest was given"
        return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
