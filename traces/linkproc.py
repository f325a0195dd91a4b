"""The paced link in its own process, so the emulated network never shares the device's
CPU time, GIL or event loop (issue 18: on a phone the network path does not slow execution).

:class:`PacedLinkProcess` starts ``python -m sakura.traces.linkproc`` with one end of a
socket pair, sends it the link's configuration, and from then on drives it over that pipe
(:class:`multiprocessing.connection.Connection`, pickled messages, one reply per request):
live changes (``set_trace``, ``set_rate``, ``restart``), counters and the delivery log. The
child runs a :class:`traces.link.PacedLink` on its own event loop, optionally pinned to
``cpus`` (``os.sched_setaffinity``) and optionally inside a network namespace (``netns``;
the kernel link's delay stage). ``time.monotonic()`` is one clock for all processes of the
machine, so the parent keeps a mirror of the link's :class:`traces.schedule.LinkSchedule`
(every change carries its wall time ``at`` and is applied on both sides): ``origin``,
``trace_time`` and ``expected_bytes`` need no round trip. A change returns once the child
has applied it, so an edit started after ``restart`` sees the new trace.

The child exits when told to, or when the pipe closes (its parent died).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from sakura.traces.errors import LinkError
from sakura.traces.impair import MODELLED_LOSS, NO_LOSS, Impairment
from sakura.traces.link import DeliveryLog, LinkCounters, PacedLink
from sakura.traces.model import Trace
from sakura.traces.schedule import LinkEmulator, LinkSchedule


def available_cpus() -> set[int]:
    """The CPUs processes may be pinned to: the cgroup's cpuset when the kernel says, else
    every online CPU (not this process's own affinity, which a pinned caller narrowed)."""
    try:
        text = open("/sys/fs/cgroup/cpuset.cpus.effective").read().strip()
    except OSError:
        text = ""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus or set(range(os.cpu_count() or 1))


def split_cpus(cpus: set[int] | None = None) -> tuple[set[int], set[int]] | None:
    """``(device, network)``: disjoint CPU sets for the device runtime and for the server
    plus link (the network gets one CPU, the device the rest); None with fewer than two."""
    pool = sorted(cpus if cpus is not None else available_cpus())
    if len(pool) < 2:
        return None
    return set(pool[:-1]), {pool[-1]}


def pin(pid: int, cpus: set[int] | None) -> set[int]:
    """Pin every thread of process ``pid`` (0: this one) to ``cpus`` (threads it starts
    later inherit it); returns its affinity afterwards."""
    pid = pid or os.getpid()
    if cpus:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            tids = [pid]
        try:
            for tid in tids:
                try:
                    os.sched_setaffinity(tid, cpus)
                except ProcessLookupError:
                    pass  # a thread that just ended
        except OSError as exc:
            raise LinkError(f"cannot pin process {pid} to CPUs {sorted(cpus)}: {exc}") from exc
    return set(os.sched_getaffinity(pid))


class PacedLinkProcess(LinkEmulator):
    """A :class:`traces.link.PacedLink` in a child process (same interface as
    :class:`traces.link.PacedLinkThread`).

    ``with PacedLinkProcess(trace, ("127.0.0.1", port), start_s=12.0, cpus={1}) as link:``
    then connect to ``link.port``. ``impairment`` defaults to a 30 ms round trip without
    loss (:class:`traces.impair.Impairment`); ``trace=None`` makes an unshaped relay that
    only adds the impairment. Other keyword arguments go to :class:`PacedLink`.
    """

    def __init__(self, trace: Trace | None, upstream: tuple[str, int], *,
                 start_s: float = 0.0, impairment: Impairment | None = None,
                 cpus: set[int] | None = None, netns: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, **link_kwargs: Any) -> None:
        if cpus is not None:
            cpus = {int(c) for c in cpus}
            if not cpus:
                raise LinkError("cpus must name at least one CPU (or be None)")
            unknown = cpus - available_cpus()
            if unknown:
                raise LinkError(f"cannot pin the link to CPUs {sorted(unknown)}: the machine "
                                f"has {sorted(available_cpus())}")
        self.impairment = impairment if impairment is not None else Impairment()
        self.shaped = trace is not None
        self.schedule = LinkSchedule(trace if trace is not None else Trace.constant(1e12, 1.0),
                                     start_s)
        self._start_s = float(start_s)
        self._config = {"trace": trace, "upstream": (str(upstream[0]), int(upstream[1])),
                        "start_s": float(start_s), "impairment": self.impairment,
                        "cpus": cpus, "host": host, "port": int(port), "kwargs": link_kwargs}
        self.requested_cpus = cpus
        self.netns = netns
        self.host = host
        self.port = 0
        self.pid = 0
        self.cpus: set[int] = set()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 30.0) -> PacedLinkProcess:
        if self._proc is not None:
            return self
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "sakura.traces.linkproc", "--fd", str(theirs.fileno())]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        try:
            self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),),
                                          stdin=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            raise LinkError(f"cannot start the link process: {exc}") from exc
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self._conn.send(self._config)
            if not self._conn.poll(timeout_s):
                raise LinkError(f"the link process did not start within {timeout_s:g} s")
            kind, *rest = self._conn.recv()
        except (EOFError, OSError) as exc:
            code = self._proc.poll()
            self._kill()
            raise LinkError(f"the link process exited during start-up (status {code})") from exc
        except BaseException:
            self._kill()
            raise
        if kind != "ready":
            self._kill()
            raise LinkError(f"the link process failed to start: {rest[0] if rest else kind}")
        self.port, self.pid, cpus, origin = int(rest[0]), int(rest[1]), rest[2], rest[3]
        self.cpus = set(cpus)
        # trace time start_s is when the child's link started listening
        self.schedule.restart(self._start_s, at=float(origin))
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        try:
            if conn is not None and proc.poll() is None:
                self._call("stop", timeout_s=timeout_s)
        except LinkError:
            pass
        self._proc, self._conn = None, None
        if conn is not None:
            conn.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc, self._conn = None, None
        if conn is not None:
            conn.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5.0)

    def __enter__(self) -> PacedLinkProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    #: (the kernel link's count of emulator faults; this process has none but its exit)
    faults = 0
    error = ""

    def health(self) -> str:
        """Why the link cannot be trusted now ('' when it can): its process has exited."""
        return "" if self.alive else "the paced link's process has exited"

    # ------------------------------------------------------------------ requests
    def _call(self, op: str, *args: Any, timeout_s: float = 10.0) -> Any:
        with self._lock:
            conn = self._conn
            if conn is None:
                raise LinkError("the link process is not running")
            try:
                conn.send((op, args))
                if not conn.poll(timeout_s):
                    raise LinkError(f"the link process did not answer {op!r} in {timeout_s:g} s")
                status, value = conn.recv()
            except (EOFError, OSError) as exc:
                raise LinkError(f"the link process is gone ({op!r}: {exc})") from exc
        if status != "ok":
            raise LinkError(f"link process: {op}: {value}")
        return value

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def counters(self) -> LinkCounters:
        """A snapshot of the child's counters."""
        return LinkCounters(**self._call("counters"))

    def delivery_log(self) -> DeliveryLog:
        """A copy of the child's delivery log (bottleneck exit times, cumulative bytes)."""
        times, cum = self._call("delivery")
        return DeliveryLog(times=list(times), cum_bytes=list(cum))

    def delivered_between(self, wall0: float, wall1: float) -> int:
        return int(self._call("delivered_between", float(wall0), float(wall1)))

    def conditions(self) -> dict[str, Any]:
        """What a record states about this link: emulator, delay, loss, process, CPUs."""
        return {"emulator": "paced", "process": "own", "pid": self.pid,
                "cpus": sorted(self.cpus), "rtt_ms": self.impairment.rtt_ms,
                "loss": self.impairment.loss,
                "loss_mechanism": MODELLED_LOSS if self.impairment.loss > 0 else NO_LOSS,
                "impairment": self.impairment.to_dict()}

    # ------------------------------------------------------------------ live changes
    def set_trace(self, trace: Trace, start_s: float = 0.0) -> None:
        if not self.shaped:
            raise LinkError("an unshaped relay has no trace to change")
        at = time.monotonic()
        self.schedule.set_trace(trace, start_s, at=at)
        self._call("set_trace", trace, float(start_s), at)

    def set_rate(self, rate_bps: float) -> None:
        if not self.shaped:
            raise LinkError("an unshaped relay has no rate to change")
        at = time.monotonic()
        self.schedule.set_rate(rate_bps, at=at)
        self._call("set_rate", float(rate_bps), at)

    def restart(self, start_s: float | None = None) -> None:
        at = time.monotonic()
        self.schedule.restart(start_s, at=at)
        self._call("restart", start_s, at)

    def set_impairment(self, impairment: Impairment) -> None:
        """Delay and loss for the connections opened from now on (applied on return)."""
        self._call("set_impairment", impairment)
        self.impairment = impairment


# ---------------------------------------------------------------------------- child


def _serve(conn: Connection) -> int:
    cfg = conn.recv()
    try:
        if cfg["cpus"]:
            os.sched_setaffinity(0, cfg["cpus"])
        link = PacedLink(cfg["trace"], cfg["upstream"], start_s=cfg["start_s"],
                         impairment=cfg["impairment"], host=cfg["host"],
                         port=cfg["port"], **cfg["kwargs"])
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", str(exc)))
        return 1
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(link.start())
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", str(exc)))
        loop.close()
        return 1
    done = loop.create_future()

    def handle() -> None:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            if not done.done():
                done.set_result(None)  # the parent is gone
            return
        try:
            value = _apply(link, op, args)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("error", str(exc)))
            return
        if op == "stop":
            loop.remove_reader(conn.fileno())
            if not done.done():
                done.set_result(None)
            stop_reply.append(value)  # answered once the link has stopped
            return
        conn.send(("ok", value))

    stop_reply: list[Any] = []
    loop.add_reader(conn.fileno(), handle)
    conn.send(("ready", link.port, os.getpid(), sorted(os.sched_getaffinity(0)),
               link.schedule.origin))
    try:
        loop.run_until_complete(done)
    finally:
        loop.run_until_complete(link.stop())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    if stop_reply:
        try:
            conn.send(("ok", None))
        except OSError:
            pass
    return 0


def _apply(link: PacedLink, op: str, args: tuple[Any, ...]) -> Any:
    sched = link.schedule
    if op == "set_trace":
        trace, start_s, at = args
        sched.set_trace(trace, start_s, at=at)
    elif op == "set_rate":
        rate, at = args
        sched.set_rate(rate, at=at)
    elif op == "restart":
        start_s, at = args
        sched.restart(start_s, at=at)
    elif op == "counters":
        return dict(vars(link.counters))
    elif op == "delivery":
        return list(link.delivery.times), list(link.delivery.cum_bytes)
    elif op == "delivered_between":
        return link.delivered_between(*args)
    elif op == "set_impairment":
        link.set_impairment(args[0])
        return None
    elif op == "stop":
        return None
    else:
        raise LinkError(f"unknown request {op!r}")
    link._changed()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sakura.traces.linkproc",
                                     description="paced link child process (started by "
                                                 "traces.linkproc.PacedLinkProcess)")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket-pair end")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # counters carry the last error
    conn = Connection(args.fd)
    try:
        return _serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
