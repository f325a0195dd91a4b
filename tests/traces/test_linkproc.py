"""The paced link in its own process (pinning, live changes over the pipe, clean exit) and
the delay/loss stage (request timing lower bounds, accuracy with a delay, loss as
retransmission cost). Lower bounds are properties of the emulator (a byte never arrives
before its due time); upper bounds are generous (several seconds) so load cannot fail them.
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sakura.edge.netem import shaped
from sakura.traces import LinkError, Trace, load_trace
from sakura.traces.bench import choose_piece
from sakura.traces.impair import DEFAULT_RTT_MS, Impairment
from sakura.traces.linkproc import PacedLinkProcess, split_cpus
from sakura.traces.measure import BlastServer, measure_paced

from tests.traces.common import assert_follows_the_trace

MB = 1e6


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture()
def echo() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address
    server.shutdown()
    server.server_close()


def _round_trips(address: tuple[str, int], n: int) -> tuple[float, list[float]]:
    """(connect + first echo, [later echoes]) in seconds, over one connection."""
    t0 = time.monotonic()
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    try:
        for _ in range(n + 1):
            a = time.monotonic()
            sock.sendall(b"x")
            assert sock.recv(16) == b"x"
            times.append(time.monotonic() - a)
    finally:
        sock.close()
    times[0] = time.monotonic() - t0 - sum(times[1:])
    return times[0], times[1:]


def test_impairment_defaults_and_validation() -> None:
    imp = Impairment()
    assert imp.rtt_ms == DEFAULT_RTT_MS == 30.0 and imp.loss == 0.0
    assert imp.down_s == pytest.approx(0.015) and imp.up_s == pytest.approx(0.015)
    d = imp.to_dict()
    assert d["rtt_ms"] == 30.0 and d["down_ms"] == pytest.approx(15.0)
    assert not Impairment.none().active
    for bad in ({"rtt_ms": -1}, {"rtt_ms": float("nan")}, {"loss": 0.7}, {"loss": -0.1}):
        with pytest.raises(LinkError):
            Impairment(**bad)


def test_link_runs_in_its_own_pinned_process() -> None:
    split = split_cpus()
    cpus = split[1] if split else None
    with BlastServer() as src, PacedLinkProcess(Trace.constant(8 * MB), src.address,
                                                cpus=cpus) as link:
        assert link.pid != os.getpid() and link.alive
        assert link.conditions()["rtt_ms"] == DEFAULT_RTT_MS  # the default link has a RTT
        if cpus is not None:
            assert link.cpus == cpus == set(os.sched_getaffinity(link.pid))
            assert os.sched_getaffinity(0) != cpus  # the caller is not pinned
        pid = link.pid
    assert not link.alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_bad_cpus_are_refused() -> None:
    with pytest.raises(LinkError, match="cannot pin"):
        PacedLinkProcess(Trace.constant(MB), ("127.0.0.1", 9), cpus={10_000})


def test_process_link_accuracy_live_changes_and_counters() -> None:
    m = measure_paced(Trace.constant(20 * MB), window_s=2.0, n_windows=1, process=True)
    assert_follows_the_trace(m)
    with BlastServer() as src, PacedLinkProcess(Trace.constant(8 * MB), src.address,
                                                impairment=Impairment.none()) as link:
        sock = socket.create_connection(link.address, timeout=5)
        got = 0
        try:
            end = time.monotonic() + 0.6
            while time.monotonic() < end:
                got += len(sock.recv(65536))
            link.set_rate(0.0)  # an outage, applied in the child before this returns
            t_zero = time.monotonic()
            sock.settimeout(0.05)
            end = t_zero + 0.5
            while time.monotonic() < end:
                try:
                    got += len(sock.recv(65536))
                except TimeoutError:
                    pass
            assert link.delivered_between(t_zero + 0.01, t_zero + 0.5) == 0
            assert link.expected_bytes(t_zero, t_zero + 0.5) == 0  # the parent's mirror
            link.restart(0.0)
            assert link.rate_bps() == 0.0  # restart keeps the current (outage) trace
        finally:
            sock.close()
        counters = link.counters
        assert counters.connections_total == 1 and counters.bytes_down >= got > 0
        log = link.delivery_log()
        assert log.cum_bytes[-1] == counters.bytes_down


def test_child_exits_when_its_parent_goes_away() -> None:
    link = PacedLinkProcess(Trace.constant(MB), ("127.0.0.1", 9)).start()
    proc = link._proc
    assert proc is not None
    link._conn.close()  # what the parent's death does to the pipe
    assert proc.wait(10) == 0


def test_delay_adds_round_trips_and_handshake(echo: tuple[str, int]) -> None:
    rtt = 0.2
    with PacedLinkProcess(Trace.constant(50 * MB), echo,
                          impairment=Impairment(rtt_ms=rtt * 1000)) as link:
        first, later = _round_trips(link.address, 3)
    assert rtt * 2 <= first < rtt * 2 + 3.0  # handshake + the first request's round trip
    assert all(rtt <= t < rtt + 3.0 for t in later), later
    with PacedLinkProcess(Trace.constant(50 * MB), echo,
                          impairment=Impairment(rtt_ms=rtt * 1000, down_share=1.0)) as link:
        _, later = _round_trips(link.address, 2)
    assert all(rtt <= t < rtt + 3.0 for t in later), later  # all of it downstream


def test_delay_keeps_rate_accuracy_on_a_real_trace(trace_dir: Path) -> None:
    piece = choose_piece(load_trace(trace_dir / "lumos5g/4g/4g_trace_driving_50015_dr.txt"),
                         5.0, max_mbps=200, seed=0)
    m = measure_paced(piece.trace, window_s=2.0, n_windows=2, settle_s=0.3,
                      impairment=Impairment(rtt_ms=30.0), process=True)
    assert_follows_the_trace(m)


def test_loss_costs_capacity_and_is_counted() -> None:
    loss, rate = 0.05, 16 * MB
    with BlastServer() as src, PacedLinkProcess(
            Trace.constant(rate), src.address,
            impairment=Impairment(rtt_ms=10.0, loss=loss, seed=3)) as link:
        sock = socket.create_connection(link.address, timeout=5)
        try:
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                sock.recv(65536)
        finally:
            sock.close()
        c = link.counters
    packets = c.bytes_down / 1500
    assert c.retransmitted_bytes == 1500 * c.lost_packets
    assert abs(c.lost_packets / packets - loss) < 0.02, (c.lost_packets, packets)
    # retransmissions took capacity: goodput + retransmissions fit in the link's capacity
    assert c.bytes_down + c.retransmitted_bytes <= rate / 8 * 2.5


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_shaped_serves_http_through_the_child_with_rtt() -> None:
    import urllib.request

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/base"
        with shaped(url, Trace.constant(10 * MB), rtt_ms=100.0) as (link_url, link):
            assert link_url.endswith("/base") and link.pid != os.getpid()
            t0 = time.monotonic()
            with urllib.request.urlopen(link_url + "/x", timeout=10) as resp:
                assert resp.read() == b"hello"
            assert time.monotonic() - t0 >= 0.2  # handshake + one round trip
            assert link.conditions()["rtt_ms"] == 100.0
            link.restart(0.0)
    finally:
        server.shutdown()
        server.server_close()


def test_the_round_trip_changes_live_for_new_connections(echo: tuple[str, int]) -> None:
    with PacedLinkProcess(Trace.constant(50 * MB), echo,
                          impairment=Impairment(rtt_ms=100.0)) as link:
        _, before = _round_trips(link.address, 1)
        link.set_impairment(Impairment(rtt_ms=400.0))
        assert link.conditions()["rtt_ms"] == 400.0
        _, after = _round_trips(link.address, 2)
    assert 0.1 <= before[0] < 0.1 + 3.0
    assert all(0.4 <= t < 0.4 + 3.0 for t in after), after
