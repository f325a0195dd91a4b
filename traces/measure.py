"""Measuring a link emulator against its trace: bytes received per window vs the integral.

A blasting TCP source sends as fast as the link lets it; a sink on the other side records
(monotonic time, cumulative bytes) as it reads. Over consecutive windows after a short
settle time, the received bytes are compared with the trace's exact integral
(``expected_bytes``). Used by the accuracy tests and by ``sakura bench link``.

The source and sink are plain stdlib socket code so that they can also run as small Python
processes inside network namespaces (:data:`SOURCE_SCRIPT`, :data:`SINK_SCRIPT`).
"""

from __future__ import annotations

import bisect
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sakura.traces.errors import LinkError
from sakura.traces.impair import Impairment
from sakura.traces.link import PacedLinkThread
from sakura.traces.linkproc import PacedLinkProcess
from sakura.traces.model import Trace
from sakura.traces.netns import KernelShapedLink

#: Windows expecting fewer bytes than this are outage windows (nothing may arrive).
OUTAGE_BYTES = 1.0

#: Source for a namespace: ``python -c SOURCE_SCRIPT HOST PORT [CC]``; blasts zeros to each
#: client, optionally with TCP congestion control CC (e.g. cubic).
SOURCE_SCRIPT = r"""
import socket, sys, threading
host, port = sys.argv[1], int(sys.argv[2])
cc = sys.argv[3] if len(sys.argv) > 3 else ""
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if cc:
    srv.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
srv.bind((host, port)); srv.listen(16)
print("ready", flush=True)
buf = bytes(65536)
def blast(conn):
    try:
        while True:
            conn.sendall(buf)
    except OSError:
        pass
    finally:
        conn.close()
while True:
    conn, _ = srv.accept()
    print("accepted", flush=True)
    threading.Thread(target=blast, args=(conn,), daemon=True).start()
"""

#: Sink for a namespace: ``python -c SINK_SCRIPT HOST PORT``: connects, then reads the
#: monotonic end time from stdin, reads the flow until then and prints "t cum" lines.
SINK_SCRIPT = r"""
import socket, sys, time
from sakura.traces.measure import read_until
host, port = sys.argv[1], int(sys.argv[2])
for attempt in range(200):
    try:
        s = socket.create_connection((host, port), timeout=5)
        break
    except OSError:
        time.sleep(0.02)
end = float(sys.stdin.readline())
log = read_until(s, end)
sys.stdout.write("\n".join(f"{t:.6f} {c}" for t, c in zip(log.times, log.cum)) + "\n")
"""


@dataclass
class WindowResult:
    """One measurement window (times relative to the link origin, trace time offset)."""

    t0_s: float
    t1_s: float
    expected_bytes: float
    measured_bytes: int
    # Bytes surely delivered inside the window: those read after the sink's first sample
    # at or past its start (bytes read at that sample may have arrived before it, while the
    # sink was not scheduled). A link "never faster than its trace" is checked on these, so
    # that a late read is not taken for an overshoot.
    inner_bytes: int | None = None

    @property
    def outage(self) -> bool:
        return self.expected_bytes < OUTAGE_BYTES

    @property
    def rel_error(self) -> float | None:
        if self.outage:
            return None
        return abs(self.measured_bytes - self.expected_bytes) / self.expected_bytes


@dataclass
class Measurement:
    """All windows of one run of one emulator over one trace piece."""

    emulator: str
    trace: str
    start_s: float
    windows: list[WindowResult] = field(default_factory=list)

    @property
    def max_rel_error(self) -> float | None:
        errs = [w.rel_error for w in self.windows if w.rel_error is not None]
        return max(errs) if errs else None

    @property
    def mean_rel_error(self) -> float | None:
        errs = [w.rel_error for w in self.windows if w.rel_error is not None]
        return sum(errs) / len(errs) if errs else None

    @property
    def outage_bytes(self) -> int:
        """Bytes received during windows where the trace has no capacity at all."""
        return sum(w.measured_bytes for w in self.windows if w.outage)

    def to_dict(self) -> dict[str, object]:
        return {
            "emulator": self.emulator,
            "trace": self.trace,
            "start_s": self.start_s,
            "max_rel_error": self.max_rel_error,
            "mean_rel_error": self.mean_rel_error,
            "outage_bytes": self.outage_bytes,
            "windows": [
                {**asdict(w), "rel_error": w.rel_error, "outage": w.outage} for w in self.windows
            ],
        }


@dataclass
class ReceiveLog:
    """(monotonic time, cumulative bytes) samples of a sink."""

    times: list[float]
    cum: list[int]

    def cum_at(self, wall: float) -> float:
        """Cumulative bytes received by ``wall``: the last sample at or before it.

        (A step, not an interpolation: bytes that arrived after ``wall`` must never be
        counted before it, or an outage would seem to leak.)
        """
        i = bisect.bisect_right(self.times, wall) - 1
        return float(self.cum[i]) if i >= 0 else 0.0

    def cum_from(self, wall: float) -> float:
        """Cumulative bytes at the first sample at or after ``wall`` (every byte counted
        after it arrived after ``wall``)."""
        i = bisect.bisect_left(self.times, wall)
        return float(self.cum[i]) if i < len(self.cum) else float(self.cum[-1] if self.cum else 0)

    @classmethod
    def parse(cls, text: str) -> ReceiveLog:
        times: list[float] = []
        cum: list[int] = []
        for line in text.split("\n"):
            parts = line.split()
            if len(parts) == 2:
                times.append(float(parts[0]))
                cum.append(int(parts[1]))
        return cls(times, cum)


def windows_from_log(
    log: ReceiveLog,
    expected: Callable[[float, float], float],
    origin: float,
    settle_s: float,
    window_s: float,
    n_windows: int,
) -> list[WindowResult]:
    """Cut ``n_windows`` windows of ``window_s`` after ``origin + settle_s``."""
    out = []
    for k in range(n_windows):
        a = origin + settle_s + k * window_s
        b = a + window_s
        measured = round(log.cum_at(b) - log.cum_at(a))
        inner = max(0, round(log.cum_at(b) - log.cum_from(a)))
        out.append(
            WindowResult(
                t0_s=round(a - origin, 6),
                t1_s=round(b - origin, 6),
                expected_bytes=float(expected(a, b)),
                measured_bytes=int(measured),
                inner_bytes=int(inner),
            )
        )
    return out


class BlastServer:
    """Thread-based TCP source on 127.0.0.1 sending zeros to every client until closed."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="blast-accept", daemon=True)

    def __enter__(self) -> BlastServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        for c in list(self._conns):
            with contextlib.suppress(OSError):
                c.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._blast, args=(conn,), daemon=True).start()

    def _blast(self, conn: socket.socket) -> None:
        buf = bytes(65536)
        try:
            while not self._stop.is_set():
                conn.sendall(buf)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                conn.close()


def read_until(sock: socket.socket, end: float) -> ReceiveLog:
    """Read ``sock`` until monotonic time ``end``, logging cumulative bytes; closes it."""
    sock.settimeout(0.05)
    buf = bytearray(262144)
    cum = 0
    last = time.monotonic()
    times = [last]
    cums = [0]
    try:
        while True:
            now = time.monotonic()
            if now >= end:
                break
            try:
                n = sock.recv_into(buf)
            except TimeoutError:
                n = -1
            now = time.monotonic()
            if n == 0:
                break
            if n > 0:
                cum += n
                last = now
            if n < 0 and cum != cums[-1]:
                # a quiet spell after reads that came too soon to be sampled: stamp those
                # bytes at their read, not at this timeout (which would move them into it)
                times.append(last)
                cums.append(cum)
            elif now - times[-1] >= 0.002:
                times.append(now)
                cums.append(cum)
    finally:
        sock.close()
    times.append(time.monotonic())
    cums.append(cum)
    return ReceiveLog(times, cums)


def receive_for(address: tuple[str, int], seconds: float) -> ReceiveLog:
    """Connect to ``address`` and read for ``seconds``, logging cumulative bytes."""
    sock = socket.create_connection(address, timeout=5)
    return read_until(sock, time.monotonic() + seconds)


def measure_paced(
    trace: Trace,
    start_s: float = 0.0,
    *,
    window_s: float = 2.0,
    n_windows: int = 2,
    settle_s: float = 0.3,
    connections: int = 1,
    impairment: Impairment | None = None,
    process: bool = False,
) -> Measurement:
    """Blast through a paced link and compare windows: a
    :class:`traces.link.PacedLinkThread`, or with ``process`` the product's
    :class:`traces.linkproc.PacedLinkProcess`. With ``connections > 1`` several sinks share
    the link; their bytes are summed. With an ``impairment``, bytes arrive the one-way delay
    after they leave the bottleneck: windows are compared with the capacity that long before.
    """
    seconds = settle_s + window_s * n_windows + 0.1
    imp = impairment or Impairment.none()
    make: Any = PacedLinkProcess if process else PacedLinkThread
    with (
        BlastServer() as source,
        make(trace, source.address, start_s=start_s, impairment=imp) as link,
    ):
        socks = [socket.create_connection(link.address, timeout=5) for _ in range(connections)]
        deadline = time.monotonic() + 10
        while link.counters.connections_active < connections:
            if time.monotonic() > deadline:
                raise LinkError("paced link did not accept the measurement connections")
            time.sleep(0.005)
        # Trace time starts once the flows are connected (not at link start-up).
        link.restart(start_s)
        origin = link.origin
        logs: list[ReceiveLog] = []
        threads = [
            threading.Thread(
                target=lambda s=s: logs.append(read_until(s, origin + seconds)), daemon=True
            )
            for s in socks
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 10)
        d = imp.down_s

        def expected(a: float, b: float) -> float:
            return link.expected_bytes(a - d, b - d)

        windows = _sum_windows(logs, expected, origin, settle_s, window_s, n_windows)
    return Measurement("paced", trace.name, float(start_s), windows)


def _sum_windows(
    logs: list[ReceiveLog],
    expected: Callable[[float, float], float],
    origin: float,
    settle_s: float,
    window_s: float,
    n_windows: int,
) -> list[WindowResult]:
    per_log = [windows_from_log(lg, expected, origin, settle_s, window_s, n_windows) for lg in logs]
    out = per_log[0]
    for other in per_log[1:]:
        for w, o in zip(out, other):
            w.measured_bytes += o.measured_bytes
    return out


def measure_kernel(
    trace: Trace,
    start_s: float = 0.0,
    *,
    window_s: float = 2.0,
    n_windows: int = 2,
    settle_s: float = 0.5,
    port: int = 5201,
    congestion_control: str = "cubic",
) -> Measurement:
    """Blast through a :class:`traces.netns.KernelShapedLink` and compare windows.

    The source runs in the server namespace, the sink in the client namespace (as small
    Python processes); the trace clock restarts when the source accepts the flow. The source
    uses ``congestion_control`` (default CUBIC, a queue-filling sender, so that the link and
    not the sender's model of it is measured; ``""`` keeps the system default, which may be
    BBR, whose pacing does not track a fast-changing link).
    """
    seconds = settle_s + window_s * n_windows + 0.1
    with KernelShapedLink(trace, start_s=start_s) as link:
        src = link.popen_in(
            "server",
            [sys.executable, "-c", SOURCE_SCRIPT, link.server_addr, str(port), congestion_control],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = src.stdout.readline() if src.stdout else ""
        if "ready" not in line:
            raise LinkError("traffic source in the server namespace did not start")
        sink = link.popen_in(
            "client",
            [sys.executable, "-c", SINK_SCRIPT, link.server_addr, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Trace time starts when the flow does (connection accepted), not at process start.
        if "accepted" not in (src.stdout.readline() if src.stdout else ""):
            raise LinkError("traffic sink in the client namespace did not connect")
        link.restart(start_s)
        try:
            out, err = sink.communicate(f"{link.origin + seconds}\n", timeout=seconds + 30)
        except subprocess.TimeoutExpired as exc:
            raise LinkError("traffic sink did not finish") from exc
        if sink.returncode != 0:
            raise LinkError(f"traffic sink failed: {err.strip()[-400:]}")
        log = ReceiveLog.parse(out)
        windows = windows_from_log(
            log, link.expected_bytes, link.origin, settle_s, window_s, n_windows
        )
        if link.error:
            raise LinkError(link.error)
    return Measurement("kernel", trace.name, float(start_s), windows)
