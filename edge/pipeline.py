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

Deadlines, not waits (the rules of the native ``StreamFeed``, ``native/src/sakura/edit.cpp``,
with the same constants). Every configuration of a shard is a prefix of one byte stream, so
each request carries its **fallbacks**: the allocator's ``fallbacks(j)`` whose bodies are
the first units of the chosen one (``fallbacks(shard, config)``, e.g.
:func:`~edge.client.prefix_fallbacks`), longest first. The client verifies units as they
arrive into the request's :class:`~edge.client.Transfer`, so the verified prefix is known at
any moment. A watchdog on the network loop (waking at least every ``WATCH_CAP_S``) enforces:

* **the deadline**: once execution has waited for shard ``j`` (counted from the later of
  the moment it began waiting and ``progress.start_not_before``) longer than its grace,
  ``max(MIN_GRACE_S, GRACE_FRACTION x predicted execution time of j)``, the shard runs on
  the longest verified fallback: the transfer is cancelled and the record says
  ``truncated``, ``config`` the fallback, ``requested`` the choice, ``bytes`` the fallback's.
  With none verified yet, a transfer without new bytes for ``max(grace, 3 x request
  latency, STALL_FLOOR_S)`` is re-requested (its remaining range) on a fresh connection,
  once per wait (``hedges``);
* **the stall watchdog**: any attempt without new bytes for ``max(STALL_FLOOR_S, 3 x
  request latency, 2 x its remaining bytes at the rate estimate)``, doubling per restart in
  a row without new bytes, is restarted the same way;
* **damage**: a unit that fails its checksum ends the body; the shard runs on the largest
  fallback verified before it (``damage`` names the unit), else the client refetches it.

**The local fallback** (``local_step_s``, the native ``run_edit``'s rule): execution waits
for a step's first shard at most one local step (none while the previous step was computed
locally), and for its other shards what is left of one local step after the step's earlier
shards' waits (a step's shards share one local step of waiting; the edit's first shard's wait
is its start-up and not counted), or less on outage evidence, or not at all when the rate
estimate says the shard's smallest verifiable prefix cannot arrive within the wait
(requests are out and no byte has arrived for that bound and 3 request latencies). Past
that, :meth:`Pipeline.get` raises :class:`~dit.cache.StepLate`: the DiT loop computes that
step with every token, as ``local`` does, the step's shards say ``local`` and are never
requested (or their transfers dropped), and the next step's shards are waited for again. An
origin in its retry backoff (a restart) is waited out, never computed around.

Every shard gets a :class:`ShardRecord` (stage start/end times relative to the edit start,
bytes, configuration, window, carry-over and rate estimate the allocator saw). A failure
in any stage stops the others and is raised from the executing thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import torch
from sakura.dit.cache import StepLate
from sakura.dit.stale import STALE_MAX_AGE
from sakura.edge.client import Fetched, Transfer
from sakura.edge.errors import EdgeError
from sakura.edge.monitor import BandwidthMonitor, ExecutionProgress, Window

from sakura.errors import SakuraError

T = TypeVar("T")

STALL_EPS_S = 1e-3  # waits shorter than this are scheduling noise, not stalls
GRACE_FRACTION = 0.5   # a waited-for shard runs on its verified prefix after this share of
MIN_GRACE_S = 0.001    # ... its predicted execution time (at least this long)
STALL_FLOOR_S = 0.05   # the shortest silence that restarts a transfer (a hedge)
WATCH_CAP_S = 0.05     # the watchdog looks at the transfers at least this often
REFINE_MARGIN = 2.0    # an extension's expected time, taken this often, must end before
                       # its shard's predicted start (prefix refinement; kRefineMargin)


async def _wait_event(event: asyncio.Event, timeout: float | None) -> None:
    """Until ``event`` is set or ``timeout`` seconds (None: no limit) have passed.

    ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 ``wait_for`` can swallow
    a cancellation that arrives as the event is set (bpo-42130), and a loop around it
    then never ends; ``NetLoop.close`` waited 10 s for the watchdog and a CI run failed
    (``test_a_decode_failure_reaches_the_executing_thread``)."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        pass


class NetLoop:
    """An asyncio event loop in a daemon thread (the network side of the runtime)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="edge-net", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def _drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(_drain(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()

    def __enter__(self) -> NetLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ShardRecord:
    """One shard's way through the pipeline; times in seconds since the edit started."""

    shard: int
    step: int
    blocks: list[int]
    config: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    bytes: int = 0
    window_s: float | None = None
    lead_s: float = 0.0  # time until the body could start: bytes still due, request latency
    carry_s: float | None = None
    rate_bps: float | None = None
    deadline: float | None = None
    recv_start: float | None = None
    recv_first_byte: float | None = None
    recv_end: float | None = None
    recon_start: float | None = None
    recon_end: float | None = None
    exec_start: float | None = None
    exec_end: float | None = None
    stall_s: float = 0.0
    attempts: int = 0
    resumes: int = 0
    refetches: int = 0
    requested: int | None = None  # the configuration requested (config differs: a fallback)
    hedges: int = 0               # re-requests on a fresh connection
    truncated: bool = False       # executed from the prefix received by its deadline
    damage: str | None = None     # a unit that failed its checksum (the prefix before it ran)
    # its step was computed on the device with every token (the local fallback: no bytes
    # used), and that began early on outage evidence
    local: bool = False
    outage: bool = False
    refinements: int = 0          # extensions of its received configuration (refinement)
    stale_from: int | None = None  # its step ran on this earlier step's K/V (stale reuse)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _InFlight:
    """A transfer on the wire: the configuration requested, its size and its body so far."""

    shard: int
    config: int
    nbytes: int
    transfer: Transfer
    task: asyncio.Future[None] = field(default=None)  # type: ignore[assignment]
    base: int | None = None  # an extension of this received configuration (refinement)

    @property
    def received(self) -> int:
        return self.transfer.received


@dataclass
class _Wait:
    """Execution waiting for a shard: since when, and whether it was hedged in this wait."""

    shard: int
    since: float
    hedged: bool = False


@dataclass
class PipelineStats:
    """Summary of a finished pipeline."""

    stalls: int
    stall_s: float
    startup_s: float
    bytes: int
    configs: list[int | None]
    truncations: int = 0
    hedges: int = 0
    damaged: list[str] = field(default_factory=list)
    local_steps: int = 0  # steps computed on the device (the local fallback)
    stale_steps: int = 0  # late steps run on each block's last K/V (stale reuse)
    outage_fallbacks: int = 0  # of them, begun early on outage evidence (no byte for the wait)
    refinements: int = 0  # received configurations extended before their shard ran


def lookahead_wait(ahead: int, max_ahead: int, max_ahead_cap: int, until_start_s: float,
                   horizon_s: float) -> float | None:
    """When a shard ``ahead`` shards past the executing one may be requested: 0 (now) within
    ``max_ahead``; beyond it, up to ``max_ahead_cap``, once its predicted execution start is
    ``horizon_s`` away (``lookahead_rtts`` request latencies), so that with short shards
    and long round trips the requests still go out a few round trips before they are
    needed; None (when execution advances) otherwise. Both runtimes use this rule."""
    if ahead <= max_ahead:
        return 0.0
    if ahead > max_ahead_cap or horizon_s <= 0:
        return None
    return max(0.0, until_start_s - horizon_s)


def deadline_grace_s(predicted_exec_s: float) -> float:
    """How long execution waits for a shard with a verified fallback before running on it."""
    return max(MIN_GRACE_S, GRACE_FRACTION * predicted_exec_s)


def stall_limit_s(remaining_bytes: int, rate_bps: float, latency_s: float,
                  restarts: int) -> float:
    """The silence after which the watchdog restarts an attempt: ``max(STALL_FLOOR_S, 3
    request latencies, 2 x the remaining bytes at the rate estimate)``, doubled per restart in
    a row without new bytes (so an origin slower to answer than the limit is still waited
    for, never restarted forever)."""
    limit = max(STALL_FLOOR_S, 3.0 * latency_s)
    if rate_bps > 0:
        limit = max(limit, 2.0 * max(0, remaining_bytes) * 8.0 / rate_bps)
    return limit * 2.0 ** min(max(0, restarts), 10)


def local_wait_s(measured_step_s: float | None, exec_s: list[float], steps: int,
                 tokens: int, masked: int) -> float:
    """The local fallback's wait bound, one local step: ``measured_step_s`` (a timed
    ``local`` edit over its steps, as the runners take it once per layout) or, without one,
    the cached step's time (``exec_s`` summed over the edit, per step) times the image tokens
    a full step computes over the masked ones (that estimate errs long: on the demo's
    template 0.20 s cached and 0.59 s local over 20 steps, 20% masked: 10 ms x 5 = 50 ms
    against 30 ms measured); never below the stall floor (a shard under 50 ms late is not a
    stall). Both runtimes use this rule."""
    cached_step = sum(exec_s) / max(1, steps)
    estimate = (measured_step_s if measured_step_s is not None
                else cached_step * tokens / max(1, masked))
    return max(STALL_FLOOR_S, estimate)


def stats_of(records: list[dict[str, Any]]) -> PipelineStats:
    """Stalls, startup, bytes and choices of an edit from its shard records (the timeline
    of either runtime: these records, or the native runtime's of the same fields)."""
    stalls = [r["stall_s"] for r in records[1:] if r["stall_s"] > STALL_EPS_S]
    return PipelineStats(
        stalls=len(stalls), stall_s=float(sum(stalls)),
        startup_s=records[0]["stall_s"] if records else 0.0,
        bytes=sum(r["bytes"] for r in records),
        configs=[r["config"] for r in records],
        truncations=sum(1 for r in records if r.get("truncated")),
        hedges=sum(int(r.get("hedges") or 0) for r in records),
        damaged=[r["damage"] for r in records if r.get("damage")],
        local_steps=len({r["step"] for r in records if r.get("local")}),
        stale_steps=len({r["step"] for r in records if r.get("stale_from") is not None}),
        outage_fallbacks=len({r["step"] for r in records if r.get("outage")}),
        refinements=sum(int(r.get("refinements") or 0) for r in records))


Fetch = Callable[[int, int, Transfer], Awaitable[Fetched]]
Fallbacks = Callable[[int, int], list[tuple[int, int]]]
FetchMore = Callable[[int, int, int, Transfer], Awaitable[Fetched]]
Decode = Callable[[int, int, bytes], list[torch.Tensor]]
Allocate = Callable[[int, Window, float], int]


class Pipeline:
    """Streams the shards of one edit; :attr:`provider` feeds ``dit.editing.cached_edit``.

    ``shard_blocks[j] = (step, [blocks])`` in execution order; ``fetch(shard, config,
    transfer)`` (async, run on ``net``; fills and verifies the :class:`Transfer` as bytes
    arrive), ``decode(shard, config, data)`` -> ``2 x len(blocks)`` tensors ``[K_b0, V_b0,
    K_b1, ...]``; ``allocate(shard, window, rate_bps)`` -> config id; ``fallbacks(shard,
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
        self._inflight: dict[int, _InFlight] = {}
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
        self._waiting: _Wait | None = None  # guarded by _cond
        # the local fallback: one full-token step's time (None: off), whether the last step
        # ran locally (its next step's first shard is then not waited for)
        self.local_step_s = local_step_s
        self.stale_max_age = int(stale_max_age)
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
            await _wait_event(self._slot_event, wait)

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
                window = self.progress.window(j, now)
                rate = self.monitor.estimate_bps() or 0.0
                due = self._outstanding() * 8.0 / rate if rate > 0 else 0.0
                # the body starts after the bytes still due and after the request latency
                lead = max(due, self.monitor.latency_s())
                config = int(self.allocate(j, replace(window, window_s=window.window_s - lead),
                                           rate))
                rec = self.records[j]
                rec.config = config
                rec.params = dict(self.describe(j, config)) if self.describe else {}
                rec.window_s, rec.carry_s, rec.rate_bps = window.window_s, window.carry_s, rate
                rec.lead_s = lead
                rec.deadline = self._rel(window.deadline)
                rec.requested = config
                size = self.config_bytes(j, config) if self.config_bytes else 0
                fallbacks = self.fallbacks(j, config) if self.fallbacks else []
                entry = _InFlight(j, config, size, Transfer(fallbacks))
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

    def _try_refine(self) -> bool:
        """(On the network loop.) With nothing in flight, extend the lowest received shard
        the reconstructor has not taken, to the largest configuration of its policy whose
        extension (its bytes at the rate estimate plus one request latency, taken
        ``REFINE_MARGIN`` times) ends before the shard's predicted start; True if a request
        went out (the rule of the native ``StreamFeed::try_refine``)."""
        if (self._inflight or self.extensions is None or self.fetch_more is None
                or self._watch_event is None):
            return False
        rate = self.monitor.estimate_bps() or 0.0
        if rate <= 0:
            return False
        latency = self.monitor.latency_s()
        with self._cond:
            received = [(j, c) for j, (c, _) in sorted(self._pending.items())
                        if j > self._executing and not self.records[j].local
                        and not self.records[j].truncated and not self.records[j].damage]
        for j, config in received:
            now = self.clock()
            slack = self.progress.deadline(j, now) - now
            have = self.config_bytes(j, config) if self.config_bytes else 0
            longer = self.extensions(j, config)
            fits = [(c, n) for c, n in longer
                    if REFINE_MARGIN * ((n - have) * 8.0 / rate + latency) <= slack]
            if not fits:
                continue
            best, size = fits[-1]
            between = sorted(((c, n - have) for c, n in longer if n < size),
                             key=lambda f: -f[1])
            with self._cond:
                got = self._pending.get(j)
                if got is None or got[0] != config:  # (taken by the reconstructor meanwhile)
                    continue
                self._refining[j] = self._pending.pop(j)
            entry = _InFlight(j, best, size - have, Transfer(between), base=config)
            entry.task = asyncio.ensure_future(self._transfer(entry))
            self._busy_since = time.monotonic()
            self._inflight[j] = entry
            self._watch_event.set()
            return True
        return False

    async def _transfer(self, entry: _InFlight) -> None:
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

    def _complete(self, entry: _InFlight, got: Fetched, truncated: bool = False) -> None:
        """Shard ``entry.shard``'s bytes are in (its choice, or a fallback: ``got.config``)."""
        j = entry.shard
        config = entry.config if got.config is None else int(got.config)
        rec = self.records[j]
        if entry.base is not None:  # an extension of what the shard had
            self._extended(entry, got, config)
            return
        rec.recv_start = self._rel(got.start)
        rec.recv_first_byte = self._rel(got.first_byte)
        rec.recv_end = self._rel(got.end)
        rec.bytes = len(got.data)
        rec.attempts, rec.resumes, rec.refetches = got.attempts, got.resumes, got.refetches
        rec.requested, rec.config = entry.config, config
        rec.hedges = max(got.hedges, entry.transfer.hedges)
        rec.truncated, rec.damage = truncated, got.damage
        if config != entry.config and self.describe:
            rec.params = dict(self.describe(j, config))
        if got.data:
            self._last_byte = max(self._last_byte, entry.transfer.last_progress)
        self.monitor.record(j, len(got.data), got.start, got.first_byte, got.end)
        self.progress.received(j, got.end)
        with self._cond:
            if rec.local:  # its step ran locally meanwhile: a rate sample only
                return
            self._pending[j] = (config, got.data)
            self._cond.notify_all()

    def _extended(self, entry: _InFlight, got: Fetched, config: int) -> None:
        """An extension's bytes are in (or the part of them verified by the deadline)."""
        j = entry.shard
        rec = self.records[j]
        if got.data:
            self._last_byte = max(self._last_byte, entry.transfer.last_progress)
        self.monitor.record(j, len(got.data), got.start, got.first_byte, got.end)
        with self._cond:
            base = self._refining.pop(j, None)
            if base is None or rec.local:
                return
            if got.data:
                base = (config, base[1] + got.data)
                rec.config, rec.bytes = config, len(base[1])
                rec.recv_end = self._rel(got.end)
                rec.refinements += 1
                if self.describe:
                    rec.params = dict(self.describe(j, config))
            self._pending[j] = base
            self._cond.notify_all()

    def _unrefine(self, j: int) -> None:
        """A late extension with nothing verified: the shard runs on what it had."""
        with self._cond:
            base = self._refining.pop(j, None)
            if base is not None and not self.records[j].local:
                self._pending[j] = base
                self._cond.notify_all()

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
            await _wait_event(self._watch_event, wait)

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
            self._complete(entry, t.result(fallback), truncated=True)
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
        with self._cond:
            current = self._executing
            tensors = self._ready.get(j) if j == current else None
        if tensors is None:
            tensors = self._enter(j, current)
        return tensors[2 * k], tensors[2 * k + 1]

    def _end_current(self, current: int, j: int, now: float) -> None:
        rec = self.records[current] if current >= 0 and current != j else None
        if rec is None or rec.exec_end is not None:
            return
        rec.exec_end = self._rel(now)
        if rec.local:  # a local step's time says nothing about cached execution's
            self.progress.exec_ended_local(current, now)
        else:
            self.progress.exec_ended(current, now)

    def _wait_bound(self, j: int) -> float | None:
        """How long execution waits for shard ``j`` before its step is computed locally
        (None: no local fallback, as long as it takes)."""
        if self.local_step_s is None:
            return None
        first = j == 0 or self.shard_blocks[j - 1][0] != self.shard_blocks[j][0]
        if first and self._local_mode:
            return 0.0
        if first and self._stale_wait_s is not None:
            return self._stale_wait_s
        if first:
            return self.local_step_s
        # a step's shards share one local step of waiting (issue 28: a two-group step once
        # waited two, 0.28 s stalled on the tail bench's slowest start); the edit's first
        # shard's wait is its start-up (connection, request latency, allowance), not counted
        step = self.shard_blocks[j][0]
        waited = sum(self.records[i].stall_s for i in range(1, j)
                     if self.shard_blocks[i][0] == step)
        return max(0.0, self.local_step_s - waited)

    def ran_stale(self, step: int, sources: dict[int, int], compute_s: float) -> None:
        """(From the executing thread, after the step.) Step ``step``, which :meth:`get`
        gave up on (``StepLate``), ran on each block's last K/V (``sources``: block -> the
        step it came from; ``dit.stale``) in ``compute_s``: its shards that had not run say
        ``stale_from`` instead of local, and the next step's first shard is waited for what
        the stale step saved against a local one (the native ``run_edit``'s rule)."""
        with self._cond:
            for i, (s, blocks) in enumerate(self.shard_blocks):
                if s != step:
                    continue
                src = min(sources.get(b, step) for b in blocks)
                self.records[i].local = False
                if src < step:  # (== step: that group ran on its own K/V before the wait)
                    self.records[i].stale_from = src
            self._local_mode = False
            self._stale_wait_s = max(0.0, float(self.local_step_s or 0.0) - compute_s)

    def _link_silent(self, bound: float) -> bool:
        """Outage evidence: transfers are out, none in a retry backoff, and the link has
        carried no body byte (of any transfer) for ``bound`` and 3 request latencies,
        counted from the later of its last byte and when transfers were last out again
        (the native ``HttpReceiver::quiet_since_s``: a hedge does not reset it)."""
        entries = list(self._inflight.values())
        if not entries or any(e.transfer.backing_off() for e in entries):
            return False
        last = max([self._last_byte, self._busy_since]
                   + [e.transfer.last_progress for e in entries if e.transfer.received > 0])
        return time.monotonic() - last >= max(bound, 3.0 * self.monitor.latency_s())

    def _cannot_arrive(self, j: int, until: float) -> bool:
        """The rate estimate says shard ``j``'s smallest verifiable prefix (its smallest
        fallback, else the configuration requested) cannot be in before ``until``: its
        transfer is out, none is in a retry backoff, and the bytes it still needs take longer
        than what is left of the wait at the estimate (the native ``StreamFeed::
        predict_late``). A shard not yet requested is not judged (its size is not chosen)."""
        entry = self._inflight.get(j)
        rate = self.monitor.estimate_bps()
        if entry is None or not rate or rate <= 0 or entry.transfer.backing_off():
            return False
        t = entry.transfer
        smallest = t.fallbacks[-1][1] if t.fallbacks else t.nbytes
        if smallest <= 0:
            return False
        need = max(0, smallest - len(t.buf))
        return self.clock() + need * 8.0 / rate > until

    def _backing_off(self) -> bool:
        return any(e.transfer.backing_off() for e in list(self._inflight.values()))

    def _skip_step(self, j: int, now: float, outage: bool) -> None:
        """Shard ``j``'s step is computed on the device from now (under ``_cond``): every
        shard of it says local, those not yet run are never requested (transfers in flight
        dropped); a group that already ran keeps its times."""
        step = self.shard_blocks[j][0]
        shards = [i for i, (s, _) in enumerate(self.shard_blocks) if s == step]
        for i in shards:
            rec = self.records[i]
            rec.local = True
            self._ready.pop(i, None)
            self._pending.pop(i, None)
            self._refining.pop(i, None)
            if rec.exec_start is not None:
                if rec.exec_end is None:
                    rec.exec_end = self._rel(now)
                    self.progress.exec_ended(i, now)  # it ran as a cached group
                continue
            self._end_current(self._executing, i, now)
            rec.exec_start = self._rel(now)
            self.progress.exec_started(i, now)
            self._executing = i
        self.records[j].outage = outage
        self._local_mode = True
        if self._net is not None:
            try:
                self._net.call(self._drop, shards)
            except RuntimeError:  # loop closed
                pass
        self._cond.notify_all()

    def _drop(self, shards: list[int]) -> None:
        """(On the network loop.) Cancel the transfers of shards computed locally."""
        for i in shards:
            entry = self._inflight.pop(i, None)
            if entry is not None:
                entry.task.cancel()
        self._wake_receiver()

    def _enter(self, j: int, current: int) -> list[torch.Tensor]:
        now = self.clock()
        self._end_current(current, j, now)
        bound = self._wait_bound(j)
        with self._cond:
            if current >= 0 and current != j:
                self._ready.pop(current, None)
            if j not in self._ready and self._error is None:
                self._waiting = _Wait(j, now)  # the deadline rule watches this wait
                self._wake(self._watch_event)
            late = outage = False
            while j not in self._ready and self._error is None:
                if bound is None:
                    self._cond.wait(0.5)
                    continue
                left = now + bound - self.clock()
                if bound > 0 and self._link_silent(bound):
                    late = outage = True
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
