"""The local fallback (issue 28 item 10): a step whose shards cannot arrive in time is
computed on the device: as a recompute step (the template's own K/V recomputed from public
catalog data, then the cached step: ``dit.editing.RecomputedKV``), or with every token as
``local`` does where the template's prompt embeddings are not at hand.

Execution waits for a step's first shard at most one local step (``local_step_s``,
:func:`~edge.deadlines.local_wait_s`; none while the previous step was computed locally),
and for its other shards what is left of one local step after the step's earlier shards'
waits (a step's shards share one local step of waiting; the edit's first shard's wait is its
start-up and not counted), or less on outage evidence (requests are out and no byte has
arrived for that bound and 3 request latencies), or not at all when the rate estimate says
the shard's smallest verifiable prefix cannot arrive within the wait. Past that,
:meth:`~edge.pipeline.Pipeline.get` raises :class:`~dit.cache.StepLate`: the DiT loop
computes that step on the device (or, with stale reuse, on each block's last K/V:
:mod:`dit.stale`), the step's shards say ``local`` and are never requested (or their
transfers dropped), and the next step's shards are waited for again. An origin in its retry
backoff (a restart) is waited out, never computed around. The native ``run_edit``
(``native/src/sakura/edit.cpp``: ``StepRunner``, ``StreamFeed::predict_late``) follows the
same rules.

:class:`LocalFallback` is a part of :class:`~edge.pipeline.Pipeline` (its base): it reads
and changes the pipeline's state, declared below, under the pipeline's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from sakura.edge.monitor import BandwidthMonitor, ExecutionProgress
from sakura.edge.netloop import NetLoop
from sakura.edge.shard_records import InFlight, ShardRecord


class LocalFallback:
    """When execution stops waiting for a step's shards, and what it does then."""

    # the pipeline's state it works on (Pipeline.__init__ sets it), and the pipeline's
    # _end_current, _wake_receiver, _rel
    shard_blocks: list[tuple[int, list[int]]]
    records: list[ShardRecord]
    monitor: BandwidthMonitor
    progress: ExecutionProgress
    clock: Callable[[], float]
    local_step_s: float | None
    _cond: threading.Condition
    _executing: int
    _local_mode: bool
    _stale_wait_s: float | None
    _ready: dict[int, list[torch.Tensor]]
    _pending: dict[int, tuple[int, bytes]]
    _refining: dict[int, tuple[int, bytes]]
    _inflight: dict[int, InFlight]
    _net: NetLoop | None
    _busy_since: float
    _last_byte: float

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

    def _link_quiet_since(self, bound: float) -> float | None:
        """Outage evidence: transfers are out, none in a retry backoff, and the link has
        carried no body byte (of any transfer) for ``bound`` and 3 request latencies,
        counted from the later of its last byte and when transfers were last out again
        (the native ``HttpReceiver::quiet_since_s``: a hedge does not reset it). Returns
        that moment (``time.monotonic``) when there is such evidence, else None."""
        entries = list(self._inflight.values())
        if not entries or any(e.transfer.backing_off() for e in entries):
            return None
        last = max([self._last_byte, self._busy_since]
                   + [e.transfer.last_progress for e in entries if e.transfer.received > 0])
        if time.monotonic() - last >= max(bound, 3.0 * self.monitor.latency_s()):
            return last
        return None

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
