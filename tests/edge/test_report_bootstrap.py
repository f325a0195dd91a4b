"""The replay report's bootstrap intervals (scipy.stats.bootstrap, percentile method,
seeded): properties every resample guarantees, not particular numbers."""

from __future__ import annotations

import math

import numpy as np
from sakura.edge.replay.stats import boot_ci, boot_ratio_ci


def test_interval_of_a_percentile_lies_in_the_data_and_is_seeded():
    rng = np.random.default_rng(3)
    for n in (2, 5, 40):
        x = rng.gamma(2.0, 0.3, n)
        lo, hi = boot_ci(x, 90)
        assert x.min() <= lo <= hi <= x.max()
        assert boot_ci(x, 90) == (lo, hi)  # same seed, same interval
    assert boot_ci([0.5, 0.5, 0.5], 50) == (0.5, 0.5)
    assert all(math.isnan(v) for v in boot_ci([1.0], 50))


def test_ratio_interval_is_bounded_by_the_extreme_ratios():
    rng = np.random.default_rng(4)
    a, d = rng.gamma(2.0, 0.5, 30), rng.gamma(2.0, 0.2, 25)
    lo, hi = boot_ratio_ci(a, d, 90)
    assert a.min() / d.max() <= lo <= hi <= a.max() / d.min()
    assert all(math.isnan(v) for v in boot_ratio_ci([1.0], d, 90))
