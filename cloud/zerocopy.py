"""ASGI zero-copy send for uvicorn's h11 protocol: verified pack ranges leave by sendfile.

Why (issue 29 item 7). ``sakura bench serve`` (32 loopback clients, single-range GETs of
~600 KB configurations, 2 shared cores) measured the server at 0.32 GB/s against nginx's
0.75 GB/s with the same client. A cProfile of the server process under that load put a
fifth of its time in ``socket.send`` (every body byte copied from Python ``bytes`` into the
kernel) and as much again in thread hops that fetched each 1 MiB ``pread`` chunk. Verifying
the checksums costs nothing per request once a unit has passed (the verified-unit cache),
so the copy, not the checking, was the cost. nginx sends the same ranges with sendfile.

ASGI's ``http.response.pathsend`` extension names a file but carries no offset, so it cannot
send a range. The ASGI *zero-copy send* extension (``http.response.zerocopy``: an open file,
``offset``, ``count``, ``more_body``) can, but uvicorn does not implement it. This module
does, for uvicorn's h11 protocol (the one :mod:`cloud.runner` already subclasses):

* the protocol adds ``"http.response.zerocopy": {}`` to each request's
  ``scope["extensions"]``, and wraps that request's ``send``;
* a ``http.response.zerocopy`` message is accounted to h11 with a length-only
  placeholder (h11's documented data pass-through for sendfile, so Content-Length
  framing and keep-alive stay h11's), then sent by ``os.sendfile`` at once while the
  socket takes it (:func:`_sendfile_now`), the rest with :meth:`asyncio.loop.sendfile`
  (``os.sendfile`` on a plain TCP transport, asyncio's read-and-write fallback on TLS);
* every other message goes to uvicorn's own ``send`` unchanged, including the final
  empty body message that completes the response.

What is sent is exactly ``count`` bytes at ``offset`` of the file the app passed: the
server passes the descriptor of the one pinned pack reader whose units it has just
verified (:class:`cloud.responses.PackResponse`), so the bytes verified and the bytes sent
are the same bytes of the same inode. A file that ends before ``offset + count`` (cut in
place after the check) sends fewer bytes: the connection is then closed, so the client
sees a short body against Content-Length and never a complete-looking wrong one.
A client that goes away mid-send raises :class:`ClientDisconnected` (an ``OSError``, as
ASGI 2.4 asks of ``send`` on a closed connection).
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import h11

EXTENSION = "http.response.zerocopy"
CORK = "sakura.cork"
TCP_CORK = getattr(socket, "TCP_CORK", 3)
_TRY_NATIVE = asyncio.constants._SendfileMode.TRY_NATIVE  # plain TCP transports' marker


class ClientDisconnected(OSError):
    """The connection closed before the zero-copy body was sent."""


class _Span:
    """A length-only stand-in for body bytes (what h11's pass-through hands back)."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count


class ZeroCopySend:
    """The ``send`` of one uvicorn h11 request cycle, with ``http.response.zerocopy``."""

    __slots__ = ("cycle", "send", "loop")

    def __init__(self, cycle: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.cycle = cycle
        self.send = cycle.send  # uvicorn's own (bound) send
        self.loop = loop

    async def __call__(self, message: Any) -> None:
        if message["type"] != EXTENSION:
            if message["type"] == "http.response.start" and message.get(CORK):
                _cork(self.cycle.transport, True)
            await self.send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                _cork(self.cycle.transport, False)
            return
        cycle = self.cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            raise ClientDisconnected("the client closed the connection")
        if not cycle.response_started or cycle.response_complete:
            raise RuntimeError(f"unexpected ASGI message {EXTENSION!r} outside a response body")
        count = int(message["count"])
        offset = int(message.get("offset", 0))
        if count and cycle.scope["method"] != "HEAD":
            for part in cycle.conn.send_with_data_passthrough(h11.Data(data=_Span(count))):
                if not isinstance(part, _Span):
                    cycle.transport.write(part)  # framing bytes (none with Content-Length)
                    continue
                try:
                    sent = _sendfile_now(cycle.transport, message["file"], offset, count)
                    if sent < count and sent >= 0:
                        sent += await self.loop.sendfile(cycle.transport, message["file"],
                                                         offset + sent, count - sent)
                    sent = abs(sent)
                except (OSError, RuntimeError) as exc:  # reset, broken pipe, transport closing
                    cycle.transport.close()
                    raise ClientDisconnected(f"sendfile stopped: {exc}") from exc
                if sent != count:
                    cycle.transport.close()  # the file ended early: never a complete-looking body
                    raise ClientDisconnected(
                        f"sendfile sent {sent} of {count} bytes (the file ended early)")
        if not message.get("more_body", False):
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})


def _sendfile_now(transport: Any, file: Any, offset: int, count: int) -> int:
    """``os.sendfile`` straight away, for as long as the socket takes bytes: the bytes
    sent, or minus them when the file ended (``sendfile`` returned 0) so the caller stops.

    Only on a plain TCP transport of asyncio's (``_sendfile_compatible`` is the marker
    asyncio's own ``loop.sendfile`` checks; a TLS transport has another) whose write buffer
    is empty, so the body cannot overtake the head; otherwise 0, and
    :meth:`asyncio.loop.sendfile` sends it all (it waits for the buffer to drain and for
    the socket to take more). Why: a ~600 KB range mostly fits the loopback socket's
    buffer at once, and ``loop.sendfile``'s set-up per call (a future, pause/resume
    reading, an epoll register and unregister of the socket) was ~0.15 ms per range under
    cProfile in ``sakura bench serve`` (1.7 s in ``loop.sendfile`` for 4582 ranges, 1.0 s
    of it in ``os.sendfile``); here that is paid only by the ranges the socket could not
    take whole. Measured as the server's CPU time per range (``/proc/<pid>/stat``, 32
    clients, with :class:`cloud.middleware.PackFastPath` on): 1311 -> 928 and 862 -> 751 us
    in two alternating runs on the shared 2-core host.

    uvloop is not used for this reason too: it has no ``loop.sendfile``, and its
    transports queue writes until the end of the loop's turn, so a direct ``sendfile``
    could overtake the head."""
    if (getattr(transport, "_sendfile_compatible", None) is not _TRY_NATIVE
            or transport.get_write_buffer_size() or transport.is_closing()):
        return 0
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    out, src, sent = sock.fileno(), file.fileno(), 0
    while sent < count:
        try:
            n = os.sendfile(out, src, offset + sent, count - sent)
        except (BlockingIOError, InterruptedError):
            return sent
        if n == 0:
            return -sent  # the file ended early
        sent += n
    return sent


def _cork(transport: Any, on: bool) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and not transport.is_closing():
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_CORK, 1 if on else 0)
        except OSError:
            pass


def install(protocol: Any) -> None:
    """Offer zero-copy send on ``protocol``'s current request cycle, if it has a new one
    (called after each ``handle_events`` of an h11 protocol: the cycle's ASGI task is
    created there but does not start before the loop's next turn)."""
    cycle = protocol.cycle
    if cycle is None or isinstance(cycle.__dict__.get("send"), ZeroCopySend):
        return
    if not isinstance(protocol.loop, asyncio.BaseEventLoop):
        return  # loop.sendfile is asyncio's own (uvloop does not implement it)
    if cycle.response_started:
        return
    cycle.scope.setdefault("extensions", {})[EXTENSION] = {}
    cycle.send = ZeroCopySend(cycle, protocol.loop)
