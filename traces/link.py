"""Paced link in user space: an asyncio TCP proxy that shapes server -> client to a trace.

``PacedLink`` listens on 127.0.0.1 (ephemeral port by default) and forwards every accepted
connection to ``upstream``. The downstream direction (upstream server -> client) of *all*
connections shares one bottleneck whose capacity follows the trace; the upstream direction
is not shaped. Pacing is a virtual-clock token bucket: a chunk of ``n`` bytes may leave when
the trace's integral since the link's virtual clock reaches ``n`` bytes, where the virtual
clock never lags real time by more than ``burst_s`` (default 20 ms, the only capacity a
quiet link may save up) or, while the link stays busy, ``catchup_s`` (default 0.25 s: a
busy link whose event loop was held up by a loaded CPU catches up instead of losing the
capacity). Chunks are ``quantum_s`` worth of the current rate (at least one 1500-byte MTU),
so pacing is fine grained; outages (rate 0) deliver nothing until they end.

An :class:`traces.impair.Impairment` adds a propagation delay per direction and packet
loss behind the bottleneck (a :class:`traces.impair.DelayLine` per connection and
direction); ``trace=None`` makes an unshaped relay that only adds the impairment (the delay
stage in front of the kernel link's tbf). The delivery log records bytes as they leave the
bottleneck; they reach the client the one-way delay later.

``PacedLinkThread`` runs a ``PacedLink`` on its own event loop in a thread (tests and
measurements); the product runs it in its own process
(:class:`traces.linkproc.PacedLinkProcess`), away from the device's CPU and GIL. Both record per-link counters and a delivery log (wall time, cumulative
bytes) to compare with ``expected_bytes`` (the exact trace integral).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sakura.traces.errors import LinkError
from sakura.traces.impair import DelayLine, Impairment, LossModel
from sakura.traces.model import Trace
from sakura.traces.schedule import LinkEmulator, LinkSchedule

log = logging.getLogger(__name__)

MTU_BYTES = 1500


@dataclass
class LinkCounters:
    """Counters of one link (all connections together)."""

    bytes_down: int = 0
    bytes_up: int = 0
    connections_total: int = 0
    connections_active: int = 0
    upstream_failures: int = 0
    connection_errors: int = 0
    lost_packets: int = 0
    retransmitted_bytes: int = 0
    last_error: str = ""


@dataclass
class DeliveryLog:
    """Cumulative downstream bytes after each paced chunk, against monotonic wall time."""

    max_entries: int = 1_000_000
    times: list[float] = field(default_factory=list)
    cum_bytes: list[int] = field(default_factory=list)
    _base: int = 0

    def record(self, wall: float, cum: int) -> None:
        if self.times and wall - self.times[-1] < 5e-4:
            self.cum_bytes[-1] = cum
            return
        self.times.append(wall)
        self.cum_bytes.append(cum)
        if len(self.times) > self.max_entries:
            half = len(self.times) // 2
            del self.times[:half]
            del self.cum_bytes[:half]

    def cum_at(self, wall: float) -> int:
        """Bytes delivered up to (and including) ``wall``."""
        i = bisect.bisect_right(self.times, wall) - 1
        return self.cum_bytes[i] if i >= 0 else 0

    def delivered_between(self, wall0: float, wall1: float) -> int:
        """Bytes delivered in the wall-clock window ``(wall0, wall1]``."""
        return self.cum_at(wall1) - self.cum_at(wall0)


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


class _Pacer:
    """One shared bottleneck: grants chunks in FIFO order at the schedule's capacity."""

    #: A request this soon after the previous grant (or queued behind another) means the
    #: link never went idle: lateness of the event loop may then be caught up.
    CONTINUOUS_S = 0.002
    #: While grants flow, a heartbeat ticks every TICK_S; a tick STALL_TICKS periods late
    #: means the event loop itself was held (a busy CPU), not that the flow paused, so the
    #: time lost may be caught up too. The heartbeat stops after IDLE_S without a grant.
    TICK_S = 0.01
    STALL_TICKS = 3
    IDLE_S = 1.0

    def __init__(self, schedule: LinkSchedule, burst_s: float, catchup_s: float) -> None:
        self.schedule = schedule
        self.burst_s = burst_s
        self.catchup_s = max(catchup_s, burst_s)
        self._virtual = -math.inf
        self._last_grant = -math.inf
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Future[bool] | None = None
        self._tick = -math.inf
        self._late_tick = -math.inf
        self._beating = False

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self._tick > self.STALL_TICKS * self.TICK_S:
            self._late_tick = now  # the loop was held since the previous tick
        self._tick = now
        if now - self._last_grant > self.IDLE_S:
            self._beating = False
            return
        asyncio.get_running_loop().call_later(self.TICK_S, self._beat)

    def _stalled(self, now: float) -> bool:
        """The event loop was held since the last grant: the heartbeat (running while
        grants flow) is late now, or came late after that grant."""
        if not self._beating:
            return False
        return (now - self._tick > self.STALL_TICKS * self.TICK_S
                or self._late_tick >= self._last_grant)

    async def acquire(self, nbytes: int) -> float:
        """Wait until ``nbytes`` may leave; returns the (monotonic) grant time."""
        loop = asyncio.get_running_loop()
        if self._lock is None:
            self._lock = asyncio.Lock()
        called = time.monotonic()
        continuous = (self._lock.locked() or called - self._last_grant < self.CONTINUOUS_S
                      or self._stalled(called))
        if not self._beating:
            self._beating, self._tick = True, called
            loop.call_later(self.TICK_S, self._beat)
        # An idle link may save up only burst_s of capacity; a busy one whose event loop
        # ran late (a loaded CPU) may catch up to catchup_s behind real time.
        slack = self.catchup_s if continuous else self.burst_s
        async with self._lock:
            while True:
                now = time.monotonic()
                start = max(self._virtual, now - slack)
                if self.schedule.rate_at(now) <= 0:
                    # In an outage nothing leaves, not even capacity saved up before it
                    # (or a grant the event loop reached late): wait for the outage's end.
                    start = max(start, now)
                finish = self.schedule.finish_time(start, nbytes)
                if finish <= now:
                    self._virtual = finish
                    self._last_grant = now
                    return now
                fut: asyncio.Future[bool] = loop.create_future()
                self._wake = fut
                handle = None
                if math.isfinite(finish):
                    handle = loop.call_later(finish - now, _resolve, fut, True)
                try:
                    timed_out = await fut
                finally:
                    if handle is not None:
                        handle.cancel()
                    self._wake = None
                if timed_out:
                    now = time.monotonic()
                    if now > finish and self.schedule.rate_at(now) <= 0:
                        continue  # woke up late, inside an outage: wait it out
                    self._virtual = finish
                    self._last_grant = now
                    if now - finish > self.STALL_TICKS * self.TICK_S:
                        # this grant itself came late (the loop was held while it waited),
                        # even if the heartbeat noticed the stall just before it
                        self._late_tick = now
                    return now
                # The schedule changed: recompute from the new segment.

    def changed(self) -> None:
        if self._wake is not None:
            _resolve(self._wake, False)


class PacedLink(LinkEmulator):
    """Asyncio TCP shaping proxy on ``host:port`` forwarding to ``upstream``.

    Use as ``async with PacedLink(trace, upstream=("127.0.0.1", port), start_s=12.0) as
    link:`` then connect clients to ``link.port``. Trace time ``start_s`` corresponds to
    ``origin`` (``time.monotonic()`` seconds; default: when the link starts).
    ``impairment`` (default none) adds delay and loss; ``trace=None``: no bottleneck.
    """

    def __init__(
        self,
        trace: Trace | None,
        upstream: tuple[str, int],
        *,
        impairment: Impairment | None = None,
        start_s: float = 0.0,
        origin: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        quantum_s: float = 0.002,
        burst_s: float = 0.02,
        catchup_s: float = 0.25,
        max_chunk: int = 65536,
        connect_timeout_s: float = 5.0,
        upstream_rcvbuf: int = 256 * 1024,
    ) -> None:
        if not (0 < quantum_s <= 0.1 and 0 <= burst_s <= 1.0):
            raise LinkError("quantum_s must be in (0, 0.1] and burst_s in [0, 1] seconds")
        self.upstream = (str(upstream[0]), int(upstream[1]))
        self.host = host
        self._requested_port = int(port)
        self._start_s = float(start_s)
        self._origin = origin
        self.quantum_s = float(quantum_s)
        self.max_chunk = int(max(MTU_BYTES, max_chunk))
        self.connect_timeout_s = float(connect_timeout_s)
        self.upstream_rcvbuf = int(upstream_rcvbuf)
        self.impairment = impairment or Impairment.none()
        self._loss = LossModel(self.impairment.loss, self.impairment.seed)
        self.shaped = trace is not None
        # an unshaped relay keeps a schedule only for the common interface
        self.schedule = LinkSchedule(trace if trace is not None else Trace.constant(1e12, 1.0),
                                     start_s, origin)
        self._pacer = _Pacer(self.schedule, burst_s, catchup_s)
        self.counters = LinkCounters()
        self.delivery = DeliveryLog()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> PacedLink:
        if self._server is not None:
            return self
        if self._origin is None:
            self.schedule.restart(self._start_s)
        # Asyncio primitives bind to one loop: a fresh pacer for every start.
        self._pacer = _Pacer(self.schedule, self._pacer.burst_s, self._pacer.catchup_s)
        try:
            self._server = await asyncio.start_server(
                self._handle, self.host, self._requested_port, backlog=512
            )
        except OSError as exc:
            raise LinkError(
                f"cannot listen on {self.host}:{self._requested_port}: {exc.strerror}"
            ) from exc
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)

    async def __aenter__(self) -> PacedLink:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def _changed(self) -> None:
        self._pacer.changed()

    def delivered_between(self, wall0: float, wall1: float) -> int:
        """Downstream bytes the link released in the monotonic wall-clock window."""
        return self.delivery.delivered_between(wall0, wall1)

    def set_impairment(self, impairment: Impairment) -> None:
        """Delay and loss from now on (connections opened from now on)."""
        self.impairment = impairment
        self._loss = LossModel(impairment.loss, impairment.seed)

    # ------------------------------------------------------------------ forwarding
    def _chunk_size(self) -> int:
        if not self.shaped:
            return self.max_chunk
        rate = self.schedule.rate_at()
        return int(min(self.max_chunk, max(MTU_BYTES, rate * self.quantum_s / 8.0)))

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self.counters.connections_total += 1
        self.counters.connections_active += 1
        uwriter: asyncio.StreamWriter | None = None
        accepted = time.monotonic()
        try:
            _nodelay(cwriter)
            try:
                ureader, uwriter = await asyncio.wait_for(
                    self._connect_upstream(), self.connect_timeout_s
                )
            except (OSError, TimeoutError) as exc:
                self.counters.upstream_failures += 1
                self.counters.last_error = f"upstream {self.upstream[0]}:{self.upstream[1]}: {exc}"
                log.warning("paced link: %s", self.counters.last_error)
                return
            _nodelay(uwriter)
            up = asyncio.create_task(self._pump_up(creader, uwriter, accepted))
            down = asyncio.create_task(self._pump_down(ureader, cwriter))
            try:
                done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
                if up in done and not up.cancelled() and up.exception() is None and up.result():
                    # Client half-closed cleanly: let the response finish.
                    await down
            finally:
                for t in (up, down):
                    t.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
        except asyncio.CancelledError:
            # Link shutting down. Returning normally (not re-raising) matters: Python
            # 3.11's start_server callback calls task.exception() on cancelled handlers.
            pass
        except Exception as exc:  # noqa: BLE001 - a connection must never crash the link
            self.counters.connection_errors += 1
            self.counters.last_error = repr(exc)
            log.warning("paced link connection error: %r", exc)
        finally:
            self.counters.connections_active -= 1
            for w in (cwriter, uwriter):
                if w is not None:
                    w.close()
            if task is not None:
                self._tasks.discard(task)

    async def _connect_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect with a small receive buffer, so that the server's bytes wait at the
        server (as behind a real bottleneck) rather than in this proxy's kernel buffer."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(*self.upstream, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            if self.upstream_rcvbuf:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.upstream_rcvbuf)
            await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)

    async def _pump_up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       accepted: float = 0.0) -> bool:
        """Client -> upstream, unshaped but delayed. True when the client half-closed
        cleanly."""
        imp = self.impairment
        line = DelayLine(writer).start() if imp.active else None
        # the TCP handshake a real link would cost before the first request bytes
        ready = accepted + imp.rtt_s
        try:
            while True:
                data = await reader.read(self.max_chunk)
                if not data:
                    if line is not None:
                        await line.flush()
                    if writer.can_write_eof():
                        with contextlib.suppress(OSError):
                            writer.write_eof()
                    return True
                self.counters.bytes_up += len(data)
                if line is None:
                    writer.write(data)
                    await writer.drain()
                    continue
                due = max(time.monotonic(), ready) + imp.up_s
                lost = self._loss.lost_packets(len(data))
                if lost:
                    self.counters.lost_packets += lost
                    self.counters.retransmitted_bytes += lost * MTU_BYTES
                    due += imp.rtt_s
                await line.put(due, data)
        except (ConnectionError, OSError):
            return False
        finally:
            if line is not None:
                await line.close()

    async def _pump_down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Upstream -> client through the shared bottleneck, then the delay stage."""
        imp = self.impairment
        line = DelayLine(writer, max_bytes=256 * 1024).start() if imp.active else None
        try:
            while True:
                data = await reader.read(self.max_chunk)
                if not data:
                    if line is not None:
                        await line.flush()
                    return
                view = memoryview(data)
                while view:
                    if writer.is_closing():
                        return
                    n = min(len(view), self._chunk_size())
                    granted = (await self._pacer.acquire(n) if self.shaped
                               else time.monotonic())
                    self.counters.bytes_down += n
                    self.delivery.record(granted, self.counters.bytes_down)
                    if line is None:
                        writer.write(view[:n])
                        view = view[n:]
                        await writer.drain()
                        continue
                    due = granted + imp.down_s
                    lost = self._loss.lost_packets(n)
                    if lost:
                        # the retransmission takes capacity again; the chunk (and what
                        # follows it in order) arrives a round trip later
                        extra = lost * MTU_BYTES
                        if self.shaped:
                            await self._pacer.acquire(extra)
                        self.counters.lost_packets += lost
                        self.counters.retransmitted_bytes += extra
                        due = time.monotonic() + imp.down_s + imp.rtt_s
                    await line.put(due, view[:n])
                    view = view[n:]
        except (ConnectionError, OSError):
            return
        finally:
            if line is not None:
                await line.close()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class PacedLinkThread(LinkEmulator):
    """A :class:`PacedLink` on its own event loop in a background thread.

    ``with PacedLinkThread(trace, upstream=("127.0.0.1", port)) as link: ... link.port``.
    Live changes (``set_rate``, ``set_trace``, ``restart``) may be called from any thread.
    """

    def __init__(self, trace: Trace, upstream: tuple[str, int], **kwargs: Any) -> None:
        self.link = PacedLink(trace, upstream, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def schedule(self) -> LinkSchedule:  # type: ignore[override]
        return self.link.schedule

    @property
    def port(self) -> int:
        return self.link.port

    @property
    def address(self) -> tuple[str, int]:
        return self.link.address

    @property
    def counters(self) -> LinkCounters:
        return self.link.counters

    def delivered_between(self, wall0: float, wall1: float) -> int:
        return self.link.delivered_between(wall0, wall1)

    def start(self, timeout_s: float = 10.0) -> PacedLinkThread:
        if self._thread is not None:
            return self
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.link.start())
            except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                self._error = exc
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.link.stop())
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="paced-link", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise LinkError("paced link thread did not start in time")
        if self._error is not None:
            thread, self._thread = self._thread, None
            thread.join()
            raise self._error
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        thread, loop = self._thread, self._loop
        self._thread = None
        if thread is None or loop is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)

    def __enter__(self) -> PacedLinkThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _changed(self) -> None:
        loop = self._loop
        if loop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.link._changed)
