"""Running an ASGI app with uvicorn: in the foreground, on an inherited socket, or in a thread.

:func:`serve_in_thread` starts a real uvicorn server on 127.0.0.1 with an ephemeral port
and yields its base URL (tests, benches); :func:`run` is what ``sakura serve`` calls.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from sakura.cloud import zerocopy
from sakura.cloud.errors import ServeConfigError
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for request heads (uvicorn has none): a
    connection that has not sent a complete request line and headers within
    ``header_timeout_s`` of starting one (slow-header clients holding connections open) is
    closed. Written here because neither uvicorn nor h11 offers the setting.

    It also offers each request ASGI's zero-copy send (:mod:`cloud.zerocopy`), with which
    the server sends verified pack ranges by sendfile."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: Any = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head() and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)
        super().data_received(data)
        if not self._awaiting_head() and self._head_timer is not None:
            self._head_timer.cancel()  # a request head arrived in time
            self._head_timer = None

    def handle_events(self) -> None:
        super().handle_events()
        zerocopy.install(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.transport.close()


def _config(app: Any, host: str, port: int, log_level: str, access_log: bool,
            header_timeout_s: float = HEADER_TIMEOUT_S) -> uvicorn.Config:
    protocol = HeaderTimeoutProtocol
    if header_timeout_s != HEADER_TIMEOUT_S:
        protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                        {"header_timeout_s": float(header_timeout_s)})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=2,
        server_header=False,
        http=protocol,
        loop="asyncio",  # loop.sendfile is asyncio's (cloud/zerocopy.py); uvloop has none
    )


def run(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    fd: int | None = None,
    log_level: str = "info",
    access_log: bool = True,
) -> None:
    """Serve ``app`` until interrupted; ``fd`` serves on an inherited listening TCP socket."""
    server = uvicorn.Server(_config(app, host, port, log_level, access_log))
    if fd is not None:
        sock = socket.socket(fileno=fd)
        server.run(sockets=[sock])
        return
    try:
        server.run()
    except OSError as exc:  # pragma: no cover - depends on the host
        raise ServeConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    if not server.started:
        raise ServeConfigError(f"the server could not start on {host}:{port}")


@contextlib.contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", *, timeout_s: float = 20.0,
                    header_timeout_s: float = HEADER_TIMEOUT_S) -> Iterator[str]:
    """Run ``app`` under uvicorn in a daemon thread on an ephemeral port; yield the base URL."""
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose protocol says
    # TCP, and without it every small response waits ~40 ms for delayed ACKs
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(_config(app, host, port, "warning", False, header_timeout_s))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn"
    )
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
