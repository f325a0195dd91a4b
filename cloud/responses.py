"""The template server's responses for pack bytes, and the conditional-request rules every
route shares (``If-Match`` / ``If-None-Match``, ``Cache-Control``).

Every route that sends pack bytes (the layout's pack file, ``/v1/.../pack`` and the shard
endpoint) builds its response in :func:`serve_body` from ONE parse of ``Range``/``If-Range``
(:func:`cloud.ranges.parse_range` with ``ServerSettings.max_ranges``): the pack spans it
sends are the spans it hands the :class:`~sakura.cloud.verify.UnitVerifier`, so what is
checked is exactly what is sent.

Bodies come from one reader pinned to one version of the pack (a local file descriptor, or
S3 ``If-Match``); :class:`PackResponse` closes the reader when the response ends, fails or
the client disconnects. From a local folder, the verified spans leave by sendfile on that
descriptor (ASGI zero-copy send, :mod:`cloud.zerocopy`, offered by :mod:`cloud.runner`'s
protocol): profiled under ``sakura bench serve``, copying each body through Python (1 MiB
``pread`` chunks in worker threads, then ``socket.send``) was most of the server's time, not
the checking, which the verified-unit cache makes a set lookup per request; with sendfile
the one process went from 0.32 to 0.40-0.43 GB/s against nginx's 0.75-0.85 on the same
host. Elsewhere (a bucket, the in-process test client) they stream in chunks.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from sakura.cloud import zerocopy
from sakura.cloud.api_errors import ApiError, error_response
from sakura.cloud.errors import ErrorCode
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
from sakura.cloud.resolve import Resolved, open_pack
from sakura.cloud.state import ServerState
from sakura.cloud.storage import ObjectReader
from starlette.responses import Response

OCTET = "application/octet-stream"


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


class Blocking(Exception):
    """Raised by ``inline`` work that would read storage (units not checked yet): the fast
    path then runs it in a worker thread instead, as FastAPI runs the route."""


# ------------------------------------------------------------------ shared by the routes


def cache_control(state: ServerState, immutable: bool) -> str:
    scope = "private" if state.tokens is not None else "public"
    if immutable:
        return f"{scope}, max-age={state.settings.max_age_immutable}, immutable"
    return f"{scope}, no-cache"


def preconditions(request: Request, etag: str, headers: dict[str, str]) -> Response | None:
    """If-Match (412) and If-None-Match (304), RFC 9110 section 13.2.2 order."""
    if_match = parse_etag_list(request.headers.get("if-match"))
    if if_match is not None and not (
        "*" in if_match or any(strong_match(t, etag) for t in if_match)
    ):
        return error_response(412, "If-Match precondition failed: the representation has changed",
                              headers, code=ErrorCode.PRECONDITION_FAILED)
    if_none_match = parse_etag_list(request.headers.get("if-none-match"))
    if if_none_match is not None and (
        "*" in if_none_match or any(weak_match(t, etag) for t in if_none_match)
    ):
        return Response(status_code=304, headers=headers)
    return None


# ----------------------------------------------------------------- pack-byte responses


def serve_body(
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

    ``inline``: the caller runs on the event loop (:class:`cloud.middleware.PackFastPath`),
    so raise :class:`Blocking` rather than read and hash units that have not passed yet."""
    size = body.size
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "Cache-Control": cache_control(state, resolved.pinned),
        "X-Content-Type-Options": "nosniff",
        **extra_headers,
    }
    early = preconditions(request, etag, headers)
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
        return error_response(416, f"range not satisfiable: the body has {size} bytes", headers,
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
    reader = open_pack(state, resolved) if needs_reader else None
    if reader is not None and send_body:
        spans = [p for p in pieces if isinstance(p, tuple)]
        if inline and not state.verifier.cached(reader, resolved, spans):
            reader.close()
            raise Blocking
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


def pack_file_response(request: Request, state: ServerState, resolved: Resolved, *,
                       inline: bool = False) -> Response:
    """The layout's immutable pack: the same response as ``/v1/.../pack`` (one Range parse
    decides both what is verified and what is sent; see :func:`serve_body`)."""
    headers = {"X-Sakura-Pack-File": resolved.index.pack_file}
    body = Body(((0, resolved.index.pack_bytes),))
    return serve_body(request, state, resolved, body, resolved.etag, headers, inline=inline)
