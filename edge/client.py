"""The edge's HTTP client (aiohttp): catalog, manifests and pack byte ranges from any origin.

:class:`PackClient` is this module; the mechanisms it is built from live beside it, and
every name other modules import from here (``from sakura.edge.client import ...``) still is
here (``__all__``):

- ``edge/origins.py``: the three kinds of origin (``sakura serve``, nginx or a CDN, an S3
  bucket) and the keys of the published layout; :class:`PackLocation`;
- ``edge/body_spec.py``: what a configuration's body must be (:class:`BodySpec`) and which
  configurations are prefixes of which (:func:`prefix_fallbacks`, :func:`prefix_extensions`);
- ``edge/transfer.py``: one body on its way in, verified unit by unit (:class:`Transfer`,
  :class:`Fetched`), and the rules of the deadline-true receive;
- ``edge/retry.py``: which failures are retried and for how long (:class:`RetryPolicy`), the
  hedged catalog and manifest requests (:data:`HEDGE_JSON_S`, :data:`HEDGE_JSON_ATTEMPTS`)
  and the words of giving up.

A shard configuration is ONE byte range of the pack (pack format 2, ``codec/FORMAT.md``), so
:meth:`PackClient.fetch_config` is one ``GET`` of the pack URL with ``Range: bytes=a-b``. The
pack's name holds its content hash, so a request is pinned to one version by its URL; a
dropped body resumes with a narrower ``Range`` and ``If-Range: <the ETag the origin sent>``
(a ``200`` answer there means the object changed: the range restarts from scratch). Every
body is checked against the manifest (exact length and the sha256 of every unit of the
range) before it is returned; a body that fails is fetched again, then refused
(:class:`IntegrityError`).

Units are verified as they arrive, into a :class:`Transfer` (``edge/transfer.py``). A
``Content-Range`` whose total is not the manifest's ``pack_bytes`` (a truncated or replaced
object), an origin that ignores ``Range`` and a ``416`` are clear errors, never wrong bytes.
:meth:`PackClient.pack_location` gives the plain request (URL and headers) for anyone else
fetching ranges, e.g. the native receiver.

Nothing derived from the user's image, prompt, mask, seed or embeddings is ever sent: only
the template id, codec, pack name and byte ranges (which the manifest maps to shard and
configuration), and an optional bearer token. ``request_log`` (a list) receives a
:class:`RequestRecord` for every request actually sent, retries included.

Manifests: with a ``manifests`` dict (the device's manifest cache, kept across edits) a
known manifest is revalidated with ``If-None-Match: <etag>`` and a 304 answer moves no body.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from sakura.codec.manifest import FORMAT as MANIFEST_FORMAT
from sakura.codec.manifest import VERSION as MANIFEST_VERSION
from sakura.edge.body_spec import BodySpec, config_entry, prefix_extensions, prefix_fallbacks
from sakura.edge.errors import (
    EdgeError,
    IntegrityError,
    OriginError,
    ServerUnreachable,
    VersionGone,
)
from sakura.edge.origins import (
    CATALOG_KEY,
    PRESIGN_EXPIRES_S,
    HttpOrigin,
    PackLocation,
    S3Origin,
    _check_ids,
    manifest_key,
    pack_key,
)
from sakura.edge.retry import (
    HEDGE_JSON_ATTEMPTS,
    HEDGE_JSON_S,
    PERMANENT_CODES,
    RETRY_STATUS,
    RetryPolicy,
    _describe,
    _error_code,
    _error_message,
    _read_small,
    _Retry,
)
from sakura.edge.transfer import Fetched, Transfer

__all__ = [
    "CATALOG_KEY", "HEDGE_JSON_ATTEMPTS", "HEDGE_JSON_S", "PERMANENT_CODES",
    "PRESIGN_EXPIRES_S", "RETRY_STATUS", "BodySpec", "CachedManifest", "Fetched",
    "HttpOrigin", "ManifestFetch", "PackClient", "PackLocation", "RequestRecord",
    "RetryPolicy", "S3Origin", "Transfer", "config_entry", "manifest_key", "pack_key",
    "prefix_extensions", "prefix_fallbacks",
]

# MANIFEST_FORMAT / MANIFEST_VERSION: the manifest schema's (sakura.codec.manifest)
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


@dataclass(frozen=True)
class RequestRecord:
    """One request as it left the client."""

    method: str
    url: str
    headers: dict[str, str]
    time: float


@dataclass(frozen=True)
class CachedManifest:
    """A manifest kept on the device, with the ETag to revalidate it."""

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


# ---------------------------------------------------------------------------- client


@dataclass
class PackClient:
    """Async client of one origin. Use ``async with PackClient(url) as c: ...``."""

    base_url: str
    token: str | None = None
    request_log: list[RequestRecord] | None = None
    manifests: dict[tuple[str, str], CachedManifest] | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    chunk_size: int = 64 * 1024
    # told, one line per retry without progress, what the client is waiting for
    # (``sakura edit`` prints it: "sakura: waiting for URL: connection refused, retry 3 ...")
    on_wait: Callable[[str], None] | None = None
    _rng: random.Random = field(default_factory=random.Random, init=False, repr=False)
    _session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)
    _fresh_session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)
    _etags: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.base_url = str(self.base_url).rstrip("/")
        if self.base_url.startswith(("http://", "https://")):
            self.origin: HttpOrigin | S3Origin = HttpOrigin(self.base_url, self.token)
        elif self.base_url.startswith("s3://"):
            self.origin = S3Origin(self.base_url)
        else:
            raise EdgeError(f"the origin URL must start with http://, https:// or s3://, got "
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
        self._session = self._new_session(aiohttp.TCPConnector(limit=8))

    def _new_session(self, connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._on_request_start)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.retry.connect_timeout_s,
                                        sock_read=self.retry.read_timeout_s)
        return aiohttp.ClientSession(timeout=timeout, trace_configs=[trace],
                                     connector=connector)

    def _fresh(self) -> aiohttp.ClientSession:
        """The session of restarted transfers: every request on a new connection."""
        _ = self.session  # (raises when the client is not open)
        if self._fresh_session is None:
            self._fresh_session = self._new_session(aiohttp.TCPConnector(limit=8,
                                                                         force_close=True))
        return self._fresh_session

    async def close(self) -> None:
        session, self._session = self._session, None
        fresh, self._fresh_session = self._fresh_session, None
        for s in (session, fresh):
            if s is not None:
                await s.close()

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

    # ------------------------------------------------------------------ API
    def pack_location(self, template: str, codec: str,
                      manifest: Mapping[str, Any]) -> PackLocation:
        """The plain request that reads byte ranges of ``manifest``'s pack (see
        :class:`PackLocation`): the URL names the pack file, so it is version-pinned."""
        key = pack_key(template, codec, manifest.get("pack_file"))  # type: ignore[arg-type]
        url = self.origin.url(key)
        return PackLocation(url, self.origin.headers(), self._etags.get(key))

    async def catalog(self) -> dict[str, Any]:
        """The origin's template catalog (``catalog.json``; ``sakura serve`` filters it to
        the templates the token may see)."""
        got = await self._get_json(CATALOG_KEY)
        if not isinstance(got.data, dict) or not isinstance(got.data.get("templates"), dict):
            raise EdgeError(f"{self.base_url}: catalog.json is not a SAKURA catalog")
        return got.data

    async def template_entry(self, template: str) -> dict[str, Any]:
        """One template's catalog entry: codecs, metadata and the template assets the device
        needs (image, mask, steps, ...)."""
        _check_ids(template, None)
        entry = (await self.catalog())["templates"].get(template)
        if entry is None:
            raise OriginError(f"{self.base_url}: unknown template {template!r} (not in its "
                              "catalog, or not visible to this token)")
        if not isinstance(entry, dict):
            raise EdgeError(f"{template}: the catalog entry is not a JSON object")
        return entry

    async def manifest(self, template: str, codec: str) -> dict[str, Any]:
        """The current manifest of a template's pack for ``codec``, checked for identity."""
        return (await self.manifest_fetch(template, codec)).data

    async def manifest_fetch(self, template: str, codec: str,
                             revalidate: bool = True) -> ManifestFetch:
        """:meth:`manifest` with transfer details. With a :attr:`manifests` cache, a cached
        manifest is revalidated (``If-None-Match``; a 304 moves no body) unless
        ``revalidate`` is False: then the body is asked for (the caller needs its transfer
        as a rate sample) and the cache is refreshed with it."""
        key = (template, codec)
        cached = self.manifests.get(key) if self.manifests is not None else None
        if not revalidate:
            cached = None
        got = await self._get_json(manifest_key(template, codec),
                                   etag=cached.etag if cached else None,
                                   what=f"{template}/{codec}")
        if got.not_modified and cached is not None:
            return ManifestFetch(cached.data, 0, got.start, got.first_byte, got.end, True,
                                 cached.etag)
        data = got.data
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise EdgeError(f"{template}/{codec}: the origin's manifest is not a "
                            f"{MANIFEST_FORMAT}")
        if data.get("version") != MANIFEST_VERSION:
            raise EdgeError(f"{template}/{codec}: unsupported pack version "
                            f"{data.get('version')!r} (this client reads version "
                            f"{MANIFEST_VERSION}; rebuild the packs with `sakura build`)")
        if data.get("template_id") != template or data.get("codec") != codec:
            raise EdgeError(f"asked for {template}/{codec}, the manifest is for "
                            f"{data.get('template_id')}/{data.get('codec')}")
        if self.manifests is not None and got.etag:
            self.manifests[key] = CachedManifest(got.etag, data, got.size)
        return ManifestFetch(data, got.size, got.start, got.first_byte, got.end, False,
                             got.etag)

    async def fetch_file(self, key: str, what: str) -> bytes:
        """A whole immutable file of the layout (a device bundle's file, ``edge.bundle``),
        with the retries of every request; ``what`` names it in errors. The caller checks
        its sha256 against the catalog."""
        failures = 0
        last_progress = time.monotonic()
        while True:
            url = self.origin.url(key)
            try:
                async with self.session.get(url, headers=self.origin.headers()) as resp:
                    if resp.status != 200:
                        await self._raise_for(resp, key, what)
                    return await resp.read()
            except (TimeoutError, _Retry, aiohttp.ClientError, OSError) as exc:
                failures += 1
                if self.retry.exhausted(failures, time.monotonic() - last_progress):
                    raise self._give_up(key, failures, exc) from None
                await self._back_off(failures, exc, last_progress)

    async def fetch_config(self, template: str, codec: str, shard: int, config: int, *,
                           manifest: Mapping[str, Any] | None = None,
                           progress: Callable[[int], None] | None = None,
                           transfer: Transfer | None = None) -> Fetched:
        """The verified bytes of one configuration of one shard: one ``Range`` GET of the
        pack (the manifest is fetched first when not given: it holds the range and the
        checksums every body is verified against). ``progress(n)`` is called with the bytes
        received so far; a ``transfer`` (see :class:`Transfer`) is filled as the body
        arrives, and with its ``fallbacks`` the result may be one of them (``config``)."""
        if manifest is None:
            manifest = await self.manifest(template, codec)
        spec = BodySpec.from_manifest(manifest, shard, config)
        key = pack_key(template, codec, manifest.get("pack_file"))  # type: ignore[arg-type]
        return await self._fetch_range(key, spec, progress, transfer, shard)

    async def fetch_extension(self, template: str, codec: str, shard: int, base: int,
                              config: int, *, manifest: Mapping[str, Any],
                              transfer: Transfer | None = None) -> Fetched:
        """The bytes of configuration ``config`` of ``shard`` after those of ``base``, whose
        body is a prefix of it (prefix refinement): one ``Range`` GET from where ``base``'s
        bytes end, verified unit by unit against ``config``'s later units."""
        whole = BodySpec.from_manifest(manifest, shard, config)
        have = BodySpec.from_manifest(manifest, shard, base)
        if (have.offset != whole.offset or have.nbytes >= whole.nbytes
                or whole.units[: len(have.units)] != have.units):
            raise EdgeError(f"manifest: configuration {base} of shard {shard} is not a "
                            f"prefix of configuration {config}")
        spec = BodySpec(whole.nbytes - have.nbytes, whole.units[len(have.units):],
                        whole.offset + have.nbytes, whole.pack_bytes)
        key = pack_key(template, codec, manifest.get("pack_file"))  # type: ignore[arg-type]
        return await self._fetch_range(key, spec, None, transfer, shard)

    # ------------------------------------------------------------------ internals
    async def _get_json(self, key: str, etag: str | None = None,
                        what: str | None = None) -> _JsonGot:
        failures = 0
        last_progress = time.monotonic()
        while True:
            url = self.origin.url(key)
            headers = self.origin.headers()
            if etag:
                headers["If-None-Match"] = etag
            try:
                return await self._hedged_json(url, headers, key, etag, what)
            except (TimeoutError, _Retry, aiohttp.ClientError, OSError) as exc:
                failures += 1
                if self.retry.exhausted(failures, time.monotonic() - last_progress):
                    raise self._give_up(key, failures, exc) from None
                await self._back_off(failures, exc, last_progress)

    async def _hedged_json(self, url: str, headers: dict[str, str], key: str,
                           etag: str | None, what: str | None) -> _JsonGot:
        """One JSON GET; unanswered (no status line) after :data:`HEDGE_JSON_S` it is sent
        once more on a new connection and the first answer wins."""
        answered = asyncio.Event()

        async def one(session: aiohttp.ClientSession) -> _JsonGot:
            start = time.monotonic()
            async with session.get(url, headers=headers) as resp:
                answered.set()
                if resp.status == 304 and etag:
                    now = time.monotonic()
                    return _JsonGot(None, 0, start, now, now, etag, True)
                if resp.status != 200:
                    await self._raise_for(resp, key, what)
                first = time.monotonic()
                raw = await resp.read()
                end = time.monotonic()
                try:
                    data = json.loads(raw)
                except (ValueError, RecursionError) as exc:  # (syntax, UTF-8, nesting)
                    raise EdgeError(f"{self.base_url}: {key} is not valid JSON "
                                    f"({exc})") from None
                # the bytes on the wire (a gzip-encoded manifest is decoded by aiohttp):
                # the monitor's rate sample must not count the decompressed size
                wire = resp.headers.get("Content-Length")
                size = int(wire) if wire and wire.isdigit() else len(raw)
                return _JsonGot(data, size, start, first, end, resp.headers.get("ETag"))

        tasks = {asyncio.ensure_future(one(self.session))}
        error: BaseException | None = None
        sent = 1
        try:
            while tasks:
                # a new request on a fresh connection every HEDGE_JSON_S while none answered
                hedge = sent < HEDGE_JSON_ATTEMPTS and not answered.is_set()
                signal = asyncio.ensure_future(answered.wait()) if hedge else None
                try:
                    done, tasks = await asyncio.wait(
                        tasks | ({signal} if signal else set()),
                        timeout=HEDGE_JSON_S if hedge else None,
                        return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if signal is not None:
                        signal.cancel()
                tasks.discard(signal)
                for t in done - {signal}:
                    if t.exception() is None:
                        return t.result()
                    error = t.exception()
                if not done and not answered.is_set():
                    tasks.add(asyncio.ensure_future(one(self._fresh())))
                    sent += 1
        finally:
            for t in tasks:
                t.cancel()
        assert error is not None
        raise error

    async def _raise_for(self, resp: aiohttp.ClientResponse, key: str,
                         what: str | None = None) -> None:
        body = await _read_small(resp)
        message = _error_message(body)
        text = f"HTTP {resp.status}" + (f": {message}" if message else "")
        code = _error_code(body)
        if code == "version_gone":
            raise VersionGone(f"{self.base_url}: {key}: {text} (the pack was republished; "
                              "the manifest is fetched again)")
        if code in PERMANENT_CODES:
            raise OriginError(f"{self.base_url}: {key}: {text} (the origin says {code}: "
                              "retrying will not help)")
        if resp.status in RETRY_STATUS:
            raise _Retry(text)
        if resp.status == 404:
            subject = f"{what} is not published there" if what else f"no {key} there"
            raise OriginError(f"{self.base_url}: {subject} ({text})")
        if resp.status in (401, 403):
            hint = (" (give a valid token with --token)" if isinstance(self.origin, HttpOrigin)
                    else " (check the AWS credentials and the bucket policy)")
            raise OriginError(f"{self.base_url}: access to {key} refused: {text}{hint}")
        raise OriginError(f"{self.base_url}: {key}: {text}")

    async def _back_off(self, failures: int, exc: BaseException, last_progress: float) -> None:
        """Sleep the jittered backoff before retry ``failures``, saying so first."""
        delay = self.retry.delay(failures) * (1.0 - self.retry.jitter * self._rng.random())
        if self.on_wait is not None:
            left = max(0.0, self.retry.window_s - (time.monotonic() - last_progress))
            self.on_wait(f"waiting for {self.base_url}: {_describe(exc)}, retry {failures} in "
                         f"{delay:.1f} s (giving up in {left:.0f} s without progress)")
        await asyncio.sleep(delay)

    def _give_up(self, key: str, attempts: int, exc: BaseException) -> EdgeError:
        tried = f"gave up after {attempts} attempts without progress"
        if isinstance(exc, _Retry) and exc.answered:
            return OriginError(f"{self.base_url} answered {exc} for {key} ({tried})")
        return ServerUnreachable(
            f"cannot reach the SAKURA server at {self.origin.describe(self.base_url)}: "
            f"{_describe(exc)} ({tried}); "
            "check that the server is running (`sakura serve DIR`, or the nginx / S3 origin) "
            "and that the URL and network are right")

    async def _fetch_range(self, key: str, spec: BodySpec,
                           progress: Callable[[int], None] | None = None,
                           transfer: Transfer | None = None,
                           shard: int | None = None) -> Fetched:
        t = transfer if transfer is not None else Transfer()
        t.begin(spec, shard)
        etag = self._etags.get(key)
        failures = 0
        plain_200 = False
        hi = spec.offset + spec.nbytes - 1
        while True:
            lo = spec.offset + t.received
            headers = {**self.origin.headers(), "Range": f"bytes={lo}-{hi}"}
            if t.received and etag:
                headers["If-Range"] = etag
                t.resumes += 1
            elif t.received:
                t.reset()  # no validator to resume against: start the range again
                lo = spec.offset
                headers["Range"] = f"bytes={lo}-{hi}"
            # a restart (hedge) goes out on a connection of its own, not the one that stalled
            session = self._fresh() if t.take_fresh() else self.session
            url = self.origin.url(key)

            progressed = False

            async def attempt(session: aiohttp.ClientSession = session, url: str = url,
                              headers: dict[str, str] = headers, lo: int = lo) -> None:
                nonlocal etag, plain_200, progressed
                async with session.get(url, headers=headers, auto_decompress=False) as resp:
                    if resp.status == 200:
                        if "If-Range" in headers and not plain_200:
                            plain_200 = True  # the object changed: restart, plain Range
                            t.reset()
                            etag = None
                            raise _Retry("the pack changed under a resumed range "
                                         "(If-Range answered 200)")
                        raise OriginError(  # the native runtime's words (http.cpp)
                            f"{self.base_url}: {key}: the origin ignored the Range request "
                            "(HTTP 200 with the whole object); serve the pack from an origin "
                            "that supports single-range GETs")
                    if resp.status == 416:
                        raise OriginError(
                            f"{self.base_url}: {key} is shorter than its manifest says "
                            f"(416 for bytes {lo}-{hi}, "
                            f"{resp.headers.get('Content-Range', 'no Content-Range')}): the "
                            "published pack is truncated")
                    if resp.status != 206:
                        await self._raise_for(resp, key)
                    self._check_content_range(resp, key, lo, hi, spec)
                    etag = resp.headers.get("ETag") or etag
                    if etag:
                        self._etags[key] = etag
                    async for chunk in resp.content.iter_chunked(self.chunk_size):
                        if t.received + len(chunk) > spec.nbytes:
                            raise OriginError(f"{self.base_url}: {key} sent more bytes than "
                                              f"the range {lo}-{hi} holds")
                        ok = t.feed(chunk)
                        progressed = True
                        if progress is not None:
                            progress(t.received)
                        if not ok:  # a unit failed: the rest of this body cannot be used
                            return

            error: BaseException | None = None
            try:
                if not await t.run_attempt(attempt()):
                    continue  # restarted: the remaining range, now, on a fresh connection
            except (TimeoutError, _Retry, aiohttp.ClientError, OSError) as exc:
                error = exc
            if t.damage is not None:
                fallback = t.prefix()
                if fallback is not None:  # the largest configuration verified before it
                    return t.result(fallback)
                t.refetches += 1
                if t.refetches > self.retry.max_refetch:
                    what = f"shard {shard}" if shard is not None else "this range"
                    raise IntegrityError(f"{self.base_url}: bytes {spec.offset}-{hi} of {key}: "
                                         f"not even the smallest configuration of {what} "
                                         f"verifies: {t.damage} (after {t.refetches} "
                                         "fetches; the published pack is damaged)")
                t.reset()
                etag = None
                continue
            if error is None and t.received < spec.nbytes:
                error = _Retry(f"short body ({t.received} of {spec.nbytes} bytes)", False)
            if error is None:
                if not t.complete:  # (units are checked against the length by BodySpec)
                    raise IntegrityError(f"{self.base_url}: bytes {spec.offset}-{hi} of {key}: "
                                         "its units do not cover the body")
                return t.result()
            # an attempt that brought bytes resumes at once; failures in a row back off
            failures = 0 if progressed else failures + 1
            if self.retry.exhausted(failures, time.monotonic() - t.last_progress):
                raise self._give_up(key, max(1, failures), error)
            if failures:
                await self._back_off(failures, error, t.last_progress)

    def _check_content_range(self, resp: aiohttp.ClientResponse, key: str, lo: int, hi: int,
                             spec: BodySpec) -> None:
        got = resp.headers.get("Content-Range", "")
        m = _CONTENT_RANGE.match(got.strip())
        if m is None:
            raise OriginError(f"{self.base_url}: {key}: a 206 answer without a single-range "
                              f"Content-Range ({got[:80]!r})")
        first, last, total = int(m.group(1)), int(m.group(2)), m.group(3)
        if total != "*" and spec.pack_bytes is not None and int(total) != spec.pack_bytes:
            raise OriginError(f"{self.base_url}: {key} has {total} bytes, its manifest says "
                              f"{spec.pack_bytes}: the published pack is truncated or was "
                              "replaced")
        if (first, last) != (lo, hi):
            raise _Retry(f"asked for bytes {lo}-{hi}, the origin sent {first}-{last}")
