"""Propagation delay and loss on an emulated link, as a userspace stage of a TCP proxy.

A real 5G or LTE link has a round-trip time of 20-60 ms, not only a rate: an edit that
makes one request per shard pays it on every request. :class:`Impairment` names what a
link adds on top of its rate: a one-way propagation delay per direction (default
:data:`DEFAULT_RTT_MS` round trip, split evenly) and an optional packet loss rate.

:class:`DelayLine` is the delay stage: it delivers the chunks of one direction of one TCP
connection in order, each no earlier than its due time (when it left the bottleneck plus
the one-way delay), so a chunk in flight never holds up the bottleneck behind it (the link
stays pipelined, as a real one is). A new connection also pays one round trip before its
first request bytes go up (the TCP handshake the proxy's local accept does not show).

Loss is modelled by its effect on TCP, since the proxy terminates TCP on both sides and
cannot drop a segment: each MTU-sized packet is lost with probability ``loss``; a lost
packet is sent again (the retransmission takes link capacity again) and the chunk that
held it, and everything behind it on that connection (TCP delivers in order), arrives one
round trip later (fast retransmit). Not modelled: retransmission timeouts and the
congestion window's reaction (rate is the trace's, not TCP's); say so where loss > 0 is
reported. This kernel has no ``netem`` qdisc, so the kernel-shaped link uses the same stage
in a relay process in front of tbf (:meth:`traces.netns.KernelShapedLink.delay_stage`) for
the delay; its loss is real there (packets dropped by nftables rules, :mod:`traces.netns`),
and the relay's loss model is off.

A link's ``conditions()`` name its loss mechanism: :data:`MODELLED_LOSS` (this model),
:data:`traces.nft_loss.REAL_LOSS` (real drops) or :data:`NO_LOSS`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from sakura.traces.errors import LinkError

#: A realistic 5G round-trip time (ms), the default of every emulated link the product
#: starts (shaped edits, the replay, the demo).
DEFAULT_RTT_MS = 30.0
MTU_BYTES = 1500
#: ``loss_mechanism`` of a link whose loss is this module's model (the paced link, and the
#: kernel link's relay when asked to model loss)
MODELLED_LOSS = ("modelled in the proxy: retransmission delay (capacity spent again, one RTT "
                 "of in-order delay per lost packet), no RTO or congestion-window reaction")
#: ``loss_mechanism`` of a link without loss
NO_LOSS = "none"


@dataclass(frozen=True)
class Impairment:
    """What a link adds to its rate: per-direction delay and a packet loss rate."""

    rtt_ms: float = DEFAULT_RTT_MS
    loss: float = 0.0
    #: Share of the round trip on the downstream (server -> client) direction.
    down_share: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rtt_ms) and 0 <= self.rtt_ms <= 10_000):
            raise LinkError(f"rtt_ms must be in [0, 10000] ms, got {self.rtt_ms}")
        if not (math.isfinite(self.loss) and 0 <= self.loss < 0.5):
            raise LinkError(f"loss must be a rate in [0, 0.5), got {self.loss}")
        if not 0 <= self.down_share <= 1:
            raise LinkError(f"down_share must be in [0, 1], got {self.down_share}")

    @classmethod
    def none(cls) -> Impairment:
        """No delay, no loss: the bottleneck alone."""
        return cls(rtt_ms=0.0)

    @property
    def active(self) -> bool:
        return self.rtt_ms > 0 or self.loss > 0

    @property
    def rtt_s(self) -> float:
        return self.rtt_ms / 1000.0

    @property
    def down_s(self) -> float:
        """One-way delay server -> client, seconds."""
        return self.rtt_s * self.down_share

    @property
    def up_s(self) -> float:
        """One-way delay client -> server, seconds."""
        return self.rtt_s - self.down_s

    def to_dict(self) -> dict[str, Any]:
        """What a record states about the link's delay and loss."""
        d = asdict(self)
        d["down_ms"] = self.down_s * 1000.0
        d["up_ms"] = self.up_s * 1000.0
        d["loss_model"] = ("retransmission: capacity spent again and one RTT of in-order "
                           "delay per lost packet; no RTO or congestion-window reaction"
                           if self.loss > 0 else "none")
        return d


class LossModel:
    """Independent per-packet loss with a seeded generator (one per link)."""

    def __init__(self, loss: float, seed: int = 0) -> None:
        self.loss = float(loss)
        self._rng = random.Random(seed)

    def lost_packets(self, nbytes: int) -> int:
        """How many of the MTU-sized packets carrying ``nbytes`` are lost."""
        if self.loss <= 0 or nbytes <= 0:
            return 0
        packets = -(-nbytes // MTU_BYTES)
        rng, p = self._rng, self.loss
        return sum(1 for _ in range(packets) if rng.random() < p)


class DelayLine:
    """Delivers chunks to ``writer`` in order, each no earlier than its due time.

    ``put`` waits while more than ``max_bytes`` are queued (back-pressure towards the
    reader when nothing else paces it). ``flush`` waits until everything was written.
    """

    def __init__(self, writer: asyncio.StreamWriter, max_bytes: int = 1 << 20,
                 on_write: Any = None) -> None:
        self.writer = writer
        self.max_bytes = int(max_bytes)
        self.on_write = on_write
        self._queue: collections.deque[tuple[float, memoryview | bytes]] = collections.deque()
        self._queued = 0
        self._last_due = -math.inf
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    def start(self) -> DelayLine:
        self._task = asyncio.create_task(self._run())
        return self

    async def put(self, due: float, data: memoryview | bytes) -> None:
        while self._queued > self.max_bytes and self._error is None:
            self._changed.clear()
            await self._changed.wait()
        if self._error is not None:
            raise ConnectionError(f"delay line: {self._error}")
        due = max(due, self._last_due)  # in order: nothing overtakes a delayed chunk
        self._last_due = due
        self._queue.append((due, data))
        self._queued += len(data)
        self._changed.set()

    async def flush(self) -> None:
        while self._queue and self._error is None and self._task is not None \
                and not self._task.done():
            self._changed.clear()
            await self._changed.wait()
        if self._error is not None:
            raise ConnectionError(f"delay line: {self._error}")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self) -> None:
        try:
            while True:
                while not self._queue:
                    self._changed.clear()
                    await self._changed.wait()
                due, data = self._queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._queue.popleft()
                self._queued -= len(data)
                if self.writer.is_closing():
                    raise ConnectionError("peer closed")
                self.writer.write(data)
                if self.on_write is not None:
                    self.on_write(len(data))
                self._changed.set()
                await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            self._error = exc
            self._changed.set()
