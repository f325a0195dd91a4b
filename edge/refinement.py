"""Prefix refinement (issue 28 item 5): a received shard extended to a larger configuration.

Every configuration of a shard is a prefix of one byte stream. When the link is idle and no
shard may be requested yet, a shard that is in but not yet reconstructed is extended to the
largest configuration of its policy whose extension (its remaining bytes at the rate
estimate plus one request latency, taken ``REFINE_MARGIN`` times) ends before the shard's
predicted start: one more single-range GET of the same pack, ``fetch_more(shard, base,
config, transfer)``. A late extension is cut at its deadline like any transfer (the shard
runs on what it had, plus any verified part of the extension). The native ``StreamFeed::
try_refine`` (``native/src/sakura/edit.cpp``) is the same rule with the same margin
(``kRefineMargin``).

:class:`PrefixRefinement` is a part of :class:`~edge.pipeline.Pipeline` (its base): it
reads and changes the pipeline's state, declared below, under the pipeline's lock.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sakura.edge.monitor import BandwidthMonitor, ExecutionProgress
from sakura.edge.shard_records import InFlight, ShardRecord
from sakura.edge.transfer import Fetched, Transfer

REFINE_MARGIN = 2.0    # an extension's expected time, taken this often, must end before
                       # its shard's predicted start (prefix refinement; kRefineMargin)


class PrefixRefinement:
    """Extends received shards while the link is idle (on the pipeline's network loop)."""

    # the pipeline's state it works on (Pipeline.__init__ sets it), and the pipeline's
    # _transfer, _rel
    records: list[ShardRecord]
    monitor: BandwidthMonitor
    progress: ExecutionProgress
    clock: Callable[[], float]
    config_bytes: Callable[[int, int], int] | None
    describe: Callable[[int, int], dict[str, Any]] | None
    extensions: Callable[[int, int], list[tuple[int, int]]] | None
    fetch_more: Callable[[int, int, int, Transfer], Awaitable[Fetched]] | None
    _cond: threading.Condition
    _executing: int
    _pending: dict[int, tuple[int, bytes]]
    _refining: dict[int, tuple[int, bytes]]
    _inflight: dict[int, InFlight]
    _watch_event: asyncio.Event | None
    _busy_since: float
    _last_byte: float
    _measured_since_local: bool

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
            entry = InFlight(j, best, size - have, Transfer(between), base=config)
            entry.task = asyncio.ensure_future(self._transfer(entry))
            self._busy_since = time.monotonic()
            self._inflight[j] = entry
            self._watch_event.set()
            return True
        return False

    def _extended(self, entry: InFlight, got: Fetched, config: int) -> None:
        """An extension's bytes are in (or the part of them verified by the deadline)."""
        j = entry.shard
        rec = self.records[j]
        if got.data:
            self._last_byte = max(self._last_byte, entry.transfer.last_progress)
        self.monitor.record(j, len(got.data), got.start, got.first_byte, got.end)
        self._measured_since_local = self._measured_since_local or bool(got.data)
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
