"""The edge's HTTP client (aiohttp): catalog, manifests and pack byte ranges from any origin.

Every origin serves the published catalog layout (``cloud/layout.py``)::

    catalog.json
    templates/<template_id>/<codec>/manifest.json      the current manifest
    templates/<template_id>/<codec>/<pack_file>        immutable, named by content hash

so the device needs no code of ours on the other side. Three kinds of origin, chosen by the
URL the user gives:

- ``http://`` or ``https://``: ``sakura serve`` (which adds bearer auth, a token-filtered
  catalog and metrics), nginx or any static server or CDN in front of the published folder;
  ``token`` is sent as ``Authorization: Bearer`` when given;
- ``s3://bucket/prefix``: an S3 bucket (or any S3-compatible store), read with presigned GET
  URLs made locally from the standard AWS environment (credentials, ``AWS_ENDPOINT_URL_S3`` /
  ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, read by botocore: ``sakura.s3``;
  ``?endpoint_url=...&region=...`` in the URL override them), or
  with plain URLs when there are no credentials (a public-read bucket).

A shard configuration is ONE byte range of the pack (pack format 2, ``codec/FORMAT.md``), so
:meth:`PackClient.fetch_config` is one ``GET`` of the pack URL with ``Range: bytes=a-b``. The
pack's name holds its content hash, so a request is pinned to one version by its URL; a
dropped body resumes with a narrower ``Range`` and ``If-Range: <the ETag the origin sent>``
(a ``200`` answer there means the object changed: the range restarts from scratch). Every
body is checked against the manifest (exact length and the sha256 of every unit of the
range) before it is returned; a body that fails is fetched again, then refused
(:class:`IntegrityError`).

Units are verified as they arrive (as the native receiver's ``advance_verify`` does), into a
:class:`Transfer` the caller may pass and watch while the body streams in: it holds the
buffer, the verified prefix (whole units only) and the ``fallbacks`` of the body, the
configurations of the same shard whose bytes are its first units (same range start, shorter,
units a prefix: :func:`prefix_fallbacks`; every configuration of a shard is a prefix of one
byte stream). The rules of that deadline-true receive:

* a unit that fails its checksum stops the body at once; when a fallback verified before
  it, the fetch returns that configuration's bytes (``Fetched.config``) with ``damage``
  naming the unit and its pack offsets (``"unit U of shard J (pack bytes A..B) fails its
  checksum"``); with none, the body is fetched again from scratch, at most
  ``RetryPolicy.max_refetch`` times, then :class:`IntegrityError` says that not even the
  smallest configuration verifies, and why;
* :meth:`Transfer.restart` (the reader's stall watchdog or deadline) ends the attempt in
  flight and re-requests the remaining range at once on a fresh connection (``Range`` +
  ``If-Range``; counted in ``hedges``, not as a failure);
* :meth:`Transfer.prefix` is the longest verified fallback, which the reader may run on
  (truncation at a deadline) after cancelling the fetch. A ``Content-Range`` whose total is not the manifest's
``pack_bytes`` (a truncated or replaced object), an origin that ignores ``Range`` and a
``416`` are clear errors, never wrong bytes. :meth:`PackClient.pack_location` gives the
plain request (URL and headers) for anyone else fetching ranges, e.g. the native receiver.

Nothing derived from the user's image, prompt, mask, seed or embeddings is ever sent: only
the template id, codec, pack name and byte ranges (which the manifest maps to shard and
configuration), and an optional bearer token. ``request_log`` (a list) receives a
:class:`RequestRecord` for every request actually sent, retries included.

Manifests: with a ``manifests`` dict (the device's manifest cache, kept across edits) a
known manifest is revalidated with ``If-None-Match: <etag>`` and a 304 answer moves no body.

Failures: connection errors, timeouts and ``408 / 429 / 5xx`` answers are retried with
jittered exponential backoff (``RetryPolicy.jitter``; ``on_wait`` hears one line per retry:
``sakura edit`` prints it) while the request makes no progress for less than
``RetryPolicy.window_s`` (30 s by default: long enough for ``sakura serve`` to restart), or
until ``max_attempts`` consecutive failures when that is set; an attempt that brought new
bytes before it broke is resumed at once, without backoff. Giving up names the URL the
user gave and the last problem: :class:`ServerUnreachable` when nothing answered,
:class:`OriginError` with the origin's own message when it answered with an error; any
other ``4xx`` raises :class:`OriginError` at once, and so does an answer whose JSON
``code`` is permanent (:data:`PERMANENT_CODES`: a damaged pack is reported in one request,
not after 30 s as an unreachable server). The native runtime classifies the same way
(``native/src/sakura/http.cpp``), and checks every 206's ``Content-Range`` total against
the manifest's ``pack_bytes`` with the same words. A 404 whose code is ``version_gone``
(the pack was republished and the old one collected) is :class:`VersionGone`: the runtime
drops its cached manifest and runs the edit once more. A catalog or manifest request with
no answer after :data:`HEDGE_JSON_S` goes out again on a new connection, up to
:data:`HEDGE_JSON_ATTEMPTS` requests in all.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import aiohttp
from sakura.codec.manifest import FORMAT as MANIFEST_FORMAT
from sakura.codec.manifest import PACK_FILE_PATTERN, TEMPLATE_ID_PATTERN
from sakura.codec.manifest import VERSION as MANIFEST_VERSION
from sakura.edge.errors import (
    EdgeError,
    IntegrityError,
    OriginError,
    ServerUnreachable,
    VersionGone,
)

from sakura.s3 import endpoint_of, s3_client

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
# error codes of `sakura serve` (cloud/errors.py, ErrorCode; edge does not import cloud)
# that no retry of the same request changes: reported at once, whatever the status
PERMANENT_CODES = frozenset({"pack_damaged", "publish_broken"})
# MANIFEST_FORMAT / MANIFEST_VERSION: the manifest schema's (sakura.codec.manifest)
# the published layout (cloud/layout.py; edge does not import cloud)
CATALOG_KEY = "catalog.json"
_ID = re.compile(TEMPLATE_ID_PATTERN)  # (template ids; codec names are checked as loosely)
_PACK_FILE = re.compile(PACK_FILE_PATTERN)
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
PRESIGN_EXPIRES_S = 3600
HEDGE_JSON_S = 0.25
"""A catalog or manifest request with no answer after this long is sent once more on a new
connection, the first answer winning. A lost SYN or SYN-ACK costs a new connection Linux's
1 s initial retransmission timeout, which no route option scales: in ``sakura bench tail``
(kernel link, 1% real loss) one manifest request took 1.0 s and made its edit 1.9x
``local``. 0.25 s is above the replay's 30 ms round trip unscaled (the matched link carries
1.4-5.7 ms) plus the server's time to answer, and well under the 1 s it saves."""
HEDGE_JSON_ATTEMPTS = 3
"""Requests of one catalog or manifest fetch in all, the next one :data:`HEDGE_JSON_S` after
the last while none has answered. One hedge was not enough: in the full ``sakura bench
tail`` of 2026-12-05 (3% real loss both ways, so a handshake fails about 6% of the time)
one edit started its shards 1.09 s late with its manifest revalidated (1.44x ``local``, the
only edit over 1.15x of 924); 1.09 s is the 1 s SYN timeout plus a round trip, most likely
both handshakes lost (inferred, not captured: the record has no set-up phases). A third
handshake makes a lost fetch of that kind about 0.02% instead of 0.35%."""


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
    window_s: float = 30.0         # give up after this long without progress
    max_attempts: int | None = None  # ... or after this many consecutive failed attempts
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0
    max_refetch: int = 3           # refetches of a body that fails verification
    # each backoff is drawn in [1 - jitter, 1] x its exponential value, so the clients an
    # origin restart dropped together do not all come back in the same instant
    jitter: float = 0.5

    def delay(self, failures: int) -> float:
        """The exponential backoff before retry ``failures`` (its upper bound)."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, failures - 1))

    def exhausted(self, failures: int, since_progress_s: float) -> bool:
        if self.max_attempts is not None and failures >= self.max_attempts:
            return True
        return since_progress_s >= self.window_s


@dataclass(frozen=True)
class PackLocation:
    """The plain HTTP request that reads byte ranges of one pack.

    ``GET url`` with ``headers`` plus ``Range: bytes=a-b`` (absolute offsets from the
    manifest's ``ranges``) fetches any configuration; when resuming a dropped body, send
    ``If-Range: etag`` (``None`` until a response from this origin has shown its ETag; then
    use the one the response carried). For S3 the URL is presigned (valid
    ``PRESIGN_EXPIRES_S``) and ``headers`` is empty; for ``sakura serve`` with auth it holds
    the bearer token.
    """

    url: str
    headers: dict[str, str]
    etag: str | None = None


@dataclass(frozen=True)
class BodySpec:
    """What a configuration's body must be: where it lies in the pack, its length and its
    units' (length, sha256) in order."""

    nbytes: int
    units: tuple[tuple[int, str], ...] = ()
    offset: int = 0
    pack_bytes: int | None = None

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], shard: int, config: int) -> BodySpec:
        entry = config_entry(manifest, shard, config)
        table = manifest.get("units") or []
        units = []
        try:
            for u in entry.get("units") or []:
                _off, length, sha = table[int(u)][:3]
                units.append((int(length), str(sha)))
            ranges = [(int(o), int(n)) for o, n in entry.get("ranges") or []]
            nbytes = int(entry["bytes"])
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise EdgeError(f"manifest: shard {shard} config {config} is malformed: "
                            f"{exc!r}") from None
        if len(ranges) != 1:
            raise EdgeError(f"manifest: shard {shard} config {config} has {len(ranges)} byte "
                            "ranges; this client reads pack format 2 (one range each)")
        if not units or sum(n for n, _ in units) != nbytes or ranges[0][1] != nbytes:
            raise EdgeError(f"manifest: shard {shard} config {config}: units and range do not "
                            f"add up to its {nbytes} bytes")
        pack_bytes = manifest.get("pack_bytes")
        return cls(nbytes, tuple(units), ranges[0][0],
                   int(pack_bytes) if isinstance(pack_bytes, int) else None)

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


def prefix_extensions(manifest: Mapping[str, Any], shard: int, config: int,
                      candidates: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """``(config id, bytes)`` of the ``candidates`` whose bodies begin with the whole body
    of ``config`` (the same range start, more bytes, ``config``'s units first), shortest
    first: what a received ``config`` may be extended to (prefix refinement; the rule of
    the native ``StreamFeed::try_refine``)."""
    have = BodySpec.from_manifest(manifest, shard, config)
    out: list[tuple[int, int]] = []
    for c in candidates:
        if int(c) == int(config):
            continue
        try:
            spec = BodySpec.from_manifest(manifest, shard, int(c))
        except EdgeError:
            continue
        if (spec.offset != have.offset or spec.nbytes <= have.nbytes or not have.units
                or spec.units[: len(have.units)] != have.units):
            continue
        out.append((int(c), spec.nbytes))
    out.sort(key=lambda f: f[1])
    return out


def prefix_fallbacks(manifest: Mapping[str, Any], shard: int, config: int,
                     candidates: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """``(config id, bytes)`` of the ``candidates`` (e.g. the allocator's ``fallbacks``)
    whose bodies are a prefix of ``config``'s: the same range start, fewer bytes, and its
    units the first units of ``config``'s; longest first (the rule of the native
    ``StreamFeed::issue``)."""
    want = BodySpec.from_manifest(manifest, shard, config)
    out: list[tuple[int, int]] = []
    for c in candidates:
        if int(c) == int(config):
            continue
        try:
            spec = BodySpec.from_manifest(manifest, shard, int(c))
        except EdgeError:
            continue
        if (spec.offset != want.offset or spec.nbytes >= want.nbytes or not spec.units
                or want.units[: len(spec.units)] != spec.units):
            continue
        out.append((int(c), spec.nbytes))
    out.sort(key=lambda f: -f[1])
    return out


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
    config: int | None = None    # the configuration ``data`` is (None: the one requested)
    hedges: int = 0              # re-requests on a fresh connection
    damage: str | None = None    # the unit that failed its checksum (``config``: before it)


class Transfer:
    """One body on its way in, shared by the client that fills and verifies it and the
    reader that watches it (the pipeline's deadline and stall watchdog); one event loop.

    ``fallbacks``: ``(config, bytes)`` of the configurations whose bodies are this one's
    first units, longest first (:func:`prefix_fallbacks`). ``buf`` holds what arrived,
    ``verified`` how many of its bytes are whole units that passed their checksums;
    ``damage`` names the first unit that failed. Times are ``time.monotonic()``.
    """

    def __init__(self, fallbacks: list[tuple[int, int]] | tuple[tuple[int, int], ...] = ()
                 ) -> None:
        self.fallbacks = tuple((int(c), int(n)) for c, n in fallbacks)
        self.buf = bytearray()
        self.nbytes = 0
        self.units: tuple[tuple[int, str], ...] = ()
        self.base = 0               # the body's offset in the pack (for damage messages)
        self.shard: int | None = None
        self.verified = 0           # bytes of the verified units (a prefix of buf)
        self.verified_units = 0
        self.damage: str | None = None
        self.start = self.last_progress = time.monotonic()
        self.first_byte: float | None = None
        self.attempt_start: float | None = None  # None: no attempt in flight (a backoff)
        self.attempts = self.resumes = self.refetches = self.hedges = 0
        self.stalled_restarts = 0   # watchdog restarts in a row without new bytes
        self._attempt: asyncio.Task[Any] | None = None
        self._fresh = False         # restart() asked for the next attempt (fresh connection)

    def begin(self, spec: BodySpec, shard: int | None = None) -> None:
        """The body to expect: its length, units and pack offset."""
        self.nbytes, self.units, self.base, self.shard = (spec.nbytes, spec.units,
                                                          spec.offset, shard)
        self.reset()

    def reset(self) -> None:
        """The body starts over: nothing received, nothing verified."""
        self.buf.clear()
        self.verified = self.verified_units = 0
        self.damage = None

    @property
    def received(self) -> int:
        return len(self.buf)

    @property
    def complete(self) -> bool:
        """All bytes in and every unit verified."""
        return (self.damage is None and len(self.buf) == self.nbytes
                and self.verified_units == len(self.units))

    def feed(self, chunk: bytes, now: float | None = None) -> bool:
        """Append ``chunk`` and verify the units it completed; False once a unit failed
        (the rest of this body cannot be used)."""
        now = time.monotonic() if now is None else now
        if self.first_byte is None:
            self.first_byte = now
        if chunk:
            self.buf += chunk
            self.last_progress = now
            self.stalled_restarts = 0
        while self.damage is None and self.verified_units < len(self.units):
            length, sha = self.units[self.verified_units]
            if self.verified + length > len(self.buf):
                break
            unit = memoryview(self.buf)[self.verified : self.verified + length]
            try:
                ok = hashlib.sha256(unit).hexdigest() == sha
            finally:
                unit.release()
            if not ok:
                lo = self.base + self.verified
                where = f" of shard {self.shard}" if self.shard is not None else ""
                self.damage = (f"unit {self.verified_units}{where} (pack bytes "
                               f"{lo}..{lo + length}) fails its checksum")
                break
            self.verified += length
            self.verified_units += 1
        return self.damage is None

    def prefix(self) -> tuple[int, int] | None:
        """The longest fallback whose bytes all verified: ``(config, bytes)``, or None."""
        if not self.units:
            return None
        for config, length in self.fallbacks:
            if length <= self.verified:
                return config, length
        return None

    def result(self, fallback: tuple[int, int] | None = None,
               end: float | None = None) -> Fetched:
        """The body (``fallback`` None) or a fallback's first bytes, as a :class:`Fetched`."""
        end = time.monotonic() if end is None else end
        config, data = None, bytes(self.buf)
        if fallback is not None:
            config, data = fallback[0], bytes(self.buf[: fallback[1]])
        return Fetched(data, self.start, self.first_byte or end, end, self.attempts,
                       self.resumes, self.refetches, config, self.hedges, self.damage)

    def idle_s(self, now: float | None = None) -> float | None:
        """Seconds the attempt in flight has gone without new bytes (None: no attempt in
        flight, or a restart is on its way)."""
        if self.attempt_start is None or self._fresh:
            return None
        now = time.monotonic() if now is None else now
        return now - max(self.last_progress, self.attempt_start)

    def backing_off(self) -> bool:
        """Between attempts after a failed one (the client's retry backoff: the origin is
        failing, e.g. restarting), not on a restart that goes out at once."""
        return self.attempts > 0 and self._attempt is None and not self._fresh

    def restart(self) -> bool:
        """End the attempt in flight: the client re-requests the remaining range at once, on
        a fresh connection (a hedge). False: no attempt in flight to restart."""
        task = self._attempt
        if task is None or task.done() or self._fresh:
            return False
        self._fresh = True
        self.hedges += 1
        task.cancel()
        return True

    def take_fresh(self) -> bool:
        """Whether the next attempt must open a fresh connection (a restart asked for it)."""
        fresh, self._fresh = self._fresh, False
        return fresh

    async def run_attempt(self, attempt: Coroutine[Any, Any, Any]) -> bool:
        """Run one attempt (a coroutine that feeds this transfer); False when
        :meth:`restart` ended it (the caller sends the next one at once)."""
        task = asyncio.ensure_future(attempt)
        self._attempt, self.attempt_start = task, time.monotonic()
        self.attempts += 1
        try:
            await task
            return True
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if self._fresh and task.cancelled() and not (me is not None and me.cancelling()):
                return False
            raise
        finally:
            self._attempt = self.attempt_start = None


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


class _Retry(Exception):
    """An answer worth retrying (5xx, 408, 429, a resume the origin could not honour)."""

    def __init__(self, message: str, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered


# ---------------------------------------------------------------------------- origins


class HttpOrigin:
    """``sakura serve``, nginx or a CDN: the layout under one base URL."""

    def __init__(self, base: str, token: str | None) -> None:
        self.base = base.rstrip("/")
        self.token = token

    def url(self, key: str) -> str:
        return f"{self.base}/{quote(key)}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def describe(self, url: str) -> str:
        return url


class S3Origin:
    """An S3 bucket prefix, read with presigned GET URLs (made locally by botocore)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if not parts.netloc:
            raise EdgeError(f"an S3 origin is s3://bucket[/prefix], got {url[:80]!r}")
        self.bucket = parts.netloc
        prefix = parts.path.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            import boto3
            from botocore import UNSIGNED
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - boto3 is a dependency
            raise EdgeError(f"an s3:// origin needs boto3 ({exc})") from None
        session = boto3.session.Session()
        # no credentials: a public-read bucket, read with plain (unsigned) URLs
        self.signed = session.get_credentials() is not None
        config = Config(signature_version="s3v4" if self.signed else UNSIGNED)
        # the endpoint (?endpoint_url=, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS)
        # and its addressing are botocore's, as for the cloud's storage (sakura.s3)
        self.client = s3_client(query.get("endpoint_url"), query.get("region"), session=session,
                                config=config)
        self.endpoint = endpoint_of(self.client)

    def describe(self, url: str) -> str:
        return f"{url} (S3 endpoint {self.endpoint})"

    def url(self, key: str) -> str:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self.prefix + key},
            ExpiresIn=PRESIGN_EXPIRES_S)

    def headers(self) -> dict[str, str]:
        return {}


def manifest_key(template: str, codec: str) -> str:
    _check_ids(template, codec)
    return f"templates/{template}/{codec}/manifest.json"


def pack_key(template: str, codec: str, pack_file: str) -> str:
    _check_ids(template, codec)
    if not isinstance(pack_file, str) or not _PACK_FILE.fullmatch(pack_file):
        raise EdgeError(f"manifest: pack_file {str(pack_file)[:80]!r} is not a pack name")
    return f"templates/{template}/{codec}/{pack_file}"


def _check_ids(template: str, codec: str | None) -> None:
    for what, value in (("template id", template), ("codec", codec)):
        if what == "codec" and value is None:
            continue
        if not isinstance(value, str) or not _ID.fullmatch(value):
            raise EdgeError(f"invalid {what} {str(value)[:80]!r}: use lower-case letters, "
                            "digits, '-' and '_'")


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


async def _read_small(resp: aiohttp.ClientResponse, limit: int = 8192) -> bytes:
    try:
        return await resp.content.read(limit)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return b""


def _error_code(body: bytes) -> str | None:
    """The machine-readable ``code`` of a ``sakura serve`` JSON error, if any."""
    try:
        doc = json.loads(body.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    code = doc.get("code") if isinstance(doc, dict) else None
    return code if isinstance(code, str) else None


def _error_message(body: bytes) -> str:
    """The origin's own error message: ``{"error": ...}`` (sakura serve), S3's XML
    ``<Message>``, or the first line of a short text body (nginx)."""
    text = body.decode("utf-8", "replace").strip()
    if not text:
        return ""
    try:
        doc = json.loads(text)
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            return doc["error"][:300]
    except (ValueError, RecursionError):
        pass
    m = re.search(r"<Message>(.*?)</Message>", text, re.S)
    if m:
        code = re.search(r"<Code>(.*?)</Code>", text)
        return (f"{code.group(1)}: " if code else "") + m.group(1).strip()[:300]
    m = re.search(r"<title>(.*?)</title>", text, re.S | re.I)
    if m:
        return m.group(1).strip()[:300]
    return text.splitlines()[0][:300]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = getattr(exc, "os_error", None)
        if isinstance(os_error, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect ({os_error or exc})"[:300]
    if isinstance(exc, _Retry):
        return str(exc)
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
