"""What one edit produced and how it went: :class:`EditResult` (the image, the latency, the
shard timeline, the deadline events, what quality the received bytes promise) and its JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from sakura.edge.quality import psnr, ssim


@dataclass
class EditResult:
    """What one edit produced and how it went (times in seconds)."""

    image: torch.Tensor
    policy: str
    codec: str | None
    latency_s: float
    bytes: int = 0
    manifest_bytes: int = 0
    stalls: int = 0
    stall_s: float = 0.0
    truncations: int = 0   # shards executed from the prefix received by their deadline
    hedges: int = 0        # transfers re-requested on a fresh connection
    local_fallbacks: int = 0  # steps computed on the device while no shard could arrive
    # of the late steps (local fallbacks and stale steps), those begun at once because the
    # link had carried no byte for one local step while requests were out (outage
    # evidence), not after waiting one out
    outage_fallbacks: int = 0
    # late steps run on each block's last K/V instead (stale reuse, dit/stale.py)
    stale_steps: int = 0
    # shards never requested: the stale plan ran them on their group's recent K/V (a planned
    # choice, counted in stale_steps too; edge/stale_plan.py)
    planned_stale: int = 0
    # shards never requested because their step was recomputed on the device instead (the
    # stale plan with no recent K/V: counted in local_fallbacks too)
    planned_local: int = 0
    # received configurations extended by one more range of the pack before their shard
    # ran (prefix refinement: the link was faster than the choice assumed)
    refinements: int = 0
    startup_s: float = 0.0
    startup_allowance_s: float = 0.0
    configs: list[int | None] = field(default_factory=list)
    params: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)  # set-up (timeline.setup_phases)
    predicted_exec_s: list[float] = field(default_factory=list)
    exec_s: float = 0.0
    requests: int = 0
    psnr_db: float | None = None
    ssim: float | None = None
    warnings: list[str] = field(default_factory=list)
    # what the edit received (edge.quality.received_quality): its share of the pack's
    # full-quality bytes, the PSNR vs exact the pack's profile predicts (None: no profile),
    # and how many shards ran below their largest configuration (link rate, deadline, or
    # a policy that fixes the configuration)
    full_quality_byte_fraction: float | None = None
    psnr_estimate_db: float | None = None
    shards_below_largest: int = 0
    limited_by_policy: int = 0  # of those, at the most the policy chooses (not the link)

    def quality_line(self) -> str | None:
        """One line on what quality the edit got (None for ``local``, which streams
        nothing)."""
        if self.full_quality_byte_fraction is None:
            return None
        text = f"{self.full_quality_byte_fraction:.3f} of full-quality bytes"
        est = self.psnr_estimate_db
        local = self.local_fallbacks
        if est is None and local and local == len({r["step"] for r in self.timeline}):
            text += "; every step computed on the device: no estimate from the pack's profile"
        elif est is None:
            text += "; no PSNR profile in the pack"
        else:
            # shards that ran on earlier K/V (stale reuse, the stale plan) have no profile
            # either: the estimate is over the shards that ran on their own bytes
            stale = sum(1 for r in self.timeline
                        if r.get("config") is None and not r.get("local"))
            left_out = ([f"{local} steps computed on the device"] if local else []) + (
                [f"{stale} shards run on earlier K/V"] if stale else [])
            text += (f"; PSNR vs exact ~{'inf' if math.isinf(est) else f'{est:.1f}'} dB "
                     "(estimated from the pack's profile"
                     + (f", over the streamed shards: {' and '.join(left_out)} are not "
                        "in it)" if left_out else ")"))
        if self.shards_below_largest:
            by_link = self.shards_below_largest - self.limited_by_policy
            why = []
            if by_link:
                why.append(f"{by_link} by the link: sized to its rate estimate, "
                           f"{self.truncations} of them truncated at their deadline")
            if self.limited_by_policy:
                why.append(f"{self.limited_by_policy} by the policy {self.policy}, at the "
                           "most it chooses")
            text += (f"; limited: {self.shards_below_largest} of {len(self.configs)} "
                     f"shards below their largest configuration ({'; '.join(why)})")
        return text

    def compare(self, exact: torch.Tensor) -> EditResult:
        self.psnr_db = psnr(self.image, exact)
        self.ssim = ssim(self.image, exact)
        return self

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "codec": self.codec, "latency_s": self.latency_s,
            "bytes": self.bytes, "manifest_bytes": self.manifest_bytes,
            "stalls": self.stalls, "stall_s": self.stall_s, "startup_s": self.startup_s,
            "truncations": self.truncations, "hedges": self.hedges,
            "local_fallbacks": self.local_fallbacks,
            "outage_fallbacks": self.outage_fallbacks,
            "stale_steps": self.stale_steps, "planned_stale": self.planned_stale,
            "planned_local": self.planned_local,
            "refinements": self.refinements,
            "startup_allowance_s": self.startup_allowance_s,
            "exec_s": self.exec_s, "requests": self.requests,
            "configs": self.configs, "params": self.params,
            "psnr_db": _finite(self.psnr_db), "ssim": self.ssim,
            "warnings": self.warnings, "phases": self.phases,
            "full_quality_byte_fraction": self.full_quality_byte_fraction,
            "psnr_estimate_db": _finite(self.psnr_estimate_db),
            "shards_below_largest": self.shards_below_largest,
            "limited_by_policy": self.limited_by_policy,
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.summary(), "predicted_exec_s": self.predicted_exec_s,
                "timeline": self.timeline}


def _finite(x: float | None) -> float | str | None:
    if x is not None and math.isinf(x):
        return "inf"
    return x
