"""Confidence intervals for benchmark figures: pure functions over counts and samples.

- `wilson_interval(k, n)`: the Wilson score interval of a proportion (SLO attainment of one
  rate point: k of n requests met the SLO). Unlike the normal approximation it stays inside
  [0, 1] and is honest at k = n, where most of our passing points sit.
- `spread(values)`: mean, sample standard deviation, min and max (goodput over seeds).
- `bootstrap_interval(draw, ...)`: the percentile interval of a statistic recomputed on
  resampled data; `draw(rng)` does one resample and returns the statistic.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import numpy as np

DEFAULT_CONFIDENCE = 0.95


def z_score(confidence: float) -> float:
    """The two-sided standard-normal quantile: 1.96 for 0.95."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(
    successes: int, n: int, confidence: float = DEFAULT_CONFIDENCE
) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion `successes / n`."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    z = z_score(confidence)
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # The bounds at k = 0 and k = n are exactly 0 and 1; computed, they miss by rounding.
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, sample standard deviation (None below two values), min and max."""
    if not values:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
    }


def bootstrap_interval(
    draw: Callable[[np.random.Generator], float],
    num_resamples: int = 2000,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval: the central `confidence` share of `num_resamples`
    values of `draw(rng)` (each call resamples the data and recomputes the statistic).
    Non-finite draws (e.g. a ratio over a zero) are dropped; all of them -> (nan, nan)."""
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be positive, got {num_resamples}")
    z_score(confidence)  # validates
    rng = np.random.default_rng(seed)
    values = np.array([draw(rng) for _ in range(num_resamples)], dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)
