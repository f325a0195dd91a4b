"""Kernel link shaping: two network namespaces joined by a veth pair, tbf re-rated live.

``KernelShapedLink`` is built in a :class:`traces.namespaces.NamespacePair` (a *server* and a
*client* namespace joined by a veth pair) and puts a ``tbf`` qdisc (:mod:`traces.tbf`) on
the server side's veth (so server -> client is shaped, client -> server is not). A thread
changes the tbf rate at every slice boundary of the trace; slices shorter than
``min_slice_s`` (default 0.25 s, e.g. Mahimahi's 100-ms bins) are averaged over cells of
that length, because each ``tc`` change lands within a few ms of its boundary (integrals
over whole cells are kept; an outage shorter than a cell becomes a lower rate). Only the
namespaces it created are touched; everything is deleted on exit, on errors and on
KeyboardInterrupt. :meth:`KernelShapedLink.restart` drops what an earlier run left queued,
so every run starts on an empty bottleneck.

Delay: this kernel has no ``netem``, so :meth:`KernelShapedLink.delay_stage` starts a relay
process inside the server namespace (a :class:`traces.linkproc.PacedLinkProcess` without a
bottleneck) that gives the server's bytes their one-way delay before they enter tbf, and
the client's bytes theirs before they reach the server. TCP over the veth itself keeps a
sub-millisecond round trip: the relay delays data, it does not lengthen TCP's ACK clock.

tbf gets one frame per packet (``gso_max_segs 1`` on the server's veth: a GSO packet queued
under a fast slice's burst stuck the link for good once a slower slice's smaller burst was
set), and a watch thread counts a tbf that holds a backlog without sending as a fault and
replaces it (:func:`traces.tbf.tbf_stuck`).

Loss is real by default: nftables drop rules in both namespaces (:mod:`traces.nft_loss`);
with ``real_loss=False`` the relay models it. TCP timers: the routes' ``rto_min``
(:mod:`traces.namespaces`, :func:`scaled_rto_min_ms`).

Needs root, ``ip`` (iproute2) and ``tc`` with ``tbf`` (``netem`` is not required); loss needs
``nft`` (Debian package ``nftables``).
"""

from __future__ import annotations

import contextlib
import math
import socket
import subprocess
import threading
import time
from dataclasses import replace
from typing import Any

from sakura.traces.errors import LinkError, NetnsUnavailableError
from sakura.traces.impair import MODELLED_LOSS, NO_LOSS, Impairment
from sakura.traces.linkproc import PacedLinkProcess
from sakura.traces.model import Trace
from sakura.traces.namespaces import (
    NamespacePair,
    kernel_shaping_unavailable_reason,
    run_cmd,
    socket_in_namespace,
)
from sakura.traces.nft_loss import REAL_LOSS, NftLoss, check_loss
from sakura.traces.schedule import LinkEmulator, LinkSchedule, Segment
from sakura.traces.tbf import (
    KICK_PORT,
    PACKET_BYTES,
    STUCK_S,
    TbfSetting,
    TbfShape,
    parse_qdisc_stats,
    tbf_stuck,
    tc_tbf,
)


class KernelShapedLink(NamespacePair, LinkEmulator):
    """Two namespaces + veth + tbf following a trace (server -> client shaped).

    ``with KernelShapedLink(trace, start_s=30.0) as link:`` then run a server with
    ``link.popen_in("server", [...])`` bound to ``link.server_addr`` and a client with
    ``link.run_in("client", [...])`` connecting to it. Trace time ``start_s`` is at
    ``link.origin`` (``time.monotonic()``), i.e. when the link starts (or ``restart()``).
    TCP congestion control is the host default (BBR on some hosts); a sender may pick its own
    per socket (``TCP_CONGESTION``), as the accuracy measurement does (CUBIC).

    ``loss``: probability that each IP packet on the veth is dropped, in each direction
    (None: the impairment's ``loss``); real drops by nftables unless ``real_loss=False``
    (then the delay stage models it). ``rto_min_ms``: the routes' ``rto_min`` in both
    namespaces (None: the kernel's :data:`KERNEL_RTO_MIN_MS`; see :func:`scaled_rto_min_ms`).
    """

    def __init__(
        self,
        trace: Trace,
        *,
        start_s: float = 0.0,
        origin: float | None = None,
        burst_s: float = 0.002,
        queue_s: float = 0.5,
        min_queue_bytes: int = 1 << 20,
        compensate_burst: bool = True,
        overhead: float = PACKET_BYTES / 1448,
        min_burst_bytes: int = 2 * PACKET_BYTES,
        min_slice_s: float = 0.25,
        impairment: Impairment | None = None,
        loss: float | None = None,
        real_loss: bool = True,
        rto_min_ms: float | None = None,
    ) -> None:
        if not (0 < burst_s <= 0.1 and queue_s > 0):
            raise LinkError("burst_s must be in (0, 0.1] and queue_s > 0 seconds")
        self.schedule = LinkSchedule(trace, start_s, origin)
        self._start_s = float(start_s)
        self._origin = origin
        imp = impairment if impairment is not None else Impairment()
        #: delay (what :meth:`delay_stage` adds; default a 30 ms round trip) and loss
        self.impairment = imp if loss is None else replace(imp, loss=check_loss(loss))
        #: True: loss is dropped for real (nftables); False: the delay stage models it
        self.real_loss = bool(real_loss)
        NamespacePair.__init__(self, rto_min_ms)
        #: the drop rules, receiving side of each direction
        self._loss = NftLoss(((self.client_ns, self.client_dev, "down"),
                              (self.server_ns, self.server_dev, "up")),
                             one_frame_always=(self.server_dev,))
        self._relays: list[Any] = []
        self.tbf = TbfShape(burst_s=float(burst_s), queue_s=float(queue_s),
                            min_queue_bytes=int(min_queue_bytes),
                            compensate_burst=compensate_burst, overhead=float(overhead),
                            min_burst_bytes=int(max(PACKET_BYTES, min_burst_bytes)))
        self.min_slice_s = float(min_slice_s)
        self.applied: list[TbfSetting] = []
        self.apply_latency_s = 0.003
        self._handle = "1:"  # the root tbf's handle; restart() swaps it for the other one
        self._thread: threading.Thread | None = None
        self._watch: threading.Thread | None = None  # the stuck-tbf watch (_watch_loop)
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._tc_lock = threading.Lock()  # one tc command on the qdisc at a time
        self._error: str = ""
        #: faults of the emulator itself (a tc command that failed or hung, the rate thread
        #: stopped): a run during which this grew measured the emulator, not the client
        self.faults = 0
        self._last: tuple[int, int, int] | None = None
        self._kick_sock: socket.socket | None = None

    # ------------------------------------------------------------------ delay stage
    def delay_stage(self, upstream_port: int, listen_port: int,
                    cpus: set[int] | None = None) -> Any:
        """Start the delay/loss relay in the server namespace: it listens on
        ``server_addr:listen_port`` and forwards to ``127.0.0.1:upstream_port`` there (run
        the server on that port). Returns the :class:`traces.linkproc.PacedLinkProcess`;
        it stops with the link. With real loss the relay's own loss model is off."""
        if self._thread is None:
            raise LinkError("start the kernel link before its delay stage")
        relay = PacedLinkProcess(None, ("127.0.0.1", int(upstream_port)),
                                 impairment=self._stage_impairment(), cpus=cpus,
                                 netns=self.server_ns,
                                 host=self.server_addr, port=int(listen_port)).start()
        self._relays.append(relay)
        return relay

    def _stage_impairment(self) -> Impairment:
        """What the delay stage adds: the delay, and the loss only when it is not real."""
        if self.real_loss and self.impairment.loss > 0:
            return replace(self.impairment, loss=0.0)
        return self.impairment

    # ------------------------------------------------------------------ loss, tbf
    def _apply_loss(self, loss: float) -> None:
        """Drop ``loss`` of the packets in both directions from now on (0: no rules)."""
        self._loss.set(self._must, loss)

    def _one_frame_per_packet(self) -> None:
        """tbf gets one frame per packet: a GSO packet queued under a fast slice's burst
        never leaves once a slower slice's smaller burst is set (``traces/tbf.py``
        ``STUCK_S``), so the server's veth builds none."""
        self._must(["ip", "-n", self.server_ns, "link", "set", "dev", self.server_dev,
                    "gso_max_segs", "1"])

    def loss_counters(self) -> dict[str, dict[str, int]]:
        """Per direction (``down``: server -> client, ``up``), the packets the loss rules saw
        and dropped since they were last installed; empty while no rules are installed."""
        return self._loss.counters()

    def _tbf_params(self, rate_bps: float, run_s: float) -> tuple[int, int, int]:
        return self.tbf.params(rate_bps, run_s)

    def _tc_tbf(
        self, verb: str, rate: int, burst: int, limit: int, *, handle: str | None = None
    ) -> list[str]:
        return tc_tbf(self.server_ns, self.server_dev, verb, rate, burst, limit,
                      handle or self._handle)

    def restart(self, start_s: float | None = None) -> None:
        """Start the trace again (a new run), on an empty bottleneck: what a previous run
        left queued in tbf (an abandoned transfer's bytes, e.g. behind an outage) is dropped
        (the qdisc is deleted and added again at the new start's setting), so it neither
        delays the new run's first packets nor takes its bandwidth."""
        if self._thread is None:
            super().restart(start_s)
            return
        with self._tc_lock:
            self.schedule.restart(start_s)
            now = time.monotonic()
            params = self._tbf_params(self._control_rate(now), self._control_run(now))
            # One atomic swap: a tbf under the other handle replaces the root (the old one
            # and its queue are destroyed in the same netlink request). A delete then an add
            # left the veth unshaped between the two tc calls.
            self._swap_locked(params, now)
        self._changed()

    def _swap_locked(self, params: tuple[int, int, int], now: float) -> None:
        """Replace the root tbf (and its queue) by a fresh one with ``params`` under the
        other handle, in one netlink request, and record it as applied at ``now`` (the
        caller holds ``_tc_lock``); a failed ``tc`` is a fault."""
        handle = "2:" if self._handle == "1:" else "1:"
        if not self._tc_took(self._tc_tbf("replace", *params, handle=handle), "replace"):
            return
        self._handle = handle
        self._last = params
        self.applied.append(TbfSetting(now, self._control_rate(now), *params))

    def _min_tbf_rate(self, t0: float, t1: float) -> float:
        """tbf's lowest rate (bit/s on the wire) from wall ``t0`` to ``t1``."""
        rates = []
        for a in reversed(list(self.applied)):
            if a.wall <= t1:
                rates.append(a.tbf_rate_bps)
            if a.wall <= t0:
                break
        return float(min(rates)) if rates else 0.0

    def _watch_loop(self) -> None:
        """Every :data:`traces.tbf.STUCK_S`: is tbf holding a backlog without sending
        (:func:`traces.tbf.tbf_stuck`)? Then it is a fault of the emulator (a run during
        it is taken again: ``edge/replay/links.py``), and a fresh tbf replaces the stuck
        one, as :meth:`restart` does (a stuck one recovered that way in the capture)."""
        before, t_before = {}, time.monotonic()
        while not self._stop.wait(STUCK_S):
            try:
                after, t_after = self.qdisc_stats(), time.monotonic()
            except (LinkError, subprocess.TimeoutExpired, OSError):
                continue  # the link is going away (stop) or tc is busy: next round
            why = tbf_stuck(before, after, self._min_tbf_rate(t_before, t_after),
                            t_after - t_before)
            if why:
                with self._tc_lock:
                    if self._last is not None:
                        self._swap_locked(self._last, time.monotonic())
                self._kick()
                self._fault(why)  # after the swap: whoever sees the fault sees a fresh tbf
                after, t_after = {}, time.monotonic()
            before, t_before = after, t_after

    def _apply(self, rate_bps: float, run_s: float) -> None:
        with self._tc_lock:
            self._apply_locked(rate_bps, run_s)

    def _apply_locked(self, rate_bps: float, run_s: float) -> None:
        params = self._tbf_params(rate_bps, run_s)
        if params == self._last:
            return
        t0 = time.monotonic()
        took = self._tc_took(self._tc_tbf("change", *params), "change")
        t1 = time.monotonic()
        if not took:
            return
        self._last = params
        self.apply_latency_s = 0.8 * self.apply_latency_s + 0.2 * (t1 - t0)
        self.applied.append(TbfSetting(t1, rate_bps, *params))
        self._kick()

    def _tc_took(self, args: list[str], verb: str) -> bool:
        """Run a tbf request; True when it took effect (a failed ``tc`` is a fault; None
        from :meth:`_tc`: nothing ran)."""
        res = self._tc(args)
        if res is None:
            return False
        if res.returncode != 0:
            self._fault(f"tc {verb} failed: {res.stderr.strip()}")
            return False
        return True

    def _fault(self, message: str) -> None:
        self._error = message
        self.faults += 1

    def _tc(self, cmd: list[str]) -> Any:
        """Run a ``tc`` command; a hung or unstartable one is a fault (None), never an
        exception: an exception ended the rate thread, and tbf then kept its last rate (an
        outage's 8 bit/s included) for every later run on the link, with nothing said."""
        try:
            return run_cmd(cmd)
        except (subprocess.TimeoutExpired, OSError) as exc:
            self._fault(f"{' '.join(cmd[:6])}: {exc}")
            return None

    def health(self) -> str:
        """Why the link cannot be trusted now ('' when it can): its rate thread or its
        delay stage's process has stopped."""
        if self._thread is not None and not self._thread.is_alive():
            return f"the tbf rate thread has stopped ({self._error or 'no error recorded'})"
        dead = [r.pid for r in self._relays if not r.alive]
        if dead:
            return f"the delay stage's process {dead[0]} has exited"
        return ""

    def _kick(self) -> None:
        """Make tbf dequeue now: ``tc change`` does not re-arm its watchdog, which may be
        set far ahead (e.g. during an outage); one 1-byte UDP datagram to the client side
        (inside our namespaces) runs the qdisc."""
        if self._kick_sock is None:
            return
        with contextlib.suppress(OSError):
            self._kick_sock.sendto(b"k", (self.client_addr, KICK_PORT))

    # Control grid: tbf follows the trace's slices, but slices shorter than min_slice_s
    # (Mahimahi's 100-ms bins) are averaged over cells of min_slice_s of trace time, since
    # each tc change lands within a few ms of its boundary.
    def _cell(self, seg: Segment) -> float | None:
        g = self.min_slice_s
        return g if g > 0 and float(seg.trace.widths_s.min()) < g else None

    def _control_rate(self, wall: float) -> float:
        """The rate tbf should have at ``wall`` (bits/s of goodput)."""
        seg = self.schedule.segment_at(wall)
        g = self._cell(seg)
        t = seg.trace_time(wall)
        if g is None:
            return float(seg.trace.rate_at(t))
        k = math.floor(t / g)
        return seg.trace.bits_between(k * g, (k + 1) * g) / g

    def _control_next(self, wall: float) -> float:
        """Wall time of the next control boundary after ``wall``."""
        seg = self.schedule.segment_at(wall)
        g = self._cell(seg)
        if g is None:
            return self.schedule.next_change(wall)
        t = seg.trace_time(wall)
        k = math.floor(t / g + 1e-9) + 1
        return seg.wall_start + (k * g - seg.trace_start)

    def _control_run(self, wall: float, horizon_s: float = 60.0) -> float:
        """Seconds from ``wall`` until the control rate next changes (inf beyond horizon)."""
        current = self._control_rate(wall)
        b = self._control_next(wall)
        while b - wall <= horizon_s:
            if self._control_rate(b + 1e-6) != current:
                return b - wall
            b = self._control_next(b + 1e-6)
        return math.inf

    def _apply_at(self, wall: float) -> None:
        """Apply the setting of the control slice containing ``wall``."""
        self._apply(self._control_rate(wall), self._control_run(wall))

    def _rate_loop(self) -> None:
        try:
            self._rate_loop_body()
        except Exception as exc:  # noqa: BLE001 - recorded: health() and faults say it
            self._fault(f"the tbf rate thread stopped: {exc!r}")

    def _rate_loop_body(self) -> None:
        sched = self.schedule
        self._apply_at(time.monotonic())
        while not self._stop.is_set():
            version = sched.version
            now = time.monotonic()
            boundary = self._control_next(now)
            before = self._control_rate(boundary - 1e-6)
            after = self._control_rate(boundary + 1e-6)
            # tc takes effect ~apply_latency after we call it: call it that much early.
            lead = min(self.apply_latency_s, 0.02)
            if before <= 0:
                # Leaving an outage: never early (a late start costs only latency x rate).
                lead = 0.0
            elif after <= 0:
                # Entering an outage: switch early (twice the tc latency plus the time of
                # the one frame the refill lets out), so nothing leaves during the outage.
                lead = 2 * lead + 0.002 + PACKET_BYTES * 8.0 / (before * self.tbf.overhead)
            with self._cond:
                changed = self._cond.wait_for(
                    lambda v=version: self._stop.is_set() or sched.version != v,
                    timeout=max(0.0, boundary - lead - time.monotonic()),
                )
            if self._stop.is_set():
                return
            if changed:
                self._apply_at(time.monotonic())
                continue
            while lead == 0.0 and time.monotonic() < boundary:
                time.sleep(boundary - time.monotonic())
            self._apply(after, self._control_run(boundary + 1e-6))
            # Do not re-handle this boundary if we are still before it.
            while time.monotonic() < boundary and not self._stop.is_set():
                time.sleep(max(0.0, min(boundary - time.monotonic(), 0.05)))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> KernelShapedLink:
        if self._thread is not None:
            return self
        reason = kernel_shaping_unavailable_reason()
        if reason is not None:
            raise NetnsUnavailableError(reason)
        try:
            self.create_pair()
            self._one_frame_per_packet()
            if self.real_loss and self.impairment.loss > 0:
                self._apply_loss(self.impairment.loss)
            if self._origin is None:
                self.schedule.restart(self._start_s)
            now = time.monotonic()
            rate = self._control_rate(now)
            params = self._tbf_params(rate, self._control_run(now))
            self._must(self._tc_tbf("add", *params))
            self._last = params
            self.applied.append(TbfSetting(now, rate, *params))
            try:
                self._kick_sock = socket_in_namespace(self.server_ns)
                self._kick_sock.setblocking(False)
            except LinkError as exc:
                self._error = f"no dequeue kick after rate changes: {exc}"
            self._stop.clear()
            self._thread = threading.Thread(target=self._rate_loop, name="tbf-rate", daemon=True)
            self._thread.start()
            self._watch = threading.Thread(target=self._watch_loop, name="tbf-watch",
                                           daemon=True)
            self._watch.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the rate thread, end processes started in the namespaces, delete them."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(5.0)
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.join(5.0)
        for relay in self._relays:
            with contextlib.suppress(LinkError):
                relay.stop()
        self._relays.clear()
        self.end_processes()
        if self._kick_sock is not None:
            self._kick_sock.close()
            self._kick_sock = None
        self._loss.remove()
        self.delete_pair()

    def __enter__(self) -> KernelShapedLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def set_impairment(self, impairment: Impairment) -> None:
        """Delay (new connections of the delay stage) and loss (the drop rules, at once)
        from now on."""
        if self.real_loss and self._thread is not None and impairment.loss != self._loss.applied:
            self._apply_loss(impairment.loss)
        self.impairment = impairment
        for relay in self._relays:
            relay.set_impairment(self._stage_impairment())

    def conditions(self) -> dict[str, Any]:
        """What a record states about this link (the delay counts only with a delay stage;
        modelled loss too, real loss always): ``loss_mechanism`` :data:`REAL_LOSS`,
        :data:`traces.impair.MODELLED_LOSS` or ``none``; ``rto_min_ms`` (None: the kernel's
        default); ``impairment``: what the delay stage adds."""
        staged = bool(self._relays)
        loss = self.impairment.loss
        mechanism = (NO_LOSS if loss <= 0 else REAL_LOSS if self.real_loss
                     else MODELLED_LOSS if staged else NO_LOSS)
        return {"emulator": "kernel", "process": "kernel tbf + relay process" if staged
                else "kernel tbf", "pids": [r.pid for r in self._relays],
                "cpus": sorted(set().union(*(r.cpus for r in self._relays))) if staged else [],
                "rtt_ms": self.impairment.rtt_ms if staged else 0.0,
                "loss": loss if mechanism != NO_LOSS else 0.0, "loss_mechanism": mechanism,
                "rto_min_ms": self.rto_min_ms,
                "impairment": self._stage_impairment().to_dict() if staged else None}

    @property
    def error(self) -> str:
        """Last error of the rate thread ('' if none)."""
        return self._error

    def qdisc_stats(self) -> dict[str, int]:
        """tbf counters on the server side: sent bytes/packets, drops, backlog bytes."""
        res = run_cmd(["tc", "-s", "-n", self.server_ns, "qdisc", "show", "dev", self.server_dev])
        return parse_qdisc_stats(res.stdout)
