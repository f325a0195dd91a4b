"""Image quality of an edit against a reference (``exact``): PSNR and SSIM.

Images are ``[3, H, W]`` tensors in [-1, 1] (the DiT's range); both metrics are computed
on [0, 1]. :func:`received_quality` tells what an edit received (its share of the pack's
full-quality bytes, and the PSNR the pack's profile predicts for it) without an ``exact``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch


def _unit(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"expected an image [3, H, W], got {tuple(x.shape)}")
    return ((x.detach().float().cpu() + 1) / 2).clamp(0, 1)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB (inf for identical images)."""
    mse = float(((_unit(a) - _unit(b)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """SSIM (Gaussian window of 11 pixels, 7 for images smaller than 44 pixels)."""
    from pytorch_msssim import ssim as _ssim

    x, y = _unit(a)[None], _unit(b)[None]
    win = 11 if min(x.shape[-2:]) >= 44 else 7
    return float(_ssim(x, y, data_range=1.0, win_size=win, size_average=True))


def received_quality(manifest: Mapping[str, Any], timeline: list[dict[str, Any]],
                     ceiling: Callable[[int], int] | None = None) -> dict[str, Any]:
    """What an edit received against what the pack offers, without recomputing anything.

    * ``full_quality_byte_fraction``: the sum over shards of the bytes of the configuration
      each shard ran on (the manifest's, for a truncated shard its fallback's) over the sum
      of each shard's largest configuration's bytes. Largest of the shard's Pareto front
      (``pareto``; every configuration when none is marked): that is the best one the pack
      offers, and a larger configuration off the front is no better by the pack's own
      profile, so the allocator never picks it.
      A step computed on the device (local fallback) received nothing and counts 0;
    * ``psnr_estimate_db``: the output PSNR vs ``exact`` predicted from the pack's
      per-configuration profile (``quality.psnr_db``: the output PSNR of the profiling
      requests with only that shard changed, ``cloud/psnr_profile.py``). The per-shard
      output MSEs ``10^(-psnr_db / 10)`` are summed (errors of different shards add to first
      order: the allocator's lookahead objective, ``edge/lookahead.py``) and the sum turned
      back into dB; a locally computed step is not in it (the line says how many were), and
      when every step ran locally there is no estimate. None when any shard the edit ran
      on lacks the profile. Its error against measured PSNR (``docs/bench/quality-estimate.
      json``, ``scripts/quality_estimate.py``, face-technologist): |error| 4.6 dB median,
      11.9 dB worst on the profiling prompts, low at small rates (the shards' errors partly
      cancel), high near full quality (an error floor the per-shard profile misses);
    * ``shards_below_largest``: shards that ran on fewer bytes than that largest
      configuration, of which ``limited_by_policy`` ran on the most the policy ever chooses
      for the shard (``ceiling(shard)``, the allocator's: fixed bits or configuration), and
      the others were limited by the link (the allocator sized them to its rate estimate,
      or ``truncated_below_largest`` of them were cut at their deadline); without a
      ``ceiling`` every one counts as the link's; ``shards``: all of them.
    """
    by_index = {int(s["index"]): s for s in manifest.get("shards", [])}
    got = full = 0
    mse = 0.0
    profiled = bool(timeline)
    below = truncated = local = by_policy = 0
    for r in timeline:
        shard = by_index.get(int(r["shard"]))
        if shard is None or not shard.get("configs"):
            raise ValueError(f"shard {r['shard']} is not in the manifest")
        configs = {int(c["id"]): c for c in shard["configs"]}
        front = [c for c in configs.values() if c.get("pareto", True)] or list(configs.values())
        largest = max(int(c["bytes"]) for c in front)
        full += largest
        if r.get("local") or r.get("config") is None:
            local += 1
            continue
        cfg = configs[int(r["config"])]
        got += int(cfg["bytes"])
        if int(cfg["bytes"]) < largest:
            below += 1
            truncated += bool(r.get("truncated"))
            cap = ceiling(int(r["shard"])) if ceiling is not None else None
            by_policy += (cap is not None and not r.get("truncated")
                          and int(cfg["bytes"]) >= int(configs[int(cap)]["bytes"]))
        db = (cfg.get("quality") or {}).get("psnr_db")
        if db is None:
            profiled = False
        elif math.isfinite(float(db)):
            mse += 10.0 ** (-float(db) / 10.0)
    estimate = None
    # a step computed on the device has no profile (its error against exact is not the
    # pack's to predict): an edit that streamed nothing has no estimate, and one that
    # streamed some shards has the estimate of those (the console line says so)
    if profiled and local < len(timeline):
        estimate = math.inf if mse == 0 else -10.0 * math.log10(mse)
    return {"full_quality_byte_fraction": got / full if full else None,
            "psnr_estimate_db": estimate, "shards_below_largest": below,
            "truncated_below_largest": truncated, "limited_by_policy": by_policy,
            "local_shards": local,
            "shards": len(timeline)}
