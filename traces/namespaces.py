"""Two network namespaces joined by a veth pair: what the kernel link is built in.

:class:`NamespacePair` names a *server* and a *client* namespace (unique names with the
creating pid and a random suffix), and on :meth:`NamespacePair.create_pair` creates them and
joins them with a veth pair addressed from a random private /30 that exists only inside
those namespaces. Only the namespaces it created are touched (:meth:`delete_pair`); stale
ones of dead processes go with :func:`cleanup_stale_namespaces`. Commands and sockets run
inside either namespace (:meth:`run_in`, :meth:`popen_in`, :func:`socket_in_namespace`).

Between runs: each end has a permanent neighbour entry for the other (no ARP crosses tbf,
where a reply queued behind a backlog or an outage failed the neighbour and gave the next
connections "No route to host").

TCP timers: a regime-matched replay scales rates and the round trip by ``T / T_phone`` (about
0.1 here), but the kernel's minimum retransmission timeout (:data:`KERNEL_RTO_MIN_MS`) is
not scaled, so an RTO would weigh ~10x what it weighs on the phone. ``rto_min_ms`` sets
``rto_min`` on the /30 routes of both namespaces (``ip route change ... rto_min Xms``,
whole ms; the kernel counts it in jiffies, 4 ms at HZ=250); :func:`scaled_rto_min_ms` gives
it scaled like the RTT. Not scaled: the 1-s initial RTO of a SYN (no RTT sample yet) and
the delayed-ACK timer.

Needs root and ``ip`` (iproute2); :func:`kernel_shaping_unavailable_reason` also probes
``tc`` with ``tbf`` (``netem`` is not required).
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
from collections.abc import Sequence
from typing import Any

from sakura.traces.errors import LinkError, NetnsUnavailableError

PREFIX = "sakura"
_CLONE_NEWNET = 0x40000000
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-(srv|cli)$")
#: Linux TCP's minimum retransmission timeout (``TCP_RTO_MIN``), what a route without
#: ``rto_min`` gets, in ms
KERNEL_RTO_MIN_MS = 200.0
#: the largest ``rto_min_ms`` accepted: Linux TCP's maximum RTO (``TCP_RTO_MAX``, 120 s)
MAX_RTO_MIN_MS = 120_000.0


def run_cmd(cmd: Sequence[str], timeout: float = 10.0,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command, capture its output as text, never raise on its exit status."""
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          check=False, input=input)



def scaled_rto_min_ms(rtt_scale: float) -> float:
    """The minimum RTO that scales like the link's round trip: :data:`KERNEL_RTO_MIN_MS` x
    ``rtt_scale``, the factor the RTT got (``link_rtt_ms / rtt_ms``; ``T / T_phone`` in a
    regime-matched replay, ``edge.netem.matched_rtt_ms``)."""
    if not (isinstance(rtt_scale, (int, float)) and math.isfinite(rtt_scale) and rtt_scale > 0):
        raise LinkError(f"rtt_scale must be a finite number > 0, got {rtt_scale!r}")
    return KERNEL_RTO_MIN_MS * float(rtt_scale)


def check_rto_min(rto_min_ms: float | None) -> int | None:
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
        res = run_cmd(["ip", "netns", "add", name])
        if res.returncode != 0:
            return f"'ip netns add' failed: {res.stderr.strip() or res.returncode}"
        dev = f"skp{secrets.token_hex(3)}"
        res = run_cmd(
            ["ip", "-n", name, "link", "add", dev, "type", "veth", "peer", "name", dev + "b"]
        )
        if res.returncode != 0:
            return f"cannot create a veth pair in a namespace: {res.stderr.strip()}"
        res = run_cmd(
            ["tc", "-n", name, "qdisc", "add", "dev", dev, "root", "tbf", "rate", "1mbit",
             "burst", "4k", "limit", "64k"]
        )  # fmt: skip
        if res.returncode != 0:
            return f"tc tbf is not available: {res.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run ip/tc: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            run_cmd(["ip", "netns", "del", name])
    return None


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
    res = run_cmd(["ip", "netns", "list"])
    removed = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        if run_cmd(["ip", "netns", "del", name]).returncode == 0:
            removed.append(name)
    return removed


class NamespacePair:
    """A server and a client namespace joined by a veth pair (names and addresses chosen
    at construction; nothing exists before :meth:`create_pair`). ``rto_min_ms``: the routes'
    ``rto_min`` in both namespaces (None: the kernel's :data:`KERNEL_RTO_MIN_MS`)."""

    def __init__(self, rto_min_ms: float | None = None) -> None:
        #: ``rto_min`` of the namespaces' routes, whole ms (None: the kernel default)
        self.rto_min_ms = check_rto_min(rto_min_ms)
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
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []

    def _ns(self, which: str) -> str:
        if which in ("server", "srv", self.server_ns):
            return self.server_ns
        if which in ("client", "cli", self.client_ns):
            return self.client_ns
        raise LinkError(f"unknown namespace {which!r}: use 'server' or 'client'")

    def _must(self, cmd: Sequence[str], input: str | None = None) -> None:
        res = run_cmd(cmd, input=input)
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

    def create_pair(self) -> None:
        """Create both namespaces, the veth pair between them, its addresses, the permanent
        neighbour entries and (when set) the routes' ``rto_min``."""
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

    def end_processes(self) -> None:
        """Terminate (then kill) the processes started with :meth:`popen_in`."""
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

    def delete_pair(self) -> None:
        """Delete the namespaces this pair created (the veth goes with them)."""
        for ns in reversed(self._created):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                run_cmd(["ip", "netns", "del", ns])
        self._created.clear()

    def _static_neighbours(self) -> None:
        """Each end knows the other's MAC for good (``nud permanent``): ARP would otherwise
        cross tbf, and a reply queued behind a backlog (or an outage's 8 bit/s) failed the
        neighbour entry, so the next connections got EHOSTUNREACH ("No route to host";
        seen in a replay after an FP16 run gave up inside an outage, and every run after it
        failed). A phone's radio link has no ARP on its bottleneck."""
        macs = {}
        for ns, dev in ((self.server_ns, self.server_dev), (self.client_ns, self.client_dev)):
            res = run_cmd(["ip", "-n", ns, "-o", "link", "show", "dev", dev])
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

    def _apply_rto_min(self, rto_min_ms: int | None) -> None:
        """Set (or with None clear) ``rto_min`` on the /30 route of both namespaces."""
        extra = [] if rto_min_ms is None else ["rto_min", f"{rto_min_ms}ms"]
        for ns, dev, addr in ((self.server_ns, self.server_dev, self.server_addr),
                              (self.client_ns, self.client_dev, self.client_addr)):
            self._must(["ip", "-n", ns, "route", "change", str(self.network), "dev", dev,
                        "proto", "kernel", "scope", "link", "src", addr, *extra])

    def set_rto_min_ms(self, rto_min_ms: float | None) -> None:
        """``rto_min`` of both namespaces' routes from now on (None: the kernel default)."""
        value = check_rto_min(rto_min_ms)
        if self._created and value != self.rto_min_ms:
            self._apply_rto_min(value)
        self.rto_min_ms = value
