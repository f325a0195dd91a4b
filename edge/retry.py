"""Which failures the edge's client retries, for how long, and what it says when it gives up.

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

:class:`RetryPolicy` holds the timeouts, the window and the jittered backoff; ``_Retry`` is
an answer worth retrying; ``_error_code`` / ``_error_message`` read an origin's error body
(``sakura serve``'s JSON, S3's XML, nginx's page) and ``_describe`` says what went wrong in
the words of ``on_wait`` and of giving up. The client that applies them: ``edge/client.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import aiohttp

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
# error codes of `sakura serve` (cloud/errors.py, ErrorCode; edge does not import cloud)
# that no retry of the same request changes: reported at once, whatever the status
PERMANENT_CODES = frozenset({"pack_damaged", "publish_broken"})
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


class _Retry(Exception):
    """An answer worth retrying (5xx, 408, 429, a resume the origin could not honour)."""

    def __init__(self, message: str, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered


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
