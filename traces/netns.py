"""Kernel link shaping: two network namespaces joined by a veth pair, tbf re-rated live.

``KernelShapedLink`` creates a *server* and a *client* namespace (unique names with the
creating pid and a random suffix), joins them with a veth pair addressed from a random
private /30 that exists only inside those namespaces, and puts a ``tbf`` qdisc on the
server side's veth (so server -> client is shaped, client -> server is not). A thread
changes the tbf rate at every slice boundary of the trace; slices shorter than
``min_slice_s`` (default 0.25 s, e.g. Mahimahi's 100-ms bins) are averaged over cells of
that length, because each ``tc`` change lands within a few ms of its boundary (integrals
over whole cells are kept; an outage shorter than a cell becomes a lower rate). Only the
namespaces it created are touched; everything is deleted on exit, on errors and on
KeyboardInterrupt.

Rate changes and tbf: trace rates are goodput, tbf counts Ethernet frames, so tbf runs at
``rate x 1514/1448`` (full TCP segments with timestamps). ``tc qdisc change`` refills the
token bucket to ``burst`` and keeps queued packets, so the rate of each run of equal slices
is lowered by the refill it grants (``burst`` minus the half frame a backlogged bucket holds
on average, spread over the run). ``tc change`` does not re-arm tbf's watchdog, so after
every change one 1-byte UDP datagram is sent to the client side to make tbf dequeue at once.
An outage (rate 0) sets tbf to 8 bit/s with a one-frame burst: packets stay queued (nothing
is dropped) and nothing is delivered; the switch is made early by the tc latency and the
time of the one frame the refill lets out, so that frame belongs to the previous slice.

Between runs: each end has a permanent neighbour entry for the other (no ARP crosses tbf,
where a reply queued behind a backlog or an outage failed the neighbour and gave the next
connections "No route to host"), and :meth:`KernelShapedLink.restart` drops what an earlier
run left queued, so every run starts on an empty bottleneck.

Delay: this kernel has no ``netem``, so :meth:`KernelShapedLink.delay_stage` starts a relay
process inside the server namespace (a :class:`traces.linkproc.PacedLinkProcess` without a
bottleneck) that gives the server's bytes their one-way delay before they enter tbf, and
the client's bytes theirs before they reach the server. TCP over the veth itself keeps a
sub-millisecond round trip: the relay delays data, it does not lengthen TCP's ACK clock.

Loss is real (``loss`` > 0, the impairment's loss by default): the kernel has nf_tables with
``numgen``, so an nftables table :data:`LOSS_TABLE` in each namespace drops every IP packet
arriving on the veth with probability ``loss`` (``numgen random mod`` :data:`LOSS_MODULUS`):
server -> client in the client namespace, after tbf (a lost packet has used the bottleneck,
as on a radio link), client -> server in the server namespace. Drops are on the receiving
side because a drop in the sender's output hook is reported to the sending socket (TCP
would see a local error, not a lost packet). While loss is on, both veth ends carry one TCP
segment per packet (``gso_max_segs 1``), so each segment is lost on its own, not up to 45
in one GSO packet. TCP really retransmits (fast retransmit, tail-loss probes, timeouts);
the relay's loss model (:mod:`traces.impair`) is then off (the relay gets loss 0). With
``real_loss=False`` the relay models loss instead (the former behaviour). ``conditions()``
names the mechanism (``loss_mechanism``). The table goes when the link stops (the namespaces
are deleted as well).

TCP timers: a regime-matched replay scales rates and the round trip by ``T / T_phone`` (about
0.1 here), but the kernel's minimum retransmission timeout (:data:`KERNEL_RTO_MIN_MS`) is
not scaled, so an RTO would weigh ~10x what it weighs on the phone. ``rto_min_ms`` sets
``rto_min`` on the /30 routes of both namespaces (``ip route change ... rto_min Xms``,
whole ms; the kernel counts it in jiffies, 4 ms at HZ=250); :func:`scaled_rto_min_ms` gives
it scaled like the RTT. Not scaled: the 1-s initial RTO of a SYN (no RTT sample yet) and
the delayed-ACK timer.

Needs root, ``ip`` (iproute2) and ``tc`` with ``tbf`` (``netem`` is not required); loss needs
``nft`` (Debian package ``nftables``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import math
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sakura.traces.errors import LinkError, NetnsUnavailableError
from sakura.traces.impair import MODELLED_LOSS, NO_LOSS, Impairment
from sakura.traces.linkproc import PacedLinkProcess
from sakura.traces.model import Trace
from sakura.traces.schedule import LinkEmulator, LinkSchedule, Segment

PREFIX = "sakura"
PACKET_BYTES = 1514  # what tbf counts for a full-size Ethernet frame on veth
OUTAGE_RATE_BPS = 8  # tbf needs a non-zero rate; with a sub-packet burst nothing passes
_CLONE_NEWNET = 0x40000000
_KICK_PORT = 9  # discard: nothing listens; the kick only makes tbf dequeue
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-(srv|cli)$")
#: Linux TCP's minimum retransmission timeout (``TCP_RTO_MIN``), what a route without
#: ``rto_min`` gets, in ms
KERNEL_RTO_MIN_MS = 200.0
#: the largest ``rto_min_ms`` accepted: Linux TCP's maximum RTO (``TCP_RTO_MAX``, 120 s)
MAX_RTO_MIN_MS = 120_000.0
#: nftables table (family ``inet``) holding a namespace's loss rules
LOSS_TABLE = "sakura_loss"
#: ``numgen random mod LOSS_MODULUS < round(loss x LOSS_MODULUS)``: loss in steps of 1e-6
LOSS_MODULUS = 1_000_000
#: ``loss_mechanism`` of a kernel link whose loss is real
REAL_LOSS = "nftables numgen random drop, both directions"
#: veth ``gso_max_segs`` while loss is on (one segment per packet) and the kernel's default
LOSS_GSO_MAX_SEGS = 1
DEFAULT_GSO_MAX_SEGS = 65535


def _run(cmd: Sequence[str], timeout: float = 10.0,
         input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          check=False, input=input)


def scaled_rto_min_ms(rtt_scale: float) -> float:
    """The minimum RTO that scales like the link's round trip: :data:`KERNEL_RTO_MIN_MS` x
    ``rtt_scale``, the factor the RTT got (``link_rtt_ms / rtt_ms``; ``T / T_phone`` in a
    regime-matched replay, ``edge.netem.matched_rtt_ms``)."""
    if not (isinstance(rtt_scale, (int, float)) and math.isfinite(rtt_scale) and rtt_scale > 0):
        raise LinkError(f"rtt_scale must be a finite number > 0, got {rtt_scale!r}")
    return KERNEL_RTO_MIN_MS * float(rtt_scale)


def _check_loss(loss: float) -> float:
    if not (isinstance(loss, (int, float)) and math.isfinite(loss) and 0 <= loss < 0.5):
        raise LinkError(f"loss must be a rate in [0, 0.5), got {loss!r}")
    return float(loss)


def _check_rto_min(rto_min_ms: float | None) -> int | None:
    """Whole ms for the routes (at least 1), or None: the kernel default."""
    if rto_min_ms is None:
        return None
    ok = isinstance(rto_min_ms, (int, float)) and math.isfinite(rto_min_ms)
    if not (ok and 0 < rto_min_ms <= MAX_RTO_MIN_MS):
        raise LinkError(f"rto_min_ms must be a number of ms in (0, {MAX_RTO_MIN_MS:g}] (None: "
                        f"the kernel's {KERNEL_RTO_MIN_MS:g} ms), got {rto_min_ms!r}")
    return max(1, int(round(rto_min_ms)))


def kernel_shaping_unavailable_reason() -> str | None:
    """Why kernel shaping cannot run here (None when it can). Creates and removes a probe."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "kernel shaping needs Linux"
    if os.geteuid() != 0:
        return "kernel shaping needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"kernel shaping needs the '{tool}' command (iproute2)"
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-srv"
    try:
        res = _run(["ip", "netns", "add", name])
        if res.returncode != 0:
            return f"'ip netns add' failed: {res.stderr.strip() or res.returncode}"
        dev = f"skp{secrets.token_hex(3)}"
        res = _run(
            ["ip", "-n", name, "link", "add", dev, "type", "veth", "peer", "name", dev + "b"]
        )
        if res.returncode != 0:
            return f"cannot create a veth pair in a namespace: {res.stderr.strip()}"
        res = _run(
            ["tc", "-n", name, "qdisc", "add", "dev", dev, "root", "tbf", "rate", "1mbit",
             "burst", "4k", "limit", "64k"]
        )  # fmt: skip
        if res.returncode != 0:
            return f"tc tbf is not available: {res.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run ip/tc: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _run(["ip", "netns", "del", name])
    return None


def real_loss_unavailable_reason() -> str | None:
    """Why the kernel link cannot drop packets here (None when it can): kernel shaping,
    ``nft`` and an nftables ``numgen`` rule in a probe namespace."""
    reason = kernel_shaping_unavailable_reason()
    if reason is not None:
        return reason
    if shutil.which("nft") is None:
        return "real loss needs the 'nft' command (Debian package nftables)"
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-srv"
    try:
        res = _run(["ip", "netns", "add", name])
        if res.returncode != 0:
            return f"'ip netns add' failed: {res.stderr.strip() or res.returncode}"
        res = _run(["ip", "netns", "exec", name, "nft", "-f", "-"],
                   input=_loss_rules("lo", 0.01, "probe"))
        if res.returncode != 0:
            return f"nftables numgen drop rules are not available: {res.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run ip/nft: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _run(["ip", "netns", "del", name])
    return None


def _loss_rules(dev: str, loss: float, direction: str) -> str:
    """One nft transaction: (re)create :data:`LOSS_TABLE` with an input chain that counts
    the IP packets arriving on ``dev`` and drops each with probability ``loss``."""
    threshold = int(round(loss * LOSS_MODULUS))
    return (
        f"add table inet {LOSS_TABLE}\n"
        f"flush table inet {LOSS_TABLE}\n"
        f"add chain inet {LOSS_TABLE} input {{ type filter hook input priority filter; "
        "policy accept; }\n"
        f'add rule inet {LOSS_TABLE} input iifname "{dev}" counter comment "{direction} seen"\n'
        f'add rule inet {LOSS_TABLE} input iifname "{dev}" numgen random mod {LOSS_MODULUS} '
        f'< {threshold} counter drop comment "{direction} dropped"\n'
    )


def socket_in_namespace(
    ns: str, family: int = socket.AF_INET, kind: int = socket.SOCK_DGRAM
) -> socket.socket:
    """A socket created inside named network namespace ``ns`` (usable from any thread).

    ``setns(2)`` is called on a short-lived helper thread, so the caller's own namespace
    never changes.
    """
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            finally:
                os.close(fd)
            result["sock"] = socket.socket(family, kind)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            result["error"] = exc

    helper = threading.Thread(target=work, name="setns-helper", daemon=True)
    helper.start()
    helper.join(5.0)
    if "sock" not in result:
        raise LinkError(f"cannot open a socket in namespace {ns}: {result.get('error')}")
    return result["sock"]


def cleanup_stale_namespaces() -> list[str]:
    """Delete ``sakura-<pid>-...`` namespaces whose creating process no longer exists."""
    res = _run(["ip", "netns", "list"])
    removed = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        if _run(["ip", "netns", "del", name]).returncode == 0:
            removed.append(name)
    return removed


@dataclass(frozen=True)
class TbfSetting:
    """One tbf configuration as applied at a wall time."""

    wall: float
    rate_bps: float
    tbf_rate_bps: int
    burst_bytes: int
    limit_bytes: int


class KernelShapedLink(LinkEmulator):
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
        self.impairment = imp if loss is None else replace(imp, loss=_check_loss(loss))
        #: True: loss is dropped for real (nftables); False: the delay stage models it
        self.real_loss = bool(real_loss)
        #: ``rto_min`` of the namespaces' routes, whole ms (None: the kernel default)
        self.rto_min_ms = _check_rto_min(rto_min_ms)
        self._loss_applied = 0.0  # the loss the nft rules drop now (0: no rules)
        self._relays: list[Any] = []
        self.burst_s = float(burst_s)
        self.queue_s = float(queue_s)
        self.min_queue_bytes = int(min_queue_bytes)
        self.compensate_burst = compensate_burst
        self.overhead = float(overhead)
        self.min_burst_bytes = int(max(PACKET_BYTES, min_burst_bytes))
        self.min_slice_s = float(min_slice_s)
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.server_ns = f"{PREFIX}-{tag}-srv"
        self.client_ns = f"{PREFIX}-{tag}-cli"
        dev = secrets.token_hex(3)
        self.server_dev = f"sk{dev}s"
        self.client_dev = f"sk{dev}c"
        net = ipaddress.IPv4Network(
            (
                f"10.{64 + secrets.randbelow(64)}.{secrets.randbelow(256)}."
                f"{4 * secrets.randbelow(64)}",
                30,
            )
        )
        hosts = list(net.hosts())
        self.network = net
        self.server_addr = str(hosts[0])
        self.client_addr = str(hosts[1])
        self.applied: list[TbfSetting] = []
        self.apply_latency_s = 0.003
        self._handle = "1:"  # the root tbf's handle; restart() swaps it for the other one
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._tc_lock = threading.Lock()  # one tc command on the qdisc at a time
        self._error: str = ""
        self._last: tuple[int, int, int] | None = None
        self._kick_sock: socket.socket | None = None

    # ------------------------------------------------------------------ helpers
    def _ns(self, which: str) -> str:
        if which in ("server", "srv", self.server_ns):
            return self.server_ns
        if which in ("client", "cli", self.client_ns):
            return self.client_ns
        raise LinkError(f"unknown namespace {which!r}: use 'server' or 'client'")

    def _must(self, cmd: Sequence[str], input: str | None = None) -> None:
        res = _run(cmd, input=input)
        if res.returncode != 0:
            msg = res.stderr.strip() or f"exit status {res.returncode}"
            if "Operation not permitted" in msg or "Permission denied" in msg:
                raise NetnsUnavailableError(f"kernel shaping not permitted: {' '.join(cmd)}: {msg}")
            raise LinkError(f"kernel shaping setup failed: {' '.join(cmd)}: {msg}")

    def run_in(
        self, ns: str, cmd: Sequence[str], timeout: float | None = 60.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside the ``"server"`` or ``"client"`` namespace and wait for it."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(
            ["ip", "netns", "exec", self._ns(ns), *cmd], timeout=timeout, check=False, **kwargs
        )

    def popen_in(self, ns: str, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside a namespace; it is terminated when the link stops."""
        proc = subprocess.Popen(["ip", "netns", "exec", self._ns(ns), *cmd], **kwargs)
        self._procs.append(proc)
        return proc

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

    # ------------------------------------------------------------------ loss, timers
    def _loss_legs(self) -> tuple[tuple[str, str, str], ...]:
        """(namespace, receiving veth end, direction) of each direction's drop rules."""
        return ((self.client_ns, self.client_dev, "down"),
                (self.server_ns, self.server_dev, "up"))

    def _apply_loss(self, loss: float) -> None:
        """Drop ``loss`` of the packets in both directions from now on (0: no rules)."""
        if loss > 0 and shutil.which("nft") is None:
            raise LinkError("real loss on the kernel link needs the 'nft' command (Debian "
                            "package nftables); or real_loss=False to model it in the relay")
        was = self._loss_applied
        if loss > 0:
            self._loss_applied = loss  # first, so that stop() removes a half-made setup
        segs = LOSS_GSO_MAX_SEGS if loss > 0 else DEFAULT_GSO_MAX_SEGS
        for ns, dev, direction in self._loss_legs():
            if loss > 0:
                self._must(["ip", "netns", "exec", ns, "nft", "-f", "-"],
                           input=_loss_rules(dev, loss, direction))
            elif was > 0:
                self._must(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet",
                            LOSS_TABLE])
            if (loss > 0) != (was > 0):
                self._must(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_segs",
                            str(segs)])
        self._loss_applied = loss

    def _apply_rto_min(self, rto_min_ms: int | None) -> None:
        """Set (or with None clear) ``rto_min`` on the /30 route of both namespaces."""
        extra = [] if rto_min_ms is None else ["rto_min", f"{rto_min_ms}ms"]
        for ns, dev, addr in ((self.server_ns, self.server_dev, self.server_addr),
                              (self.client_ns, self.client_dev, self.client_addr)):
            self._must(["ip", "-n", ns, "route", "change", str(self.network), "dev", dev,
                        "proto", "kernel", "scope", "link", "src", addr, *extra])

    def set_rto_min_ms(self, rto_min_ms: float | None) -> None:
        """``rto_min`` of both namespaces' routes from now on (None: the kernel default)."""
        value = _check_rto_min(rto_min_ms)
        if self._created and value != self.rto_min_ms:
            self._apply_rto_min(value)
        self.rto_min_ms = value

    def loss_counters(self) -> dict[str, dict[str, int]]:
        """Per direction (``down``: server -> client, ``up``), the packets the loss rules saw
        and dropped since they were last installed; empty while no rules are installed."""
        import json

        out: dict[str, dict[str, int]] = {}
        if self._loss_applied <= 0:
            return out
        for ns, _dev, direction in self._loss_legs():
            res = _run(["ip", "netns", "exec", ns, "nft", "-j", "list", "table", "inet",
                        LOSS_TABLE])
            if res.returncode != 0:
                raise LinkError(f"cannot read the loss counters in {ns}: {res.stderr.strip()}")
            counts = {"packets": 0, "dropped": 0}
            for item in json.loads(res.stdout).get("nftables", []):
                rule = item.get("rule")
                if not rule:
                    continue
                counter = next((e["counter"] for e in rule.get("expr", []) if "counter" in e),
                               None)
                if counter is not None:
                    key = "dropped" if rule.get("comment", "").endswith("dropped") else "packets"
                    counts[key] = int(counter["packets"])
            out[direction] = counts
        return out

    # ------------------------------------------------------------------ tbf
    def _tbf_params(self, rate_bps: float, run_s: float) -> tuple[int, int, int]:
        """(tbf rate bit/s, burst bytes, queue limit bytes) for ``rate_bps`` of goodput held
        for ``run_s`` seconds (until the rate next changes)."""
        if rate_bps <= 0:
            # Burst of exactly one frame: the refill on change lets at most that frame out,
            # and the switch is made early enough for it to belong to the previous slice.
            return OUTAGE_RATE_BPS, PACKET_BYTES, self._limit(0.0)
        wire = rate_bps * self.overhead
        burst = int(max(self.min_burst_bytes, wire * self.burst_s / 8.0))
        tbf_rate = wire
        if self.compensate_burst and math.isfinite(run_s) and run_s > 0:
            # The refill adds the burst minus what the bucket already held (on average
            # half a frame when backlogged).
            extra = burst - PACKET_BYTES / 2
            tbf_rate = max(wire - 8.0 * extra / run_s, wire * 0.5)
        return max(OUTAGE_RATE_BPS, int(round(tbf_rate))), burst, self._limit(wire)

    def _limit(self, wire_bps: float) -> int:
        return int(max(self.min_queue_bytes, wire_bps * self.queue_s / 8.0))

    def _tc_tbf(
        self, verb: str, rate: int, burst: int, limit: int, *, handle: str | None = None
    ) -> list[str]:
        return [
            "tc", "-n", self.server_ns, "qdisc", verb, "dev", self.server_dev, "root",
            "handle", handle or self._handle, "tbf", "rate", f"{rate}bit", "burst", str(burst),
            "limit", str(limit),
        ]  # fmt: skip

    def _static_neighbours(self) -> None:
        """Each end knows the other's MAC for good (``nud permanent``): ARP would otherwise
        cross tbf, and a reply queued behind a backlog (or an outage's 8 bit/s) failed the
        neighbour entry, so the next connections got EHOSTUNREACH ("No route to host";
        seen in a replay after an FP16 run gave up inside an outage, and every run after it
        failed). A phone's radio link has no ARP on its bottleneck."""
        macs = {}
        for ns, dev in ((self.server_ns, self.server_dev), (self.client_ns, self.client_dev)):
            res = _run(["ip", "-n", ns, "-o", "link", "show", "dev", dev])
            m = re.search(r"link/ether ([0-9a-f:]{17})", res.stdout)
            if res.returncode != 0 or m is None:
                raise LinkError(f"cannot read the MAC of {dev} in {ns}: {res.stderr.strip()}")
            macs[ns] = m.group(1)
        for ns, dev, peer, peer_ns in (
            (self.server_ns, self.server_dev, self.client_addr, self.client_ns),
            (self.client_ns, self.client_dev, self.server_addr, self.server_ns),
        ):
            self._must(["ip", "-n", ns, "neigh", "replace", str(peer), "lladdr", macs[peer_ns],
                        "dev", dev, "nud", "permanent"])

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
            handle = "2:" if self._handle == "1:" else "1:"
            res = _run(self._tc_tbf("replace", *params, handle=handle))
            if res.returncode != 0:
                self._error = f"tc replace failed: {res.stderr.strip()}"
            else:
                self._handle = handle
                self._last = params
                self.applied.append(TbfSetting(now, self._control_rate(now), *params))
        self._changed()

    def _apply(self, rate_bps: float, run_s: float) -> None:
        with self._tc_lock:
            self._apply_locked(rate_bps, run_s)

    def _apply_locked(self, rate_bps: float, run_s: float) -> None:
        params = self._tbf_params(rate_bps, run_s)
        if params == self._last:
            return
        t0 = time.monotonic()
        res = _run(self._tc_tbf("change", *params))
        t1 = time.monotonic()
        if res.returncode != 0:
            self._error = f"tc change failed: {res.stderr.strip()}"
            return
        self._last = params
        self.apply_latency_s = 0.8 * self.apply_latency_s + 0.2 * (t1 - t0)
        self.applied.append(TbfSetting(t1, rate_bps, *params))
        self._kick()

    def _kick(self) -> None:
        """Make tbf dequeue now: ``tc change`` does not re-arm its watchdog, which may be
        set far ahead (e.g. during an outage); one 1-byte UDP datagram to the client side
        (inside our namespaces) runs the qdisc."""
        if self._kick_sock is None:
            return
        with contextlib.suppress(OSError):
            self._kick_sock.sendto(b"k", (self.client_addr, _KICK_PORT))

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
                lead = 2 * lead + 0.002 + PACKET_BYTES * 8.0 / (before * self.overhead)
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
            for ns in (self.server_ns, self.client_ns):
                self._must(["ip", "netns", "add", ns])
                self._created.append(ns)
            self._must(
                ["ip", "-n", self.server_ns, "link", "add", self.server_dev, "type", "veth",
                 "peer", "name", self.client_dev, "netns", self.client_ns]
            )  # fmt: skip
            for ns, dev, addr in (
                (self.server_ns, self.server_dev, self.server_addr),
                (self.client_ns, self.client_dev, self.client_addr),
            ):
                self._must(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev])
                self._must(["ip", "-n", ns, "link", "set", dev, "up"])
                self._must(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._static_neighbours()
            if self.rto_min_ms is not None:
                self._apply_rto_min(self.rto_min_ms)
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
        for relay in self._relays:
            with contextlib.suppress(LinkError):
                relay.stop()
        self._relays.clear()
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(2.0)
        self._procs.clear()
        if self._kick_sock is not None:
            self._kick_sock.close()
            self._kick_sock = None
        for ns, _dev, _direction in self._loss_legs() if self._loss_applied > 0 else ():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", LOSS_TABLE])
        self._loss_applied = 0.0
        for ns in reversed(self._created):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _run(["ip", "netns", "del", ns])
        self._created.clear()

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
        if self.real_loss and self._thread is not None and impairment.loss != self._loss_applied:
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
        res = _run(["tc", "-s", "-n", self.server_ns, "qdisc", "show", "dev", self.server_dev])
        text = res.stdout
        out: dict[str, int] = {}
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", text)
        if m:
            out.update(
                sent_bytes=int(m.group(1)), sent_packets=int(m.group(2)), dropped=int(m.group(3))
            )
        # tc prints a size that is (nearly) a whole number of KiB or MiB as "80Kb" / "1Mb"
        m = re.search(r"backlog (\d+)([KM]?)b", text)
        if m:
            out["backlog_bytes"] = int(m.group(1)) * {"": 1, "K": 1024, "M": 1 << 20}[m.group(2)]
        return out
