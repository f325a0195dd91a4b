"""Kernel shaping (namespaces + veth + tbf): accuracy, outages, isolation and clean-up.

Needs root, iproute2 and tbf; skipped with the reason otherwise.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sakura.traces import NetnsUnavailableError, Trace, load_trace
from sakura.traces.bench import choose_piece
from sakura.traces.measure import measure_kernel
from sakura.traces.netns import KernelShapedLink, kernel_shaping_unavailable_reason
from sakura.traces.tbf import PACKET_BYTES

from tests.traces.common import assert_follows_the_trace

MB = 1e6
REASON = kernel_shaping_unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"kernel shaping: {REASON}")
pytestmark = pytest.mark.root


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_not_root_gives_clear_error(monkeypatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailableError, match="needs root"):
        KernelShapedLink(Trace.constant(MB)).start()


@needs_kernel
def test_namespaces_isolated_and_removed() -> None:
    before = _netns()
    with KernelShapedLink(Trace.constant(10 * MB)) as link:
        assert {link.server_ns, link.client_ns} <= _netns()
        assert link.network.prefixlen == 30 and link.network.is_private
        addrs = link.run_in("server", ["ip", "-o", "addr", "show", link.server_dev]).stdout
        assert f"{link.server_addr}/30" in addrs
        qdisc = link.run_in("server", ["tc", "qdisc", "show", "dev", link.server_dev]).stdout
        assert "tbf" in qdisc
        # The veth exists only inside the namespaces, not on the host.
        host = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert link.server_dev not in host and link.client_dev not in host
        reach = link.run_in(
            "client",
            [sys.executable, "-c", "import socket,sys; s=socket.socket(); s.settimeout(2);"
             f"print(s.connect_ex(('{link.server_addr}', 9)))"],
        )  # fmt: skip
        assert reach.stdout.strip() == "111"  # connection refused: reachable, nothing listens
        sleeper = link.popen_in("server", ["sleep", "60"])
    assert sleeper.poll() is not None  # processes started in the namespaces are ended
    assert _netns() == before


@needs_kernel
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_cleanup_on_errors(exc: type[BaseException]) -> None:
    before = _netns()
    with pytest.raises(exc):
        with KernelShapedLink(Trace.constant(MB)) as link:
            assert link.server_ns in _netns()
            raise exc("boom")
    assert _netns() == before


def test_short_slices_are_averaged_over_control_cells() -> None:
    # No root needed: only the control schedule is computed.
    trace = Trace.from_rates(np.array([0, 10, 2, 0, 0, 0, 0, 0, 8, 8]) * MB, 0.1)
    link = KernelShapedLink(trace, origin=100.0)
    # Cell 0-0.25 s: 0.1 s at 0, 0.1 s at 10, 0.05 s at 2 Mbit/s.
    assert link._control_rate(100.05) == pytest.approx((1.0 + 0.1) * MB / 0.25)
    assert link._control_next(100.05) == pytest.approx(100.25)
    # 0.5-0.75 s of trace time is all outage: the control rate is exactly 0 there.
    assert link._control_rate(100.6) == 0.0
    long = KernelShapedLink(Trace.from_rates([1 * MB, 3 * MB], 1.0), origin=0.0)
    assert long._control_rate(1.2) == 3 * MB and long._control_next(0.3) == pytest.approx(1.0)


@needs_kernel
def test_mahimahi_accuracy(trace_dir: Path) -> None:
    trace = load_trace(trace_dir / "mahimahi/ATT-LTE-driving-2016.down")  # 100-ms bins
    piece = choose_piece(trace, 5.5, seed=4)
    m = measure_kernel(piece.trace, window_s=2.0, n_windows=2)
    assert_follows_the_trace(m)


OVERSHOOT_1MBPS = pytest.mark.xfail(
    strict=False,
    reason="open (issue 28 note, 2026-12-05): in the full suite, not alone, the 1 Mbit/s link "
    "delivered exactly 272224 bytes for 250000 in three clean-clone CI runs (05b04bf, "
    "de55125 twice), with inner_bytes over too, so not a late read; cause not found",
)


@needs_kernel
@pytest.mark.parametrize("mbps", [pytest.param(1, marks=OVERSHOOT_1MBPS), 200])
def test_constant_rate_accuracy(mbps: float) -> None:
    m = measure_kernel(Trace.constant(mbps * MB), window_s=2.0, n_windows=1)
    assert_follows_the_trace(m)


@needs_kernel
def test_real_trace_accuracy(trace_dir: Path) -> None:
    trace = load_trace(trace_dir / "lumos5g/4g/4g_trace_driving_50015_dr.txt")
    piece = choose_piece(trace, 5.5, max_mbps=200, seed=0)
    m = measure_kernel(piece.trace, window_s=2.0, n_windows=2)
    assert_follows_the_trace(m)


@needs_kernel
def test_real_outage_delivers_nothing_then_resumes(trace_dir: Path) -> None:
    wifi = load_trace(trace_dir / "wifi/13_3_wifi.csv")
    # 1 s at 0.69 and 0.28 Mbit/s, an 8-s outage (86-94 s), then 13.6 and 72 Mbit/s:
    # take 84.5-96 s; the outage is 1.5-9.5 s of the piece.
    piece = wifi.slice(84.5, 11.5)
    m = measure_kernel(piece, window_s=2.0, n_windows=5, settle_s=1.5)
    *outage, after = m.windows
    assert [w.t0_s for w in outage] == pytest.approx([1.5, 3.5, 5.5, 7.5])
    first, *inside = outage
    assert all(w.outage and w.measured_bytes == 0 for w in inside), m.to_dict()
    # Its first window may hold the frame the switch to the outage lets out and the one the
    # old rate had in flight (the clean-clone CI at 19af38f counted bytes there with the
    # suite's other work on the host; the switch is made early, but by a thread that a
    # loaded host can wake late). Anything more would be a leak.
    assert first.outage and first.measured_bytes <= 2 * PACKET_BYTES, m.to_dict()
    # It resumes: the window after the outage follows the trace (a clean-clone CI run
    # delivered 5.6% short there with the suite's other work on the host).
    assert after.t0_s == pytest.approx(9.5) and not after.outage
    assert_follows_the_trace(m, [after])


_ECHO = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(4)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while d := c.recv(100):
        c.sendall(d)
    c.close()
"""

_PING = r"""
import socket, sys, time
t0 = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = []
for i in range(4):
    a = t0 if i == 0 else time.monotonic()
    c.sendall(b"x"); assert c.recv(10) == b"x"
    out.append(time.monotonic() - a)
print(" ".join(repr(x) for x in out))
"""


@needs_kernel
def test_kernel_link_delay_stage_adds_the_round_trip() -> None:
    from sakura.traces.impair import Impairment

    rtt = 0.15
    with KernelShapedLink(Trace.constant(20 * MB),
                          impairment=Impairment(rtt_ms=rtt * 1000)) as link:
        echo = link.popen_in("server", [sys.executable, "-c", _ECHO, "8001"],
                             stdout=subprocess.PIPE, text=True)
        assert "ready" in echo.stdout.readline()
        relay = link.delay_stage(8001, 8000)
        assert relay.pid and link.conditions()["rtt_ms"] == rtt * 1000
        res = link.run_in("client", [sys.executable, "-c", _PING, link.server_addr, "8000"])
        assert res.returncode == 0, res.stderr
        times = [float(x) for x in res.stdout.split()]
    assert rtt * 2 <= times[0] < rtt * 2 + 3.0  # connect: the relay's handshake round trip
    assert all(rtt <= t < rtt + 3.0 for t in times[1:]), times
    assert not relay.alive  # the relay stops with the link


_FLOOD = r"""
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(4)
print("ready", flush=True)

def serve(c):
    if c.recv(1) == b"f":  # flood: 2 MB, far more than 2 Mbit/s carries in the test
        try:
            c.sendall(b"x" * 2_000_000)
        except OSError:
            pass
    else:  # one byte back
        c.sendall(b"y")

while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""

_FLOOD_CLIENT = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.sendall(b"f")
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end and c.recv(65536):
    pass
"""

_ONE_BYTE = r"""
import socket, sys, time
t0 = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
c.sendall(b"p")
assert c.recv(1) == b"y"
print(time.monotonic() - t0)
"""


@needs_kernel
def test_a_restart_starts_on_an_empty_bottleneck_with_no_arp_behind_it() -> None:
    """What one run leaves queued in tbf (a flood far above 2 Mbit/s: 40-180 kB queued by
    this kernel's BBR)
    is dropped when the link restarts for the next run, whose first exchange then crosses
    at once instead of behind ~seconds of backlog; each end's neighbour entry is permanent,
    so no ARP ever waits in that queue (a replay saw "No route to host" after an abandoned
    transfer inside an outage)."""
    with KernelShapedLink(Trace.constant(2 * MB)) as link:
        for ns in ("server", "client"):
            neigh = link.run_in(ns, ["ip", "neigh", "show"]).stdout
            assert "PERMANENT" in neigh, neigh
        srv = link.popen_in("server", [sys.executable, "-c", _FLOOD, link.server_addr,
                                       "8002"], stdout=subprocess.PIPE, text=True)
        assert "ready" in srv.stdout.readline()
        flood = link.popen_in("client", [sys.executable, "-c", _FLOOD_CLIENT,
                                         link.server_addr, "8002", "30"])
        deadline = time.monotonic() + 10
        while link.qdisc_stats().get("backlog_bytes", 0) < 100_000:
            assert time.monotonic() < deadline, link.qdisc_stats()
            time.sleep(0.05)
        flood.kill()  # the run ends: its client goes, what it left queued stays in tbf
        flood.wait(5)
        link.restart(0.0)
        assert link.qdisc_stats().get("backlog_bytes", 0) < 20_000
        res = link.run_in("client", [sys.executable, "-c", _ONE_BYTE, link.server_addr,
                                     "8002"])
        assert res.returncode == 0, res.stderr
        # behind >= 100 kB at 2 Mbit/s the byte would wait >= 0.4 s
        assert float(res.stdout) < 0.3, res.stdout
        assert link.error == ""


@needs_kernel
def test_a_hung_tc_change_is_a_fault_and_the_rate_thread_goes_on(monkeypatch) -> None:
    """A `tc change` that hangs (run_cmd's timeout) used to end the rate thread with an
    exception: tbf then kept its last rate, an outage's 8 bit/s included, for every later
    run, and nothing said so. Now it is a counted fault with its reason, and the next
    boundary is applied."""
    import sakura.traces.netns as netns

    real = netns.run_cmd
    hung = []

    def run_cmd(cmd, *args, **kwargs):
        if "change" in cmd and not hung:
            hung.append(cmd)
            raise subprocess.TimeoutExpired(cmd, 10.0)
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(netns, "run_cmd", run_cmd)
    # a new rate every 0.3 s: every boundary is a tc change
    trace = Trace.from_rates(np.array([4, 8, 2, 6, 3, 9, 5, 7] * 4) * MB, 0.3)
    with KernelShapedLink(trace) as link:
        deadline = time.monotonic() + 10
        while (not hung or len(link.applied) < 3) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hung and link.faults == 1
        assert "tc -n" in link.error and "timed out" in link.error
        assert link.health() == ""  # the thread lives on
        assert len(link.applied) >= 3  # and later boundaries were applied
        assert link.applied[-1].wall > link.applied[0].wall


def test_tbf_stuck_needs_a_backlog_no_progress_and_a_rate_that_would_send() -> None:
    from sakura.traces.tbf import STUCK_S, tbf_stuck

    held = {"sent_bytes": 5000, "backlog_bytes": 72036}
    rate = 3.5e6
    assert "72036 B queued" in tbf_stuck(held, dict(held), rate, STUCK_S)
    assert tbf_stuck(held, {**held, "sent_bytes": 6514}, rate, STUCK_S) == ""  # it sent
    assert tbf_stuck(held, {**held, "backlog_bytes": 0}, rate, STUCK_S) == ""  # drained
    assert tbf_stuck({**held, "backlog_bytes": 0}, held, rate, STUCK_S) == ""  # just queued
    # an outage's 8 bit/s (or any rate that earns under two frames in the window) holds
    # its queue by design
    assert tbf_stuck(held, dict(held), 8.0, STUCK_S) == ""
    assert tbf_stuck(held, dict(held), 2 * 8 * PACKET_BYTES / STUCK_S * 0.99, STUCK_S) == ""
    assert tbf_stuck(held, dict(held), rate, STUCK_S / 2) == ""  # too soon to say
    assert tbf_stuck({}, held, rate, STUCK_S) == ""  # no earlier reading


@needs_kernel
def test_a_stuck_tbf_is_a_fault_and_is_replaced(monkeypatch) -> None:
    """A tbf that holds a backlog and sends nothing while its rate would (seen in a capture,
    2026-12-07, traces/tbf.py STUCK_S) is a counted fault naming it, and a fresh tbf
    replaces it under the other handle. Here the counters are frozen by hand."""
    trace = Trace.constant(20 * MB, 30.0)
    with KernelShapedLink(trace) as link:
        frozen = {"sent_bytes": 123456, "sent_packets": 90, "dropped": 0,
                  "backlog_bytes": 72036}
        handle = link._handle
        monkeypatch.setattr(link, "qdisc_stats", lambda: dict(frozen))
        deadline = time.monotonic() + 10
        while link.faults == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert link.faults >= 1 and link.error.startswith("tbf stopped dequeuing: 72036 B")
        # and the cause found behind the one seen: one frame per packet into tbf
        shown = subprocess.run(["ip", "-n", link.server_ns, "-d", "link", "show",
                                link.server_dev], capture_output=True, text=True).stdout
        assert "gso_max_segs 1 " in shown
        assert link._handle != handle  # replaced
        assert link.health() == ""
        monkeypatch.undo()
        faults = link.faults
        time.sleep(2.5)  # real counters again: a healthy tbf is not called stuck
        assert link.faults == faults
