"""Receive -> reconstruct -> execute over successive shards, with bounded buffers.

Three stages run concurrently:

* **receive** (a coroutine on the network loop, :class:`NetLoop`): for shard ``j`` it waits
  for a buffer slot (back-pressure: at most ``max_ahead`` shards in flight, received,
  reconstructing or reconstructed but not yet executing), asks the allocator for a configuration given
  the window and rate estimate at that moment, fetches and verifies the bytes. Requests
  are pipelined: the request for ``j`` goes out while ``j - 1`` is still arriving, once
  what is left of it will arrive within one request latency (at most ``max_inflight``
  transfers), so small shards do not leave the link idle for a round trip each. The
  allocator gets the window minus the *lead*: the longer of the time the link still owes
  earlier shards and the request latency (time to first byte);
* **reconstruct** (a thread): decodes the bytes into the shard's K/V tensors, lowest shard
  first, holding at most ``max_ready`` reconstructed shards ahead of execution (the
  device memory bound: the next shard's cache is ready while the current one executes);
* **execute** (the caller's thread): the DiT asks :class:`ShardProvider` ``get(step,
  block)`` in execution order; the first block of a shard blocks until that shard is
  reconstructed. Waiting there is a *stall* (shard 0's wait is the startup latency, not a
  stall). Leaving a shard frees its tensors and its slot. Execution starts as soon as
  shard 0 is reconstructed, also when it arrives before the startup allowance
  (:class:`~edge.monitor.ExecutionProgress`) is used up: shards 1, 2, ... were then
  allotted windows that assumed a later start and may stall, but each still starts no
  later than predicted, so starting early never ends the edit later than waiting would.

The deadline rules (truncation at the deadline, hedges, the stall watchdog, damage) are
:mod:`edge.deadlines`; the pipeline's watchdog applies them here. Two mechanisms are parts
of :class:`Pipeline` in modules of their own: :mod:`edge.refinement` (a received shard
extended to a larger configuration while the link is idle) and :mod:`edge.local_fallback`
(a step computed on the device when its shards cannot arrive in time).

Every shard gets a :class:`~edge.shard_records.ShardRecord` (stage start/end times relative
to the edit start, bytes, configuration, window, carry-over and rate estimate the allocator
saw). A failure in any stage stops the others and is raised from the executing thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import torch
from sakura.dit.cache import ShardSkipped, StepLate
from sakura.dit.stale import STALE_MAX_AGE
from sakura.edge.deadlines import (
    GRACE_FRACTION,
    MIN_GRACE_S,
    STALL_FLOOR_S,
    WATCH_CAP_S,
    deadline_grace_s,
    local_wait_s,
    lookahead_wait,
    stall_limit_s,
)
from sakura.edge.errors import EdgeError
from sakura.edge.local_fallback import LocalFallback
from sakura.edge.monitor import BandwidthMonitor, ExecutionProgress, Window
from sakura.edge.netloop import NetLoop, wait_event
from sakura.edge.refinement import REFINE_MARGIN, PrefixRefinement
from sakura.edge.shard_records import (
    STALL_EPS_S,
    InFlight,
    PipelineStats,
    ShardRecord,
    ShardWait,
    stats_of,
)
from sakura.edge.stale_plan import plan_unfetched, stale_source
from sakura.edge.transfer import Fetched, Transfer

from sakura.errors import SakuraError

# what this module's importers read from it (the rules live in the modules above)
__all__ = [
    "GRACE_FRACTION", "MIN_GRACE_S", "REFINE_MARGIN", "STALL_EPS_S", "STALL_FLOOR_S",
    "WATCH_CAP_S", "NetLoop", "Pipeline", "PipelineStats", "ShardProvider", "ShardRecord",
    "deadline_grace_s", "local_wait_s", "lookahead_wait", "stall_limit_s", "stats_of",
]


Fetch = Callable[[int, int, Transfer], Awaitable[Fetched]]
Fallbacks = Callable[[int, int], list[tuple[int, int]]]
FetchMore = Callable[[int, int, int, Transfer], Awaitable[Fetched]]
Decode = Callable[[int, int, bytes], list[torch.Tensor]]
Allocate = Callable[[int, Window, float, Callable[[int], bool] | None], int]


class Pipeline(PrefixRefinement, LocalFallback):
    """Streams the shards of one edit; :attr:`provider` feeds ``dit.editing.cached_edit``.

    ``shard_blocks[j] = (step, [blocks])`` in execution order; ``fetch(shard, config,
    transfer)`` (async, run on ``net``; fills and verifies the :class:`Transfer` as bytes
    arrive), ``decode(shard, config, data)`` -> ``2 x len(blocks)`` tensors ``[K_b0, V_b0,
    K_b1, ...]``; ``allocate(shard, window, rate_bps, stale)`` -> config id (``stale(m)``: shard
    ``m`` may run on its group's kept K/V, or None: ``Allocator.choose``); ``fallbacks(shard,
    config)`` -> ``(config, bytes)`` of the configurations that are prefixes of it, longest
    first (none: the shard always waits for its choice).
    """

    def __init__(self, shard_blocks: list[tuple[int, list[int]]], *, fetch: Fetch,
                 decode: Decode, allocate: Allocate, monitor: BandwidthMonitor,
                 progress: ExecutionProgress, origin: float, max_ahead: int = 4,
                 max_ready: int = 2,
                 describe: Callable[[int, int], dict[str, Any]] | None = None,
                 config_bytes: Callable[[int, int], int] | None = None,
                 max_inflight: int = 2, lookahead_rtts: float = 0.0,
                 max_ahead_cap: int | None = None,
                 fallbacks: Fallbacks | None = None,
                 local_step_s: float | None = None,
                 stale_max_age: int = STALE_MAX_AGE,
                 extensions: Fallbacks | None = None, fetch_more: FetchMore | None = None,
                 skippable: Callable[[int, int], bool] | None = None,
                 plan_local: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_ahead < 1 or max_ready < 1:
            raise ValueError("max_ahead and max_ready must be >= 1")
        # beyond max_ahead (up to max_ahead_cap) a shard may be requested once its predicted
        # execution start is within lookahead_rtts request latencies (see lookahead_wait)
        self.lookahead_rtts = float(lookahead_rtts)
        self.max_ahead_cap = max(max_ahead, max_ahead_cap or max_ahead)
        self.shard_blocks = shard_blocks
        self.fetch, self.decode, self.allocate = fetch, decode, allocate
        self.monitor, self.progress = monitor, progress
        self.origin, self.clock, self.max_ahead = origin, clock, max_ahead
        self.max_ready = min(max_ready, max_ahead)
        self.describe = describe
        self.config_bytes = config_bytes
        self.fallbacks = fallbacks
        self.max_inflight = max(1, max_inflight)
        self._inflight: dict[int, InFlight] = {}
        self.records = [ShardRecord(i, s, list(b)) for i, (s, b) in enumerate(shard_blocks)]
        self._index = {(s, b): (i, k) for i, (s, bl) in enumerate(shard_blocks)
                       for k, b in enumerate(bl)}
        self._cond = threading.Condition()
        self._ready: dict[int, list[torch.Tensor]] = {}
        self._executing = -1
        self._error: BaseException | None = None
        self._pending: dict[int, tuple[int, bytes]] = {}  # received, not reconstructed
        self._closing = False
        self._recon_thread: threading.Thread | None = None
        self._net: NetLoop | None = None
        self._recv_future: concurrent.futures.Future[None] | None = None
        self._slot_event: asyncio.Event | None = None
        self._watch_event: asyncio.Event | None = None
        self._waiting: ShardWait | None = None  # guarded by _cond
        # the local fallback: one full-token step's time (None: off), whether the last step
        # ran locally (its next step's first shard is then not waited for)
        self.local_step_s = local_step_s
        self.stale_max_age = int(stale_max_age)
        # the stale plan (edge/stale_plan.py): ``skippable(shard, config)`` says the choice is
        # not worth its bytes while recent K/V are at hand (``Allocator.skippable``; None: off)
        self.skippable = skippable
        # ... and, when that shard's group holds no recent K/V, its step is recomputed on the
        # device instead (plan_local: the local step is a recompute step, exact)
        self.plan_local = bool(plan_local)
        # (network loop) a body arrived since the last step planned local: a step is planned
        # local only on a rate estimate some transfer has refreshed since (else an edit that
        # went local would never measure the link again)
        self._measured_since_local = True
        self._local_mode = False
        self._stale_wait_s: float | None = None  # the wait after a stale step (ran_stale)
        # the link's last body byte and when transfers were last out again (outage
        # evidence; the client's clock, time.monotonic)
        self._last_byte = self._busy_since = 0.0
        # prefix refinement: ``extensions(shard, config)`` -> (config, bytes) of the policy's
        # configurations that begin with config's body, shortest first; ``fetch_more(shard,
        # base, config, transfer)`` their bytes after base's; received shards whose extension
        # is in flight, with their configuration and bytes so far (guarded by _cond)
        self.extensions, self.fetch_more = extensions, fetch_more
        self._refining: dict[int, tuple[int, bytes]] = {}
        self.provider = ShardProvider(self)

    # ------------------------------------------------------------------ lifecycle
    def start(self, net: NetLoop) -> Pipeline:
        self._net = net
        self._recon_thread = threading.Thread(target=self._reconstruct_loop,
                                              name="edge-recon", daemon=True)
        self._recon_thread.start()
        self._recv_future = net.submit(self._receive_loop())
        self._recv_future.add_done_callback(self._receive_done)
        return self

    def finish(self) -> PipelineStats:
        """Call after the DiT returned: closes the last shard and stops the stages."""
        now = self.clock()
        with self._cond:
            last = self._executing
        self._end_current(last, -1, now)
        self.close()
        return self.stats()

    def close(self) -> None:
        """Stop all stages (idempotent); pending work is dropped."""
        fut = self._recv_future
        if fut is not None and not fut.done() and self._net is not None:
            fut.cancel()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._recon_thread is not None:
            self._recon_thread.join(30)
            self._recon_thread = None
        with self._cond:
            self._ready.clear()
            self._cond.notify_all()

    def stats(self) -> PipelineStats:
        return stats_of([r.to_dict() for r in self.records])

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _rel(self, t: float) -> float:
        return t - self.origin

    # ------------------------------------------------------------------ receive
    def _slot_wait(self, shard: int) -> float | None:
        """0: ``shard`` may be requested now; t > 0: once t seconds have passed (its
        execution comes within the lookahead horizon); None: once execution advances."""
        with self._cond:
            if self._error is not None:
                return 0.0
            ahead = shard - self._executing
        now = self.clock()
        return lookahead_wait(ahead, self.max_ahead, self.max_ahead_cap,
                              self.progress.deadline(shard, now) - now,
                              self.lookahead_rtts * self.monitor.latency_s())

    def _wake_receiver(self) -> None:
        self._wake(self._slot_event)

    def _wake(self, event: asyncio.Event | None) -> None:
        if self._net is not None and event is not None:
            try:
                self._net.call(event.set)
            except RuntimeError:  # loop closed
                pass

    async def _wait_slot(self, shard: int) -> None:
        assert self._slot_event is not None
        while (wait := self._slot_wait(shard)) != 0.0:
            self._slot_event.clear()
            if (wait := self._slot_wait(shard)) == 0.0:
                break
            if self._try_refine():  # the link is idle and no shard may go yet
                wait = min(wait, 1e-3) if wait is not None else 1e-3
            await wait_event(self._slot_event, wait)

    def _outstanding(self) -> int:
        return sum(max(0, f.nbytes - f.received) for f in self._inflight.values())

    async def _wait_link(self) -> None:
        """Return once the next request may go out: nothing in flight, or (with fewer than
        ``max_inflight`` transfers) the bytes still due arrive within one request latency,
        so the next body starts right behind them instead of after an idle round trip."""
        while self._inflight and self._error is None:
            tasks = [f.task for f in self._inflight.values()]
            rate = self.monitor.estimate_bps()
            latency = self.monitor.latency_s()
            if len(tasks) < self.max_inflight and rate and self.config_bytes is not None:
                due_s = self._outstanding() * 8.0 / rate
                if due_s <= latency:
                    return
                timeout = min(0.01, max(0.001, due_s - latency))
            else:
                timeout = None
            await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    async def _receive_loop(self) -> None:
        self._slot_event = asyncio.Event()
        self._watch_event = asyncio.Event()
        watchdog = asyncio.ensure_future(self._watch_loop())
        try:
            for j in range(len(self.shard_blocks)):
                await self._wait_slot(j)
                if self._error is None:
                    await self._wait_link()
                if self._error is not None:
                    return
                if self.records[j].local:  # its step ran on the device: never requested
                    continue
                now = self.clock()
                rec = self.records[j]
                if self._step_planned_local(j):  # its step is recomputed: never requested
                    rec.planned_local = True
                    self.progress.received(j, now)
                    continue
                window = self.progress.window(j, now)
                rate = self.monitor.estimate_bps() or 0.0
                due = self._outstanding() * 8.0 / rate if rate > 0 else 0.0
                # the body starts after the bytes still due and after the request latency
                lead = max(due, self.monitor.latency_s())
                config = int(self.allocate(j, replace(window, window_s=window.window_s - lead),
                                           rate, self._stale_options(j)))
                planned = self._plan_stale(j, config)
                if planned is not None:
                    if planned == "stale":
                        rec.planned_stale = True
                    else:
                        rec.planned_local = True
                    rec.window_s, rec.carry_s, rec.rate_bps = window.window_s, window.carry_s, rate
                    rec.lead_s, rec.deadline = lead, self._rel(window.deadline)
                    self.progress.received(j, now)  # nothing to receive: ready at once
                    continue
                rec.config = config
                rec.params = dict(self.describe(j, config)) if self.describe else {}
                rec.window_s, rec.carry_s, rec.rate_bps = window.window_s, window.carry_s, rate
                rec.lead_s = lead
                rec.deadline = self._rel(window.deadline)
                rec.requested = config
                size = self.config_bytes(j, config) if self.config_bytes else 0
                fallbacks = self.fallbacks(j, config) if self.fallbacks else []
                entry = InFlight(j, config, size, Transfer(fallbacks))
                entry.task = asyncio.ensure_future(self._transfer(entry))
                if not self._inflight:
                    self._busy_since = time.monotonic()
                self._inflight[j] = entry
                self._watch_event.set()
            while self._error is None and (self._inflight or self._try_refine()):
                await asyncio.wait([f.task for f in self._inflight.values()],
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            watchdog.cancel()
            for f in list(self._inflight.values()):
                f.task.cancel()

    def _stale_options(self, j: int) -> Callable[[int], bool] | None:
        """For the allocator's plan from shard ``j``: whether shard ``m`` may run on its
        group's kept K/V, counting every shard from ``j`` to ``m`` as unfetched (so a plan
        never leans on a refresh it may itself skip); None with the stale plan off."""
        if self.skippable is None or self.local_step_s is None:
            return None
        planned = [r.planned_stale for r in self.records]

        def may(m: int) -> bool:
            return stale_source(self.shard_blocks, planned, m, self.stale_max_age,
                                unfetched_from=j) is not None
        return may

    def _plan_stale(self, j: int, config: int) -> str | None:
        """The stale plan's rule (:mod:`edge.stale_plan`) for shard ``j`` at ``config``:
        "stale", "local" or None (fetch it)."""
        if self.skippable is None or self.local_step_s is None or not self.skippable(j, config):
            return None
        planned = [r.planned_stale for r in self.records]
        source = stale_source(self.shard_blocks, planned, j, self.stale_max_age)
        rate = self.monitor.estimate_bps() or 0.0
        decided = plan_unfetched(source, self.plan_local and self.stale_max_age > 0
                                 and rate > 0 and self._measured_since_local)
        if decided == "local":
            self._measured_since_local = False
        return decided

    def _unfetched_at_deadline(self, j: int, config: int) -> str | None:
        """A prefix cut at its deadline that the stale plan would not have fetched (its
        configuration is skippable): "stale" or "local" as :meth:`_plan_stale` decides, with
        no rate condition (the cut transfer was a sample); None: it runs on the prefix. On the
        tail bench the worst edits ran such prefixes (a 32 dB configuration of step 2 whose
        K/V then served three stale steps, 2026-12-06)."""
        if self.skippable is None or self.local_step_s is None or not self.skippable(j, config):
            return None
        planned = [r.planned_stale for r in self.records]
        source = stale_source(self.shard_blocks, planned, j, self.stale_max_age)
        return plan_unfetched(source, self.plan_local and self.stale_max_age > 0)

    def _cut_unfetched(self, entry: InFlight, got: Fetched, decided: str) -> None:
        """(Network loop.) Shard ``entry.shard``'s prefix at its deadline is not used: the
        shard runs stale (or its step locally); the bytes were a rate sample."""
        rec = self._received(entry, got, None, truncated=True)
        with self._cond:
            rec.params = {}
            if decided == "stale":
                rec.planned_stale = True
            else:
                rec.planned_local = True
            self._cond.notify_all()

    def _step_planned_local(self, j: int) -> bool:
        """An earlier shard of shard ``j``'s step was planned local (the step is recomputed)."""
        step = self.shard_blocks[j][0]
        return any(self.records[i].planned_local for i in range(j - 1, -1, -1)
                   if self.shard_blocks[i][0] == step)

    async def _transfer(self, entry: InFlight) -> None:
        j = entry.shard
        try:
            if entry.base is not None:
                assert self.fetch_more is not None
                got = await self.fetch_more(j, entry.base, entry.config, entry.transfer)
            else:
                got = await self.fetch(j, entry.config, entry.transfer)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the executing thread
            if entry.base is not None:  # an extension that failed: what the shard had
                self._unrefine(j)
                return
            self.fail(exc)
            return
        finally:
            if self._inflight.get(j) is entry:
                del self._inflight[j]
        # the link is idle now: a refinement goes out before this shard is handed on, so
        # its slack is read while execution still cannot start on it (a CI run under load
        # let the reconstructor and the executing thread start shard 0 first, and the
        # refinement then found too little slack)
        if not self._inflight:
            self._try_refine()
        self._complete(entry, got)
        if self._slot_event is not None:  # the link may be idle now: a refinement may go
            self._slot_event.set()

    def _complete(self, entry: InFlight, got: Fetched, truncated: bool = False) -> None:
        """Shard ``entry.shard``'s bytes are in (its choice, or a fallback: ``got.config``)."""
        j = entry.shard
        config = entry.config if got.config is None else int(got.config)
        if entry.base is not None:  # an extension of what the shard had
            self._extended(entry, got, config)
            return
        rec = self._received(entry, got, config, truncated)
        if config != entry.config and self.describe:
            rec.params = dict(self.describe(j, config))
        with self._cond:
            if rec.local:  # its step ran locally meanwhile: a rate sample only
                return
            self._pending[j] = (config, got.data)
            self._cond.notify_all()

    def _received(self, entry: InFlight, got: Fetched, config: int | None,
                  truncated: bool) -> ShardRecord:
        """(Network loop.) A transfer's end in the shard's record (``config`` the one it runs
        at, None: not used), and its bytes as a rate sample."""
        j = entry.shard
        rec = self.records[j]
        rec.recv_start = self._rel(got.start)
        rec.recv_first_byte = self._rel(got.first_byte)
        rec.recv_end = self._rel(got.end)
        rec.bytes = len(got.data)
        rec.attempts, rec.resumes, rec.refetches = got.attempts, got.resumes, got.refetches
        rec.requested, rec.config = entry.config, config
        rec.hedges = max(got.hedges, entry.transfer.hedges)
        rec.truncated, rec.damage = truncated, got.damage
        if got.data:
            self._last_byte = max(self._last_byte, entry.transfer.last_progress)
        self.monitor.record(j, len(got.data), got.start, got.first_byte, got.end)
        self._measured_since_local = self._measured_since_local or bool(got.data)
        self.progress.received(j, got.end)
        return rec

    # ------------------------------------------------------------------ deadlines
    async def _watch_loop(self) -> None:
        """The deadline of the shard execution waits for and the stall watchdog (see the
        module docstring), looked at again when either may next fire."""
        assert self._watch_event is not None
        while True:
            try:
                wait = self._watch()
            except Exception as exc:  # noqa: BLE001 - handed to the executing thread
                self.fail(exc)
                return
            self._watch_event.clear()
            await wait_event(self._watch_event, wait)

    def _watch(self) -> float:
        """One look at the transfers; returns the seconds until the next one is due."""
        if self._error is not None:
            return WATCH_CAP_S
        now = self.clock()
        wait = min(WATCH_CAP_S, self._enforce_deadline(now))
        latency = self.monitor.latency_s()
        rate = self.monitor.estimate_bps() or 0.0
        for entry in list(self._inflight.values()):
            t = entry.transfer
            idle = t.idle_s()  # (the client's clock: time.monotonic)
            if idle is None:  # waiting out a backoff, or a restart is on its way
                continue
            if t.received >= entry.nbytes:  # the whole body is in: its completion is due
                continue  # (a restart would ask for an empty range: native restart_stalled)
            limit = stall_limit_s(entry.nbytes - t.received, rate, latency, t.stalled_restarts)
            if idle > limit:
                if t.restart():
                    t.stalled_restarts += 1
            else:
                wait = min(wait, limit - idle)
        return max(1e-4, wait)

    def _enforce_deadline(self, now: float) -> float:
        """The deadline rule for the shard execution waits for; seconds until it is due."""
        with self._cond:
            w = self._waiting
        entry = self._inflight.get(w.shard) if w is not None else None
        if w is None or entry is None:
            return WATCH_CAP_S
        j = w.shard
        grace = deadline_grace_s(self.progress.predicted_exec_s(j))
        # execution asks for shard 0 at once, but its deadline is the predicted start (the
        # startup allowance): the wait counts from there
        waited = now - max(w.since, self.progress.start_not_before)
        if waited < grace:
            return max(1e-4, grace - waited)
        t = entry.transfer
        fallback = t.prefix()
        if fallback is not None:  # truncation: the longest verified prefix, now
            del self._inflight[j]
            entry.task.cancel()
            got = t.result(fallback)
            decided = self._unfetched_at_deadline(j, fallback[0])
            if decided is None:
                self._complete(entry, got, truncated=True)
            else:
                self._cut_unfetched(entry, got, decided)
            self._wake_receiver()
            return WATCH_CAP_S
        if entry.base is not None:  # a late extension: the shard runs on what it had, now
            del self._inflight[j]
            entry.task.cancel()
            self._unrefine(j)
            self._wake_receiver()
            return WATCH_CAP_S
        idle = t.idle_s()  # (the client's clock: time.monotonic)
        # a hedge, once per wait, for a transfer that has made no progress for a while
        if (not w.hedged and idle is not None
                and idle >= max(grace, 3.0 * self.monitor.latency_s(), STALL_FLOOR_S)):
            t.restart()
            w.hedged = True
        return max(1e-3, grace)

    def _receive_done(self, fut: concurrent.futures.Future[None]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.fail(exc)

    # ------------------------------------------------------------------ reconstruct
    def _next_to_reconstruct(self) -> tuple[int, int, bytes] | None:
        """The lowest received shard, once fewer than ``max_ready`` shards are reconstructed
        ahead of execution (None: closing)."""
        with self._cond:
            while True:
                if self._closing or self._error is not None:
                    return None
                if self._pending:
                    j = min(self._pending)
                    if j - self._executing <= self.max_ready:
                        config, data = self._pending.pop(j)
                        return j, config, data
                self._cond.wait(0.5)

    def _reconstruct_loop(self) -> None:
        while True:
            item = self._next_to_reconstruct()
            if item is None:
                return
            j, config, data = item
            t0 = self.clock()
            try:
                tensors = self.decode(j, config, data)
            except BaseException as exc:  # noqa: BLE001 - handed to the executing thread
                self.fail(exc)
                return
            t1 = self.clock()
            expected = 2 * len(self.shard_blocks[j][1])
            if len(tensors) != expected:
                self.fail(EdgeError(f"shard {j}: decoded {len(tensors)} matrices, "
                                    f"expected {expected}"))
                return
            rec = self.records[j]
            rec.recon_start, rec.recon_end = self._rel(t0), self._rel(t1)
            self.progress.reconstructed(j, t0, t1)
            with self._cond:
                if j > self._executing and not rec.local:
                    self._ready[j] = tensors
                self._cond.notify_all()

    # ------------------------------------------------------------------ execute
    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            j, k = self._index[(step, block)]
        except KeyError:
            raise EdgeError(f"the pack has no shard for step {step} block {block}") from None
        rec = self.records[j]
        if rec.planned_stale or rec.planned_local:  # the stale plan: its group's K/V if
            raise ShardSkipped(step, block)          # recent (stale_shard), else local
        with self._cond:
            current = self._executing
            tensors = self._ready.get(j) if j == current else None
        if tensors is None:
            tensors = self._enter(j, current)
        if tensors is None:  # cut at its deadline: its group's K/V (stale_shard), or local
            raise ShardSkipped(step, block)
        return tensors[2 * k], tensors[2 * k + 1]

    def stale_shard(self, step: int, block: int, source: int | None) -> None:
        """(From the executing thread.) Block ``block`` of a shard the stale plan did not
        fetch runs on its K/V of step ``source`` (``dit.stale.StaleReuse.get``): the shard
        executes from now with no wait; ``source`` None: none recent enough, and the step is
        late (the local fallback)."""
        j, _ = self._index[(step, block)]
        now = self.clock()
        with self._cond:
            current = self._executing
        if current == j:
            return
        self._end_current(current, j, now)
        with self._cond:
            if current >= 0:
                self._ready.pop(current, None)
            if source is None:
                self._skip_step(j, now, outage=False)
                return
            if j == 0 or self.shard_blocks[j - 1][0] != step:
                self._local_mode = False
                self._stale_wait_s = None
            rec = self.records[j]
            rec.stale_from = source
            rec.exec_start = self._rel(now)
            self.progress.exec_started(j, now)
            self._executing = j
            self._cond.notify_all()
        self._wake_receiver()

    def _end_current(self, current: int, j: int, now: float) -> None:
        rec = self.records[current] if current >= 0 and current != j else None
        if rec is None or rec.exec_end is not None:
            return
        rec.exec_end = self._rel(now)
        if rec.local:  # a local step's time says nothing about cached execution's
            self.progress.exec_ended_local(current, now)
        else:
            self.progress.exec_ended(current, now)

    def _enter(self, j: int, current: int) -> list[torch.Tensor] | None:
        now = self.clock()
        self._end_current(current, j, now)
        bound = self._wait_bound(j)
        with self._cond:
            if current >= 0 and current != j:
                self._ready.pop(current, None)
            if j not in self._ready and self._error is None:
                self._waiting = ShardWait(j, now)  # the deadline rule watches this wait
                self._wake(self._watch_event)
            late = outage = False
            while (j not in self._ready and self._error is None
                   and not (self.records[j].planned_stale or self.records[j].planned_local)):
                if bound is None:
                    self._cond.wait(0.5)
                    continue
                left = now + bound - self.clock()
                quiet = self._link_quiet_since(bound) if bound > 0 else None
                if quiet is not None:
                    late = outage = True
                    self.records[j].quiet_since = self._rel(quiet)
                    break
                if bound > 0 and self._cannot_arrive(j, self.clock() + left):
                    late = True  # the rate says so: the step is computed now, not after
                    break
                if left <= 0 and not self._backing_off():
                    late = True
                    break
                self._cond.wait(min(0.01, max(0.001, left)))
            self._waiting = None
            if self._error is not None:
                err = self._error
                if isinstance(err, SakuraError):
                    raise err
                raise EdgeError(f"shard {j} could not be delivered: {err!r}") from err
            if late:
                self.records[j].stall_s += self.clock() - now  # waited either way
                self._skip_step(j, self.clock(), outage)
                raise StepLate(self.shard_blocks[j][0])
            if j not in self._ready:  # cut at its deadline and not used (the stale plan)
                self.records[j].stall_s += self.clock() - now
                return None
            first = j == 0 or self.shard_blocks[j - 1][0] != self.shard_blocks[j][0]
            if first:
                self._local_mode = False
                self._stale_wait_s = None
            tensors = self._ready[j]
            # the start is stamped before the other stages can see the slot it frees
            start = self.clock()
            rec = self.records[j]
            rec.stall_s += start - now
            rec.exec_start = self._rel(start)
            self.progress.exec_started(j, start)
            self._executing = j
            self._cond.notify_all()  # the reconstructor may decode one more shard now
        self._wake_receiver()
        return tensors


class ShardProvider:
    """The ``KVProvider`` the DiT reads from: ``get(step, block) -> (K, V)``."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        # the oldest K/V a late step may reuse (dit.cached_edit reads it; 0: never)
        self.stale_max_age = pipeline.stale_max_age

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pipeline.get(step, block)

    def ran_stale(self, step: int, sources: dict[int, int], compute_s: float) -> None:
        self._pipeline.ran_stale(step, sources, compute_s)

    def stale_shard(self, step: int, block: int, source: int | None) -> None:
        self._pipeline.stale_shard(step, block, source)
