"""The replay's network paths: per packs folder a ``sakura serve`` process and the emulated
link in front of it (the paced proxy, or the kernel link with a second server inside its
server namespace), the round trip and loss they carry, and the device's side of them
(entering the client namespace).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sakura.edge.errors import EdgeError
from sakura.edge.netem import matched_rtt_ms
from sakura.edge.replay.config import ReplayConfig
from sakura.edge.server_process import ServerProcess
from sakura.traces import Trace
from sakura.traces.errors import LinkError
from sakura.traces.impair import Impairment
from sakura.traces.linkproc import PacedLinkProcess, pin, split_cpus
from sakura.traces.namespaces import (
    kernel_shaping_unavailable_reason,
    scaled_rto_min_ms,
    socket_in_namespace,
)
from sakura.traces.netns import KernelShapedLink


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the body with this thread in network namespace ``name`` (threads it starts,
    such as the runtime's network loop, are created there too); then switch back."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise LinkError(f"cannot enter network namespace {name}: {os.strerror(err)}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(own, _CLONE_NEWNET) != 0:  # pragma: no cover - kernel refused
                raise LinkError("cannot return to the original network namespace")
    finally:
        os.close(own)


_CLONE_NEWNET = 0x40000000
KERNEL_PORT = 8000


def _healthy_in(ns: str, host: str, port: int) -> bool:
    """GET /healthz from inside namespace ``ns``."""
    import socket

    try:
        sock = socket_in_namespace(ns, socket.AF_INET, socket.SOCK_STREAM)
    except Exception:  # noqa: BLE001 - not up yet
        return False
    try:
        sock.settimeout(1.0)
        sock.connect((host, port))
        sock.sendall(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
        return b" 200 " in sock.recv(64)
    except OSError:
        return False
    finally:
        sock.close()


class Links:
    """Per packs folder: a ``sakura serve`` process on 127.0.0.1 (direct, untimed use) and
    an emulated link for the timed runs: the paced proxy in its own process in front of it,
    or (``kernel``) a second server inside the server namespace of a
    :class:`KernelShapedLink`, reached from its client namespace through a delay stage.
    Both links carry the config's round trip (``rtt_ms``) and ``loss``. With ``pin_cpus``
    on a machine with 2+ cores, the device (this process) runs on all cores but the last
    and every server and link process on the last (:func:`traces.linkproc.split_cpus`)."""

    def __init__(self, cfg: ReplayConfig, packs: Path, variants: list[str], log: Callable[[str], None]) -> None:
        self.cfg, self.packs, self.variants, self.log = cfg, packs, variants, log
        self.kind = cfg.link
        self.impairment = Impairment(rtt_ms=cfg.rtt_ms, loss=cfg.loss, seed=cfg.seed)
        split = split_cpus() if cfg.pin_cpus else None
        self.device_cpus, self.network_cpus = split if split else (None, None)
        self._own_affinity: set[int] | None = None
        self._rtt_applied: float | None = self.impairment.rtt_ms
        self.servers: dict[str, Any] = {}
        self.links: dict[str, Any] = {}
        self.urls: dict[str, str] = {}
        self.note = ""

    def __enter__(self) -> Links:
        if self.kind == "kernel":
            reason = kernel_shaping_unavailable_reason()
            if reason is not None:
                self.note = f"kernel shaping unavailable: {reason}"
                self.log(f"WARNING: --link kernel: {self.note}; falling back to the paced link")
                self.kind = "paced"
        try:
            if self.device_cpus:
                self._own_affinity = set(os.sched_getaffinity(0))
                pin(0, self.device_cpus)
            for v in self.variants:
                self.servers[v] = ServerProcess(self.packs / v).start()
                if self.network_cpus and self.servers[v].proc is not None:
                    pin(self.servers[v].proc.pid, self.network_cpus)
                if self.kind == "kernel":
                    self._kernel(v)
                else:
                    self._paced(v)
        except BaseException:
            self.__exit__()
            raise
        return self

    def conditions(self) -> dict[str, Any]:
        """What every record states about the network path and the CPUs (``rtt_ms``: the
        network's round trip; the link's, after ``rtt_scale``, is ``link_rtt_ms``)."""
        return {"link": self.kind, "rtt_ms": self.impairment.rtt_ms,
                "rtt_scale": self.cfg.rtt_scale, "loss": self.impairment.loss,
                "cpus": {"device": sorted(self.device_cpus or []),
                         "network": sorted(self.network_cpus or [])}}

    def set_rtt(self, rtt_ms: float) -> None:
        """Every link carries this round trip from now on (new connections); a kernel link's
        minimum RTO is scaled by the same factor (``traces.namespaces.scaled_rto_min_ms``),
        unless the configuration keeps the kernel's (``rto_min: kernel``)."""
        from dataclasses import replace

        if self._rtt_applied == rtt_ms:
            return
        imp = replace(self.impairment, rtt_ms=float(rtt_ms))
        scale = rtt_ms / self.impairment.rtt_ms if self.impairment.rtt_ms > 0 else 1.0
        for link in self.links.values():
            if hasattr(link, "set_impairment"):
                link.set_impairment(imp)
            if hasattr(link, "set_rto_min_ms"):
                link.set_rto_min_ms(None if scale == 1.0 or rtt_ms <= 0
                                    or self.cfg.rto_min == "kernel"
                                    else scaled_rto_min_ms(scale))
        self._rtt_applied = rtt_ms

    def link_conditions(self, variant: str) -> dict[str, Any]:
        """How the variant's link realises loss (``loss_mechanism``) and, on the kernel link,
        its routes' ``rto_min_ms`` (None: the kernel's 200 ms)."""
        c = self.links[variant].conditions()
        return {k: c[k] for k in ("loss_mechanism", "rto_min_ms") if k in c}

    def _paced(self, v: str) -> None:
        link = PacedLinkProcess(Trace.constant(1e9, 1.0),
                                upstream=("127.0.0.1", self.servers[v].port),
                                impairment=self.impairment, cpus=self.network_cpus)
        link.start()
        self.links[v] = link
        self.urls[v] = f"http://127.0.0.1:{link.port}"

    def _kernel(self, v: str) -> None:
        import subprocess

        link = KernelShapedLink(Trace.constant(1e9, 1.0), impairment=self.impairment).start()
        self.links[v] = link
        staged = self.impairment.active
        # with a delay stage the server listens on loopback inside the namespace and the
        # relay (in front of tbf) on the namespace's address
        host, port = ("127.0.0.1", KERNEL_PORT + 1) if staged else (link.server_addr,
                                                                    KERNEL_PORT)
        proc = link.popen_in("server", [
            sys.executable, "-m", "sakura.cli", "serve", str(self.packs / v), "--host",
            host, "--port", str(port), "--log-level", "warning",
            "--no-access-log"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.network_cpus:
            pin(proc.pid, self.network_cpus)
        if staged:
            link.delay_stage(port, KERNEL_PORT, cpus=self.network_cpus)
        deadline = time.monotonic() + 60
        while not _healthy_in(link.client_ns, link.server_addr, KERNEL_PORT):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise EdgeError("sakura serve did not come up inside the server namespace")
            time.sleep(0.2)
        self.urls[v] = f"http://{link.server_addr}:{KERNEL_PORT}"

    def __exit__(self, *exc: object) -> None:
        for link in self.links.values():
            link.stop()
        for server in self.servers.values():
            server.stop()
        self.links.clear()
        self.servers.clear()
        if self._own_affinity is not None:
            pin(0, self._own_affinity)
            self._own_affinity = None

    def direct(self, variant: str) -> str:
        return self.servers[variant].url

    def shaped(self, variant: str, trace: Any, start_s: float) -> str:
        """Point the variant's link at ``trace`` from ``start_s`` now; its URL."""
        link = self.links[variant]
        link.set_trace(trace, start_s)
        link.restart(start_s)
        return self.urls[variant]

    @contextlib.contextmanager
    def watched(self, variant: str) -> Iterator[None]:
        """Around one timed run: a fault of the emulator during it (a ``tc`` change that
        failed or hung, the rate thread or a link process gone) raises :class:`LinkError`
        naming it, from the run's own error if it had one. Such a run measured the emulator,
        not the policy: the replay records it as a failure, and a rerun takes it again."""
        link = self.links[variant]
        before = link.faults
        try:
            yield
        except Exception as exc:
            why = self._link_fault(link, before)
            if why:
                raise LinkError(f"the emulated link failed during this run: {why}") from exc
            raise
        why = self._link_fault(link, before)
        if why:
            raise LinkError(f"the emulated link failed during this run: {why}")

    @staticmethod
    def _link_fault(link: Any, faults_before: int) -> str:
        """Both links: ``health()`` (a stopped thread or process) and the count of faults."""
        return link.health() or (link.error or "a fault of the link"
                                 if link.faults > faults_before else "")

    def client(self, variant: str) -> contextlib.AbstractContextManager[None]:
        """Where the device's sockets must be created for the shaped URL."""
        if self.kind == "kernel":
            return in_netns(self.links[variant].client_ns)
        return contextlib.nullcontext()


def link_rtt_ms(cfg: ReplayConfig, t: dict[str, Any]) -> float:
    """The round trip the link carries for template record ``t``: ``rtt_ms``, or with
    ``rtt_scale: matched`` in the matched regime ``rtt_ms x T / T_phone``
    (``edge.netem.matched_rtt_ms``)."""
    if cfg.regime != "matched" or cfg.rtt_scale == "none" or not t.get("masked_exec_s"):
        return float(cfg.rtt_ms)

    return matched_rtt_ms(cfg.rtt_ms, float(t["masked_exec_s"]),
                          float(t["token_mask_ratio"]), cfg.profile)
