"""Paced asyncio link: accuracy against the trace integral, outages, sharing, live changes,
and robustness (client disconnects, upstream failures)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest
from sakura.traces import Trace, load_trace
from sakura.traces.bench import choose_piece
from sakura.traces.link import PacedLink, PacedLinkThread
from sakura.traces.measure import BlastServer, measure_paced, read_until, receive_for
from sakura.traces.tbf import PACKET_BYTES

from tests.traces.common import assert_follows_the_trace

MB = 1e6


@pytest.mark.parametrize("mbps", [1, 20, 200])
def test_constant_rate_accuracy(mbps: float) -> None:
    m = measure_paced(Trace.constant(mbps * MB), window_s=2.0, n_windows=1, settle_s=0.3)
    (w,) = m.windows
    assert w.expected_bytes == pytest.approx(mbps * MB / 8 * 2.0)
    assert_follows_the_trace(m)


@pytest.mark.parametrize(
    "rel, seed",
    [
        ("lumos5g/4g/4g_trace_driving_50015_dr.txt", 0),
        ("ucc5g/static_B_2020.02.13_13.57.29.csv", 1),
    ],
)
def test_real_trace_accuracy(trace_dir: Path, rel: str, seed: int) -> None:
    piece = choose_piece(load_trace(trace_dir / rel), 5.0, max_mbps=200, seed=seed)
    assert piece.scale == 1.0
    m = measure_paced(piece.trace, window_s=2.0, n_windows=2, settle_s=0.3)
    assert all(not w.outage for w in m.windows)
    assert_follows_the_trace(m)


def test_real_outage_delivers_nothing_then_resumes(trace_dir: Path) -> None:
    wifi = load_trace(trace_dir / "wifi/13_3_wifi.csv")
    assert list(wifi.rates_bps[86:94]) == [0.0] * 8  # an 8-s outage in the real trace
    # Its first 2 s after 1.5 s at 0.69/0.28 Mbit/s, then its last second and the recovery
    # (13.6, 72 Mbit/s): outage during 1.5-4.5 s of the piece.
    piece = Trace.concatenate([wifi.slice(84.5, 3.5), wifi.slice(93.0, 3.0)])
    m = measure_paced(piece, window_s=2.0, n_windows=2, settle_s=1.5)
    outage, after = m.windows
    # nothing delivered inside it; at most the two frames the last slice had in flight may be
    # read after its start on a loaded host (the clean-clone CI at 36e9a1a: 1500 bytes read
    # in it, none of them surely delivered inside: inner_bytes 0)
    assert outage.outage and outage.inner_bytes == 0, m.to_dict()
    assert outage.measured_bytes <= 2 * PACKET_BYTES, m.to_dict()
    assert after.expected_bytes == pytest.approx(13.613904e6 / 8, rel=1e-6)
    assert_follows_the_trace(m, [after])


def test_connections_share_one_bottleneck() -> None:
    m = measure_paced(Trace.constant(20 * MB), window_s=2.0, n_windows=1, connections=4)
    assert_follows_the_trace(m)


def test_shares_are_fair_and_counters_match() -> None:
    trace = Trace.constant(16 * MB)
    with BlastServer() as src, PacedLinkThread(trace, src.address) as link:
        logs = []
        threads = [
            threading.Thread(target=lambda: logs.append(receive_for(link.address, 2.0)))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        totals = [lg.cum[-1] for lg in logs]
        assert len(totals) == 3 and min(totals) > 0.2 * sum(totals)
        a, b = link.origin + 0.5, link.origin + 1.8
        assert link.delivered_between(a, b) == pytest.approx(link.expected_bytes(a, b), rel=0.05)
        # What the clients read is what the link released (minus what was still in their
        # socket buffers when they stopped reading).
        assert 0.9 * link.counters.bytes_down <= sum(totals) <= link.counters.bytes_down
        assert link.counters.connections_total == 3


def test_live_rate_change_and_zero_rate() -> None:
    with BlastServer() as src, PacedLinkThread(Trace.constant(8 * MB), src.address) as link:
        origin = link.origin  # trace origin; live changes start new segments later
        out = {}
        reader = threading.Thread(
            target=lambda: out.setdefault("log", receive_for(link.address, 3.2))
        )
        reader.start()
        time.sleep(1.0)
        link.set_rate(32 * MB)
        t_fast = time.monotonic()
        time.sleep(1.0)
        link.set_rate(0)
        t_zero = time.monotonic()
        time.sleep(1.0)
        reader.join(10)
        lg = out["log"]
        assert link.origin == pytest.approx(t_zero, abs=0.01)
        slow = lg.cum_at(t_fast) - lg.cum_at(origin + 0.2)
        fast = lg.cum_at(t_zero) - lg.cum_at(t_fast + 0.05)
        assert slow == pytest.approx(link.expected_bytes(origin + 0.2, t_fast), rel=0.05)
        assert slow == pytest.approx(1e6 * (t_fast - origin - 0.2), rel=0.05)
        assert fast == pytest.approx(link.expected_bytes(t_fast + 0.05, t_zero), rel=0.05)
        assert link.expected_bytes(t_zero, t_zero + 1.0) == 0
        # Nothing leaves the link at rate 0 (a chunk granted in the same instant as the
        # change may still go: 10 ms margin), and nothing reaches the client after the
        # bytes already in flight (0.3 s margin for a loaded machine's thread scheduling).
        assert link.delivered_between(t_zero + 0.01, t_zero + 0.95) == 0
        assert lg.cum_at(t_zero + 0.95) - lg.cum_at(t_zero + 0.3) == 0


def test_client_disconnect_and_upstream_failure_do_not_break_the_link() -> None:
    trace = Trace.constant(20 * MB)
    with BlastServer() as src, PacedLinkThread(trace, src.address) as link:
        # A client that reads a little then vanishes.
        s = socket.create_connection(link.address)
        s.recv(10000)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # RST
        time.sleep(0.2)
        lg = receive_for(link.address, 1.0)
        assert lg.cum[-1] == pytest.approx(20 * MB / 8 * 1.0, rel=0.1)
        deadline = time.monotonic() + 3
        while link.counters.connections_active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.counters.connections_active == 0
    # Upstream that refuses connections: the client is closed, the link keeps serving.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    with PacedLinkThread(trace, ("127.0.0.1", port)) as link:
        for _ in range(3):
            c = socket.create_connection(link.address, timeout=5)
            assert c.recv(100) == b""
            c.close()
        assert link.counters.upstream_failures == 3
        assert "upstream" in link.counters.last_error


def test_upstream_dying_mid_transfer_ends_the_client_cleanly() -> None:
    with BlastServer() as src, PacedLinkThread(Trace.constant(40 * MB), src.address) as link:
        c = socket.create_connection(link.address, timeout=5)
        got = len(c.recv(1000))
        assert got > 0
        src.close()  # the server dies mid-response
        t0 = time.monotonic()
        while chunk := c.recv(65536):
            got += len(chunk)
        # EOF follows the bytes the server had already sent (its socket buffer + ours).
        assert time.monotonic() - t0 < 8.0
        c.close()
        deadline = time.monotonic() + 3
        while link.counters.connections_active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.counters.connections_active == 0
        assert link.counters.connection_errors == 0
        assert link.counters.bytes_down == got  # every byte the link released arrived


def test_async_request_response_timing_and_unshaped_upstream() -> None:
    """A real request/response over the async API: the response takes the trace's time."""
    trace = Trace.from_rates([4 * MB, 0.0, 16 * MB], 0.5)  # loops every 1.5 s
    size = 1_500_000

    async def main() -> tuple[float, float, float]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            n = int((await reader.readline()).decode())
            await reader.readexactly(n)  # upload: not shaped
            writer.write(b"\x00" * size)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, PacedLink(trace, ("127.0.0.1", port)) as link:
            reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
            upload = 4_000_000
            t0 = time.monotonic()
            writer.write(f"{upload}\n".encode() + b"\x01" * upload)
            await writer.drain()
            t_up = time.monotonic() - t0
            t_req = time.monotonic()
            got = len(await reader.read(-1))
            t_done = time.monotonic()
            writer.close()
            assert got == size
            t0_trace = link.trace_time(t_req)
            return t_up, t_done - t_req, trace.time_to_deliver(size, t0_trace) - t0_trace

    t_up, measured, expected = asyncio.run(main())
    assert t_up < 1.0  # 4 MB upstream at loopback speed, not at 4-16 Mbit/s
    assert measured == pytest.approx(expected, rel=0.05, abs=0.03)


def test_busy_link_catches_up_after_event_loop_stall_but_idle_link_saves_little() -> None:
    rate = 20 * MB
    with BlastServer() as src, PacedLinkThread(Trace.constant(rate), src.address) as link:
        # Idle for 0.5 s, then a flow starts: it may use at most burst_s of saved capacity.
        time.sleep(0.5)
        sock = socket.create_connection(link.address, timeout=5)
        t0 = time.monotonic()
        out = {}
        reader = threading.Thread(target=lambda: out.setdefault("log", read_until(sock, t0 + 2.0)))
        reader.start()
        time.sleep(0.8)
        # Hold the link's event loop for 150 ms (as a busy CPU would).
        link._loop.call_soon_threadsafe(time.sleep, 0.15)
        reader.join(10)
        lg = out["log"]
        first = lg.cum_at(t0 + 0.1)
        assert first <= rate / 8 * (0.1 + 0.02) + 65536 + 1500
        window = lg.cum_at(t0 + 1.9) - lg.cum_at(t0 + 0.3)
        assert window == pytest.approx(link.expected_bytes(t0 + 0.3, t0 + 1.9), rel=0.05)


def test_a_late_read_is_not_counted_as_delivered_inside_the_window() -> None:
    # The sink was not scheduled from 0.40 to 0.68 s: what the kernel took in before the
    # window's start (0.5 s) is read at 0.68 s. measured_bytes counts it; inner_bytes, the
    # bytes surely delivered in the window, does not.
    from sakura.traces.measure import ReceiveLog, windows_from_log

    log = ReceiveLog(
        [0.0, 0.40, 0.68, 1.0, 2.5, 2.6], [0, 50_000, 85_000, 125_000, 315_000, 325_000]
    )
    (w,) = windows_from_log(log, lambda a, b: 125_000 * (b - a), 0.0, 0.5, 2.0, 1)
    assert w.measured_bytes == 315_000 - 50_000
    assert w.inner_bytes == 315_000 - 85_000
    assert w.inner_bytes <= 1.05 * w.expected_bytes < w.measured_bytes
