"""Rate-quality profiling of pack configurations and helpers to choose between them.

Every configuration of every shard gets ``quality``: ``weighted_err`` (importance-weighted
relative reconstruction error, cheap: from the codec when it knows it in closed form, else
by decoding), ``kv_db`` (the same as ``-10 log10``) and ``psnr_db`` (output PSNR against
``exact`` on the template's profiling requests, from the builder's ``quality_fn``; null
without a model). ``pareto`` marks the configurations no other configuration of the shard
beats on both bytes and quality (quality = ``psnr_db`` when every config has it, else
``kv_db``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sakura.codec.base import Codec, EncodedShard
from sakura.codec.metrics import DEFAULT_FLOOR, err_to_db, weighted_rel_error
from sakura.codec.shards import ShardData


def profile_config(
    codec: Codec,
    shard: ShardData,
    encoded: EncodedShard,
    index: int,
    quality_fn: Any = None,
    floor: float | None = None,
) -> dict[str, float | None]:
    """Quality of configuration ``index`` of an encoded shard (decoding it only when the
    codec has no closed-form weighted error or a ``quality_fn`` needs the tensors)."""
    cfg = encoded.configs[index]
    floor = DEFAULT_FLOOR if floor is None else floor
    err = cfg.weighted_err if floor == DEFAULT_FLOOR else None
    decoded = None
    if err is None or quality_fn is not None:
        decoded = codec.decode(cfg.params, encoded.config_data(index), shard.spec)
    if err is None:
        err = weighted_rel_error(shard.matrices, decoded, shard.importance, floor)
    psnr = None
    if quality_fn is not None:
        value = quality_fn(shard.spec.index, cfg.params, decoded)
        psnr = None if value is None else float(value)
    return {
        "weighted_err": float(f"{err:.6g}"),
        "kv_db": round(err_to_db(err), 3),
        "psnr_db": None if psnr is None else round(psnr, 3),
    }


def decode_ms(codec: Codec, shard: ShardData, encoded: EncodedShard, index: int) -> float:
    """Measured time of one decode of configuration ``index``, in ms."""
    cfg = encoded.configs[index]
    data = encoded.config_data(index)
    t0 = time.perf_counter()
    codec.decode(cfg.params, data, shard.spec)
    return round((time.perf_counter() - t0) * 1e3, 3)


def quality_score(quality: dict[str, Any], metric: str | None = None) -> float:
    """Higher-is-better score of a config's quality (``psnr_db`` if present, else ``kv_db``)."""
    if metric is None:
        metric = "psnr_db" if quality.get("psnr_db") is not None else "kv_db"
    if metric == "weighted_err":
        return -float(quality["weighted_err"])
    if metric == "kv_db" and quality.get("kv_db") is None:
        return err_to_db(float(quality["weighted_err"]))
    value = quality.get(metric)
    return float("-inf") if value is None else float(value)


def mark_pareto(configs: list[Any]) -> None:
    """Set ``pareto`` on the non-dominated configs (fewer bytes or better quality)."""
    metric = "psnr_db" if all(c.quality.get("psnr_db") is not None for c in configs) else "kv_db"
    order = sorted(configs, key=lambda c: (c.bytes, -quality_score(c.quality, metric)))
    best = float("-inf")
    for c in order:
        score = quality_score(c.quality, metric)
        c.pareto = score > best
        if c.pareto:
            best = score


def best_config_within(shard: Any, budget: float, metric: str | None = None,
                       pareto_only: bool = False) -> Any | None:
    """The highest-quality config of ``shard`` with ``bytes <= budget`` (None if none fits)."""
    fits = [c for c in shard.configs if c.bytes <= budget and (c.pareto or not pareto_only)]
    if not fits:
        return None
    return max(fits, key=lambda c: (quality_score(c.quality, metric), -c.bytes))


def select_for_ratio(
    manifest: Any, ratio: float, metric: str | None = None, carry_over: bool = True
) -> list[int] | None:
    """Per shard, in execution order, the best config within its budget, as the allocator
    chooses under a constant rate: shard ``i``'s budget is ``fp16 bytes of i / ratio`` plus,
    with ``carry_over``, what earlier shards left unused. None if some shard has no config
    within its budget (the codec cannot meet that rate)."""
    out = []
    carry = 0.0
    for s in manifest.shards:
        budget = manifest.shard_fp16_bytes(s.index) / ratio + carry
        cfg = best_config_within(s, budget, metric)
        if cfg is None:
            return None
        carry = budget - cfg.bytes if carry_over else 0.0
        out.append(cfg.id)
    return out


@dataclass(frozen=True)
class RatePoint:
    ratio: float
    """Target compression ratio versus FP16."""
    bytes: int
    """Total bytes of the chosen configurations."""
    quality: float
    """Mean quality score over shards (dB)."""


def rate_quality_curve(
    manifest: Any, ratios: list[float] | None = None, metric: str | None = None
) -> list[RatePoint]:
    """Template-level rate-quality points: for each target ratio, the per-shard best
    configs within budget, their total bytes and mean quality (for plots)."""
    ratios = ratios or [2, 3, 4, 5, 7, 10, 15, 20, 30, 50, 75, 100]
    points = []
    for r in ratios:
        choice = select_for_ratio(manifest, r, metric)
        if choice is None:
            continue
        cfgs = [s.config(c) for s, c in zip(manifest.shards, choice)]
        total = sum(c.bytes for c in cfgs)
        quality = sum(quality_score(c.quality, metric) for c in cfgs) / len(cfgs)
        points.append(RatePoint(ratio=float(r), bytes=total, quality=quality))
    return points


def shard_curve(manifest: Any, shard: int, metric: str | None = None) -> list[tuple[int, float]]:
    """``(bytes, quality)`` of the Pareto configs of one shard, by bytes."""
    s = manifest.shard(shard)
    return sorted((c.bytes, quality_score(c.quality, metric)) for c in s.configs if c.pareto)
