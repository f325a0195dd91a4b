"""What the pipeline keeps of each shard: its record, a transfer on the wire, a wait.

:class:`ShardRecord` is one shard's way through an edit (stage times relative to the edit's
start, bytes, configuration, the window and rate the allocator saw, and the deadline events:
truncation, hedges, damage, the local fallback, stale reuse, refinements). The native
runtime's records have the same fields (``tests/edge/test_record_parity.py``), so
:func:`stats_of` summarises the timeline of either runtime.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

from sakura.edge.transfer import Transfer

STALL_EPS_S = 1e-3  # waits shorter than this are scheduling noise, not stalls


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
    quiet_since: float | None = None  # (outage) since when the link had carried nothing, as
                                      # the rule counted it (its last byte, or transfers out)
    refinements: int = 0          # extensions of its received configuration (refinement)
    stale_from: int | None = None  # its step ran on this earlier step's K/V (stale reuse)
    # never requested: the stale plan ran it on its group's kept K/V (edge/stale_plan.py)
    planned_stale: bool = False
    # never requested: its choice was not worth its bytes and its group held no recent K/V,
    # so the stale plan had its step recomputed on the device (edge/stale_plan.py)
    planned_local: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class InFlight:
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
class ShardWait:
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
    planned_stale: int = 0  # shards never requested: run on their group's K/V (stale plan)
    planned_local: int = 0  # shards never requested: their step recomputed (stale plan)


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
        refinements=sum(int(r.get("refinements") or 0) for r in records),
        planned_stale=sum(1 for r in records if r.get("planned_stale")),
        planned_local=sum(1 for r in records if r.get("planned_local")))
