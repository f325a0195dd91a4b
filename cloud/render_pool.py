"""The render engine's worker processes: spawning, feeding, waiting on, and stopping them.

Each worker (``cloud.render_worker.worker_main``) is a spawned process with two one-way
pipes. The engine's messages to it go through a per-worker outbox and a feeding thread, so
a send never blocks the engine loop (two large messages crossing cannot deadlock). The
engine loop waits on every live worker's result pipe and process sentinel at once, plus a
wake-up socket that :meth:`WorkerPool.wake` writes to when a request arrives. A worker
whose pipe closes or whose sentinel fires is reported lost; what that means for its tasks
is the engine's business (``cloud.render``).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from sakura.cloud.render_api import EngineConfig
from sakura.cloud.render_worker import worker_main


@dataclass
class WorkerProc:
    """A worker process, the pipe it answers on, and the thread that feeds its inbox pipe
    (sends never block the engine loop, so two large messages crossing cannot deadlock)."""

    wid: int
    proc: object
    conn: object                 # worker -> engine
    outbox: queue.Queue = field(default_factory=queue.Queue)
    sender: threading.Thread | None = None
    ready: bool = False
    pid: int = 0
    device: str = ""
    alive: bool = True
    done_groups: int = 0
    # request -> seconds its feeder spent sending messages that carry a K/V sync (pickling
    # and writing them into the pipe; the engine adds it to the request's exchange time)
    sync_send_s: dict = field(default_factory=dict)

    def send(self, msg) -> None:
        if self.alive:
            self.outbox.put(msg)

    def mark_lost(self) -> None:
        """Stop feeding it and close its result pipe."""
        self.alive = False
        self.outbox.put(None)
        try:
            self.conn.close()
        except OSError:
            pass


def _feed(w: WorkerProc, conn) -> None:
    while True:
        msg = w.outbox.get()
        if msg is None:
            break
        try:
            sync = msg[0] == "ahead" or (msg[0] == "run" and msg[1].get("sync") is not None)
            t0 = time.perf_counter()
            conn.send(msg)
            if sync:
                rid = msg[1] if msg[0] == "ahead" else msg[1]["rid"]
                w.sync_send_s[rid] = w.sync_send_s.get(rid, 0.0) + time.perf_counter() - t0
        except OSError:  # the worker is gone: its sentinel tells the engine loop
            break
    try:
        conn.close()
    except OSError:
        pass


class WorkerPool:
    """The engine's worker processes, by id (ids are never reused)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.workers: dict[int, WorkerProc] = {}
        self._wid = itertools.count()
        self._wake_r, self._wake_w = socket.socketpair()
        self._ctx = mp.get_context("spawn")

    def spawn(self) -> WorkerProc:
        """Start one worker process (it says ``ready`` once its model is loaded)."""
        cfg = self.cfg
        wid = next(self._wid)
        inbox_r, inbox_w = self._ctx.Pipe(duplex=False)
        results_r, results_w = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=worker_main, name=f"render-worker-{wid}", daemon=True,
                                 args=(wid, inbox_r, results_w, cfg.weights, cfg.device,
                                       cfg.threads, cfg.model, cfg.model_path))
        proc.start()
        inbox_r.close()
        results_w.close()
        w = WorkerProc(wid, proc, results_r)
        w.sender = threading.Thread(target=_feed, args=(w, inbox_w), daemon=True,
                                    name=f"render-feed-{wid}")
        w.sender.start()
        self.workers[wid] = w
        return w

    def wake(self) -> None:
        """Cut the engine loop's current wait short."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def poll(self, timeout: float, on_message: Callable[[WorkerProc, tuple], None],
             on_lost: Callable[[WorkerProc], None]) -> None:
        """Wait up to ``timeout`` s for a message, a worker's exit or a wake-up, and hand
        every message that arrived to ``on_message`` and every lost worker to ``on_lost``."""
        live = [w for w in self.workers.values() if w.alive]
        objs = [w.conn for w in live] + [w.proc.sentinel for w in live] + [self._wake_r]
        ready = set(wait(objs, timeout))
        if self._wake_r in ready:
            try:
                self._wake_r.recv(4096)
            except OSError:
                pass
        for w in live:
            if w.conn in ready or w.proc.sentinel in ready:
                try:
                    while w.conn.poll():
                        on_message(w, w.conn.recv())
                except (EOFError, OSError):
                    on_lost(w)
                    continue
            if w.proc.sentinel in ready and w.alive:
                on_lost(w)

    def close(self) -> None:
        """Ask every worker to stop, join (or kill) the processes and their feeders."""
        for w in self.workers.values():
            w.send(("stop",))
            w.outbox.put(None)
        for w in self.workers.values():
            w.proc.join(timeout=10)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=5)
            if w.sender is not None:
                w.sender.join(timeout=5)
        for sock in (self._wake_r, self._wake_w):
            sock.close()
