"""Where SLO attainment falls below the target: the knee search and goodput, pure.

Goodput (DistServe): the largest arrival rate at which at least `target` of requests meet
their SLOs. `find_knee(attainment_at, ...)` probes rates through a supplied function:

1. bracket: from `rate_start`, double while the rate passes (attainment >= target), or
   halve while it fails, until one passing and one failing rate are known;
2. bisect the bracket `[last passing, first failing]` until its width is at most
   `tolerance` x its upper end (or `max_points` probes are spent).

`interpolate_goodput` turns the probed `(rate, attainment)` points into the goodput (the
first downward crossing, linearly interpolated). `resampled_goodput` redraws every point's
attainment from its request counts and the runs (seeds) themselves, for bootstrap intervals
of goodput and of goodput ratios (`bench/stats.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_TARGET = 0.9
# Halving from rate_start stops this many halvings down: a server failing there is broken.
MAX_HALVINGS = 10


@dataclass(frozen=True, slots=True)
class GoodputEstimate:
    """The interpolated goodput and the rates that bracket it."""

    goodput: float  # requests/s
    low_rate: float  # highest rate meeting the target before the crossing (0 if none)
    high_rate: float | None  # first rate below the target; None if no point failed
    bracketed: bool  # False: every point met the target, goodput is a lower bound


def interpolate_goodput(
    points: Sequence[tuple[float, float]], target: float = DEFAULT_TARGET
) -> GoodputEstimate:
    """Goodput from `(rate, attainment)` points, at the first downward crossing of `target`.

    Between the bracketing points `(r0, a0)` (a0 >= target) and `(r1, a1)` (a1 < target):
    `r0 + (a0 - target) / (a0 - a1) * (r1 - r0)`. Below the lowest point, `(0, 1)` is used.
    """
    low_rate, low_attainment = 0.0, 1.0
    for rate, value in sorted(points):
        if value < target:
            fraction = (low_attainment - target) / (low_attainment - value)
            goodput = low_rate + fraction * (rate - low_rate)
            return GoodputEstimate(goodput, low_rate, rate, bracketed=True)
        low_rate, low_attainment = rate, value
    return GoodputEstimate(low_rate, low_rate, None, bracketed=False)


@dataclass(frozen=True, slots=True)
class KneeSearch:
    """The probed points in probe order, and the goodput they give."""

    points: list[tuple[float, float]]  # (rate, attainment)
    estimate: GoodputEstimate
    converged: bool  # the bracket narrowed to the tolerance within max_points


def find_knee(
    attainment_at: Callable[[float], float],
    rate_start: float,
    target: float = DEFAULT_TARGET,
    tolerance: float = 0.1,
    max_points: int = 10,
) -> KneeSearch:
    """Probe rates (see the module docstring) until the knee is bracketed to `tolerance`."""
    if rate_start <= 0:
        raise ValueError(f"rate_start must be positive, got {rate_start}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if max_points < 1:
        raise ValueError(f"max_points must be at least 1, got {max_points}")
    points: list[tuple[float, float]] = []
    passing: float | None = None  # highest rate known to pass below `failing`
    failing: float | None = None  # lowest rate known to fail
    rate = rate_start
    while len(points) < max_points:
        value = attainment_at(rate)
        points.append((rate, value))
        if value >= target:
            passing = rate
            if failing is not None:
                break
            rate *= 2
        else:
            failing = rate
            if passing is not None or rate < rate_start / 2**MAX_HALVINGS:
                break
            rate /= 2

    def narrow_enough() -> bool:
        return (
            passing is not None
            and failing is not None
            and failing - passing <= (tolerance * failing)
        )

    while passing is not None and failing is not None and len(points) < max_points:
        if narrow_enough():
            break
        rate = (passing + failing) / 2
        value = attainment_at(rate)
        points.append((rate, value))
        if value >= target:
            passing = rate
        else:
            failing = rate
    return KneeSearch(points, interpolate_goodput(points, target), narrow_enough())


@dataclass(frozen=True, slots=True)
class PointCounts:
    """One probed rate's outcome as counts: per SLO class, (requests met, requests).

    The point's attainment is the lowest share among classes that sent requests (every class
    must reach the target; with one shared SLO there is one class: all requests)."""

    rate: float
    classes: tuple[tuple[int, int], ...]

    @property
    def attainment(self) -> float:
        shares = [met / n for met, n in self.classes if n > 0]
        return min(shares) if shares else 0.0


def resampled_goodput(
    runs: Sequence[Sequence[PointCounts]],
    target: float,
    rng: np.random.Generator,
    picks: np.ndarray | None = None,
) -> float:
    """One bootstrap draw of the mean goodput over `runs` (one per seed): the runs are
    resampled with replacement (or `picks`, the run indices of a paired draw), and each
    point's per-class attainment redrawn from a binomial with its observed share and count."""
    if picks is None:
        picks = rng.integers(0, len(runs), size=len(runs))
    total = 0.0
    for pick in picks:
        points = []
        for point in runs[pick]:
            shares = [rng.binomial(n, met / n) / n for met, n in point.classes if n > 0]
            points.append((point.rate, min(shares) if shares else 0.0))
        total += interpolate_goodput(points, target).goodput
    return total / len(runs)
