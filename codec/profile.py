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

import math
import time
from dataclasses import dataclass
from typing import Any

from sakura.codec.base import Codec, EncodedShard
from sakura.codec.metrics import DEFAULT_FLOOR, err_to_db, weighted_rel_error
from sakura.codec.shards import ShardData, shard_data

from sakura.atomic import write_atomic


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


# ---------------------------------------------------------------------------- fitted PSNR


class FittedPSNR:
    """A cheap output-PSNR profile: measure a subset, fit a model per step, predict all.

    A ``quality_fn`` for ``write_pack`` wrapping a measuring one
    (``cloud.psnr_profile.OutputPSNR``: one resumed edit per call). Before the first
    configuration is profiled, on ``sample_steps`` evenly spread steps the step's first
    shard is encoded with ``codec`` and some of its configurations are measured: per bit
    width the ones with the smallest and the largest KV error and between them any at least
    ``spacing_db`` from those already chosen, at most ``max_per_shard`` (so the cost is
    bounded by the KV-error range, not by how many configurations a pack offers:
    ``sakura-all`` has every rank at every bit width). A step's model is a least-squares
    fit of the measured PSNR on the configuration's importance-weighted KV error (dB) and,
    when the codec has one, at least 6 points are measured and leave-one-out
    cross-validation on them prefers it, its bit width: ``psnr = a + b kv_db (+ c bits)``;
    a negative ``b`` (noise: a more faithful cache never makes a worse image) falls back to
    the mean, so ties are ranked by the KV error. **Every** configuration,
    measured ones included, gets its model's prediction (the model of the nearest sampled
    step at or before its step), within [0, 200] dB: the measurement of one changed shard
    is noisy (a bigger configuration can measure lower), and a noisy value in the manifest
    would make the Pareto front drop a shard's large configurations for good. Why a fit and
    not the KV error alone: the allocator ranks a shard's configurations by quality, and a
    monotone map of the KV error ranks them exactly as the KV error does; the bit-width term
    is what can reorder them (quantisation noise and rank truncation with the same KV error
    need not cost the image the same). A codec with one configuration per shard gets no
    profile (nothing to rank).

    ``cache_dir``: measured values are kept in ``<cache_dir>/<key>.json`` per ``key`` (the
    caller's hash of weights, template content, codec and options) and reused by the next
    build of the same pack. ``stats`` says what was measured, reused and fitted, and each
    step model's terms and leave-one-out error.
    """

    #: bump when the profile's values change for the same measurements (part of the
    #: builder's content hash, so up-to-date packs are rebuilt)
    VERSION = 2

    def __init__(self, measure: Any, layout: Any, cache: Any, codec: Any, *,
                 sample_steps: int = 3, spacing_db: float = 3.0, max_per_shard: int = 12,
                 cache_dir: str | None = None, key: str = "") -> None:
        import json
        from pathlib import Path

        if sample_steps < 1 or max_per_shard < 2 or not spacing_db >= 0:
            raise ValueError("sample_steps >= 1, max_per_shard >= 2 and spacing_db >= 0")
        self.measure, self.layout, self.cache, self.codec = measure, layout, cache, codec
        self._shard_data = shard_data
        steps = layout.steps
        n = min(sample_steps, steps)
        self.sampled_steps = sorted({round(i * (steps - 1) / max(1, n - 1)) for i in range(n)})
        self.spacing_db, self.max_per_shard = float(spacing_db), int(max_per_shard)
        self.points: dict[int, list[tuple[float, float | None, float]]] = {}
        self.models: dict[int, Any] = {}
        self._prepared = False
        self._sd: tuple[int, Any] | None = None
        self.stats: dict[str, Any] = {
            "measured": 0, "reused": 0, "fitted": 0, "sampled_steps": self.sampled_steps,
            "spacing_db": self.spacing_db, "max_per_shard": self.max_per_shard,
            "version": self.VERSION}
        self._file = Path(cache_dir) / f"{key}.json" if cache_dir and key else None
        self._memo: dict[str, float] = {}
        if self._file is not None and self._file.exists():
            try:
                self._memo = {str(k): float(v) for k, v in json.loads(
                    self._file.read_text()).items()}
            except (ValueError, OSError, AttributeError):
                self._memo = {}

    # ------------------------------------------------------------------ features
    def _features(self, sd: Any, params: dict[str, Any], decoded: list[Any]
                  ) -> tuple[float, float | None]:
        err = weighted_rel_error(sd.matrices, [t.float() for t in decoded], sd.importance)
        bits = params.get("bits")
        if isinstance(bits, (list, tuple)):
            bits = sum(bits) / len(bits) if bits else None
        return err_to_db(err), None if bits is None else float(bits)

    def _sample_step(self, step: int) -> int:
        earlier = [s for s in self.sampled_steps if s <= step]
        return earlier[-1] if earlier else self.sampled_steps[0]

    # ------------------------------------------------------------------ measuring
    def _choose(self, feats: list[tuple[float, float | None]]) -> list[int]:
        """Which configurations of a sampled shard to measure (see the class doc)."""
        groups: dict[Any, list[int]] = {}
        for j, (_, b) in enumerate(feats):
            groups.setdefault(b, []).append(j)
        chosen: list[int] = []
        for js in groups.values():  # the extremes of every bit width first
            js.sort(key=lambda j: feats[j][0])
            chosen += [js[0]] + ([js[-1]] if len(js) > 1 else [])
        for js in groups.values():
            for j in js:
                if len(chosen) >= self.max_per_shard:
                    break
                if j not in chosen and all(feats[c][1] != feats[j][1] or
                                           abs(feats[c][0] - feats[j][0]) >= self.spacing_db
                                           for c in chosen):
                    chosen.append(j)
        return sorted(chosen[: max(2, self.max_per_shard)])

    def prepare(self) -> FittedPSNR:
        """Measure the sampled shards and fit every step's model (once)."""
        import json

        if self._prepared:
            return self
        self._prepared = True
        for step in self.sampled_steps:
            shard = step * self.layout.shards_per_step
            sd = self._shard_data(self.cache, self.layout, shard)
            enc = self.codec.encode_shard(sd)
            if len(enc.configs) < 2:
                continue
            decoded = [self.codec.decode(c.params, enc.config_data(j), sd.spec)
                       for j, c in enumerate(enc.configs)]
            feats = [self._features(sd, c.params, d) for c, d in zip(enc.configs, decoded)]
            for j in self._choose(feats):
                params = enc.configs[j].params
                key = f"{shard}:{json.dumps(params, sort_keys=True)}"
                if key in self._memo:
                    value = self._memo[key]
                    self.stats["reused"] += 1
                else:
                    value = float(self.measure(shard, params, decoded[j]))
                    self._memo[key] = value
                    self.stats["measured"] += 1
                    self._save()
                self.points.setdefault(step, []).append((*feats[j], value))
            fit = self._fit(step)
            if fit is not None:
                self.models[step] = fit[0]
        return self

    # ------------------------------------------------------------------ model
    def _fit(self, step: int) -> tuple[Any, float, float] | None:
        """Least squares on the step's measured points: ``a + b kv_db``, or with ``+ c
        bits`` when that predicts the points better in leave-one-out cross-validation (so
        the bit term reorders configurations only where the measurements support it)."""
        import numpy as np

        pts = self.points.get(step, [])
        if len(pts) < 2:
            return None
        y = np.array([p for _, _, p in pts])
        kv = np.array([[1.0, k] for k, _, _ in pts])
        candidates = [kv]
        # the bit term needs twice as many points as terms for its cross-validation to mean
        # anything (with one configuration per bit width, as intq has, it would interpolate
        # the noise)
        if (all(b is not None for _, b, _ in pts) and len({b for _, b, _ in pts}) > 1
                and len(pts) >= 6):
            candidates.append(np.column_stack([kv, [b for _, b, _ in pts]]))

        def solve(x: Any, yy: Any) -> Any:
            reg = 1e-3 * np.eye(x.shape[1])  # a small ridge keeps few points defined
            reg[0, 0] = 0.0
            return np.linalg.solve(x.T @ x + reg, x.T @ yy)

        def loo(x: Any) -> float:
            if len(y) <= x.shape[1]:
                return math.inf
            errs = [float(y[i] - x[i] @ solve(np.delete(x, i, 0), np.delete(y, i)))
                    for i in range(len(y))]
            return float(np.sqrt(np.mean(np.square(errs))))

        scores = [loo(x) for x in candidates]
        best = int(np.argmin(scores)) if any(math.isfinite(v) for v in scores) else 0
        coef = solve(candidates[best], y)
        if coef[1] < 0:
            # a more faithful cache never predicts a worse image: noise; fall back to the
            # mean (ties are then ranked by the KV error, as without a profile)
            best, coef = 0, np.array([float(y.mean()), 0.0])
        self.stats.setdefault("models", {})[str(step)] = {
            "terms": ["1", "kv_db", "bits"][: candidates[best].shape[1]],
            "loo_rmse_db": None if not math.isfinite(scores[best]) else round(scores[best], 3),
            "points": len(pts), "kv_slope": round(float(coef[1]), 3)}
        return coef, float(y.min()), float(y.max())

    def predict(self, step: int, kv_db: float, bits: float | None) -> float | None:
        coef = self.models.get(self._sample_step(step))
        if coef is None:
            return None
        value = coef[0] + coef[1] * kv_db
        if len(coef) > 2 and bits is not None:
            value += coef[2] * bits
        return float(min(max(value, 0.0), 200.0))

    # ------------------------------------------------------------------ quality_fn
    def __call__(self, shard: int, params: dict[str, Any], decoded: list[Any]) -> float | None:
        self.prepare()
        step, _ = self.layout.blocks_of(shard)
        if self._sd is None or self._sd[0] != shard:
            self._sd = (shard, self._shard_data(self.cache, self.layout, shard))
        predicted = self.predict(step, *self._features(self._sd[1], params, decoded))
        if predicted is None:
            return None  # one configuration per shard (nothing to rank): no profile
        self.stats["fitted"] += 1
        return round(predicted, 3)

    def _save(self) -> None:
        import json

        if self._file is None:
            return
        self._file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self._file, json.dumps(self._memo))
