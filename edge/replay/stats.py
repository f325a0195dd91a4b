"""The numbers of a group of replay runs: percentiles with bootstrap intervals, PSNR means,
the policy order and the run groups every part of the report reads.

Latency percentiles are linear-interpolated (numpy) and come with their sample count and a
95% bootstrap confidence interval (``scipy.stats.bootstrap``, percentile method, seeded);
latency CDFs show ``n`` and a 95% Dvoretzky-Kiefer-Wolfowitz band (:func:`dkw_eps`). PSNR
of identical images (``fp16`` vs ``exact``) is infinite: a group whose every image is
identical is reported as ``inf`` (``identical``); a group with some identical images
averages them as ``PSNR_CAP`` dB and says how many (:func:`psnr_mean`).

"Main" runs (:func:`is_main`) are the workload templates at their catalog resolution with
their own packs; ``sakura-d<m>`` runs are sakura's operating points (:func:`is_point`), not
systems of their own.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
from sakura.edge.replay.results import number
from scipy import stats

PSNR_CAP = 100.0
POLICY_ORDER = ("sakura", "svd", "intq", "cachegen", "fp16", "local", "sakura-fixed-config",
                "sakura-fixed-bits")
BOOTSTRAP = 1000


def psnr_value(x: Any) -> float | None:
    v = number(x)
    return None if v is None else min(v, PSNR_CAP)


def pct(values: Iterable[float], q: float) -> float:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else math.nan


def mean(values: Iterable[float]) -> float:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return float(arr.mean()) if arr.size else math.nan


def psnr_mean(values: Iterable[Any]) -> tuple[float, int, int]:
    """(mean PSNR in dB, identical images, images): ``inf`` when every image is identical,
    else identical ones count as ``PSNR_CAP`` (the report says how many)."""
    vals = [number(v) for v in values]
    vals = [v for v in vals if v is not None]
    if not vals:
        return math.nan, 0, 0
    n_inf = sum(1 for v in vals if math.isinf(v))
    if n_inf == len(vals):
        return math.inf, n_inf, len(vals)
    return float(np.mean([min(v, PSNR_CAP) for v in vals])), n_inf, len(vals)


def boot_ci(values: Iterable[float], q: float, *, seed: int = 0, b: int = BOOTSTRAP
            ) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the ``q``-th percentile (NaNs when n < 2)."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size < 2:
        return math.nan, math.nan
    res = stats.bootstrap((arr,), lambda x, axis: np.percentile(x, q, axis=axis),
                          n_resamples=b, method="percentile", vectorized=True,
                          rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def boot_ratio_ci(num: Iterable[float], den: Iterable[float], q: float, *, seed: int = 0,
                  b: int = BOOTSTRAP) -> tuple[float, float]:
    """95% bootstrap interval of ``pct(num, q) / pct(den, q)`` (both resampled)."""
    a = np.asarray(list(num), dtype=np.float64)
    d = np.asarray(list(den), dtype=np.float64)
    if a.size < 2 or d.size < 2:
        return math.nan, math.nan
    res = stats.bootstrap(
        (a, d), lambda x, y, axis: (np.percentile(x, q, axis=axis)
                                    / np.percentile(y, q, axis=axis)),
        n_resamples=b, method="percentile", vectorized=True, paired=False,
        rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def dkw_eps(n: int, alpha: float = 0.05) -> float:
    """Half-width of the (1 - alpha) Dvoretzky-Kiefer-Wolfowitz band of an empirical CDF."""
    return math.sqrt(math.log(2.0 / alpha) / (2.0 * n)) if n else 1.0


def policy_order(policies: Iterable[str]) -> list[str]:
    """Policies in the report's order (``POLICY_ORDER``), unknown ones after, sorted."""
    ps = set(policies)
    known = [p for p in POLICY_ORDER if p in ps]
    return known + sorted(ps - set(known))


def is_point(rec: dict[str, Any]) -> bool:
    """A ``sakura-d<m>`` run: an operating point of sakura, not a system of its own."""
    return rec.get("deadline_s") is not None or rec["policy"].startswith("sakura-d")


def is_main(rec: dict[str, Any]) -> bool:
    return (rec["template"] == rec["base_template"] and rec.get("variant", "main") == "main"
            and not is_point(rec))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [r["latency_s"] for r in runs]
    pe = [psnr_value(r.get("psnr_exact")) for r in runs]
    pf = [psnr_value(r.get("psnr_full")) for r in runs]
    pe_mean, pe_inf, _ = psnr_mean(r.get("psnr_exact") for r in runs)
    pf_mean, pf_inf, _ = psnr_mean(r.get("psnr_full") for r in runs)
    return {
        "n": len(runs), "p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99),
        "p50_ci": boot_ci(lat, 50), "p90_ci": boot_ci(lat, 90), "p99_ci": boot_ci(lat, 99),
        "mb": mean(r["bytes"] / 1e6 for r in runs),
        "stalls": mean(r["stalls"] for r in runs),
        "stall_s": mean(r["stall_s"] for r in runs),
        "startup_s": mean(r.get("startup_s") for r in runs),
        "exec_s": mean(r.get("exec_s") for r in runs),
        "psnr_exact": pe_mean, "psnr_exact_identical": pe_inf,
        "psnr_full_identical": pf_inf,
        "psnr_exact_p10": pct(pe, 10),
        "ssim_exact": mean(r.get("ssim_exact") for r in runs),
        "ssim_exact_p10": pct([r.get("ssim_exact") for r in runs], 10),
        "psnr_full": pf_mean, "psnr_full_p10": pct(pf, 10),
        "ssim_full": mean(r.get("ssim_full") for r in runs),
    }


def group(runs: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        out[tuple(r[k] for k in keys)].append(r)
    return dict(out)
