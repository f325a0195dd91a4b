"""The token bucket (``tc`` ``tbf``) that shapes the kernel link: its settings for a rate.

Rate changes and tbf: trace rates are goodput, tbf counts Ethernet frames, so tbf runs at
``rate x 1514/1448`` (full TCP segments with timestamps). ``tc qdisc change`` refills the
token bucket to ``burst`` and keeps queued packets, so the rate of each run of equal slices
is lowered by the refill it grants (``burst`` minus the half frame a backlogged bucket holds
on average, spread over the run: :meth:`TbfShape.params`). ``tc change`` does not re-arm
tbf's watchdog, so after every change one 1-byte UDP datagram is sent to the client side
(:data:`KICK_PORT`) to make tbf dequeue at once. An outage (rate 0) sets tbf to 8 bit/s
with a one-frame burst: packets stay queued (nothing is dropped) and nothing is delivered;
the switch is made early by the tc latency and the time of the one frame the refill lets
out, so that frame belongs to the previous slice.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

PACKET_BYTES = 1514  # what tbf counts for a full-size Ethernet frame on veth
OUTAGE_RATE_BPS = 8  # tbf needs a non-zero rate; with a sub-packet burst nothing passes
KICK_PORT = 9  # discard: nothing listens; the kick only makes tbf dequeue


@dataclass(frozen=True)
class TbfSetting:
    """One tbf configuration as applied at a wall time."""

    wall: float
    rate_bps: float
    tbf_rate_bps: int
    burst_bytes: int
    limit_bytes: int


@dataclass(frozen=True)
class TbfShape:
    """How a goodput rate becomes tbf's rate, burst and queue limit. ``burst_s``: the burst
    in seconds of the rate (at least ``min_burst_bytes``); ``queue_s``: the queue limit in
    seconds of the rate (at least ``min_queue_bytes``); ``overhead``: wire bytes per goodput
    byte; ``compensate_burst``: lower the rate by the refill each change grants."""

    burst_s: float
    queue_s: float
    min_queue_bytes: int
    compensate_burst: bool
    overhead: float
    min_burst_bytes: int

    def params(self, rate_bps: float, run_s: float) -> tuple[int, int, int]:
        """(tbf rate bit/s, burst bytes, queue limit bytes) for ``rate_bps`` of goodput held
        for ``run_s`` seconds (until the rate next changes)."""
        if rate_bps <= 0:
            # Burst of exactly one frame: the refill on change lets at most that frame out,
            # and the switch is made early enough for it to belong to the previous slice.
            return OUTAGE_RATE_BPS, PACKET_BYTES, self.limit(0.0)
        wire = rate_bps * self.overhead
        burst = int(max(self.min_burst_bytes, wire * self.burst_s / 8.0))
        tbf_rate = wire
        if self.compensate_burst and math.isfinite(run_s) and run_s > 0:
            # The refill adds the burst minus what the bucket already held (on average
            # half a frame when backlogged).
            extra = burst - PACKET_BYTES / 2
            tbf_rate = max(wire - 8.0 * extra / run_s, wire * 0.5)
        return max(OUTAGE_RATE_BPS, int(round(tbf_rate))), burst, self.limit(wire)

    def limit(self, wire_bps: float) -> int:
        """The queue limit in bytes at ``wire_bps`` on the wire."""
        return int(max(self.min_queue_bytes, wire_bps * self.queue_s / 8.0))


def tc_tbf(ns: str, dev: str, verb: str, rate: int, burst: int, limit: int, handle: str
           ) -> list[str]:
    """The ``tc`` command that adds / changes / replaces the root tbf of ``dev`` in ``ns``."""
    return [
        "tc", "-n", ns, "qdisc", verb, "dev", dev, "root",
        "handle", handle, "tbf", "rate", f"{rate}bit", "burst", str(burst),
        "limit", str(limit),
    ]  # fmt: skip


def parse_qdisc_stats(text: str) -> dict[str, int]:
    """tbf counters from ``tc -s qdisc show``: sent bytes/packets, drops, backlog bytes."""
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


#: How long tbf may hold a backlog without sending a byte before the link calls it stuck
#: (:func:`tbf_stuck`). Found on 2026-12-07 with ``scripts/stall_capture.py`` on the breadth
#: replay's one failed FP16 run (tryon-tuxedo, mixed start #6): tbf kept 231 packets
#: (72 KB) queued for 30 s at a rate that drains that in well under a second, sending
#: nothing, while the rate thread changed its
#: rate every 0.25 s and kicked it after each change. The cause, by every sign (the packet at
#: the head of the queue was not seen directly): the server's veth handed tbf
#: GSO packets of several frames; one queued under a fast slice's larger burst
#: could never leave once a lower rate's smaller burst was set (tbf only checks a packet
#: against its burst on enqueue). So the link sets ``gso_max_segs 1`` on that veth
#: (``netns.KernelShapedLink.start``): 0 stuck in 32 runs of that start, against 9 in 47
#: before (5 in 39 without this watch, 4 in 8 with it). The watch stays as the net for any
#: other cause: a run it fires in is a fault of the emulator, retaken.
STUCK_S = 1.0


def tbf_stuck(before: dict[str, int], after: dict[str, int], min_tbf_rate_bps: float,
              elapsed_s: float) -> str:
    """Why tbf is stuck between two ``tc -s`` readings ``elapsed_s`` apart ('' if not): a
    backlog at both, not one byte sent, though at its lowest rate in between the bucket
    earns a full frame at least twice over (an outage's 8 bit/s never qualifies)."""
    if not before or not after or elapsed_s < STUCK_S:
        return ""
    if before.get("backlog_bytes", 0) <= 0 or after.get("backlog_bytes", 0) <= 0:
        return ""
    if after.get("sent_bytes", 0) != before.get("sent_bytes", 0):
        return ""
    if min_tbf_rate_bps * elapsed_s < 2 * 8 * PACKET_BYTES:
        return ""
    return (f"tbf stopped dequeuing: {after['backlog_bytes']} B queued, nothing sent in "
            f"{elapsed_s:.1f} s at {min_tbf_rate_bps / 1e6:.2f} Mbit/s or more")
