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
of goodput and of goodput ratios (`bench/goodput/stats.py`).
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


class KneeStepper:
    """The knee search (module docstring) one probe at a time: `next_rate()` says which rate
    to measure (None: the search is over), `record(rate, attainment)` gives its outcome.
    Several steppers can then advance in turn, so that configs compared on one host are
    measured side by side rather than one search after another."""

    def __init__(
        self,
        rate_start: float,
        target: float = DEFAULT_TARGET,
        tolerance: float = 0.1,
        max_points: int = 10,
    ) -> None:
        if rate_start <= 0:
            raise ValueError(f"rate_start must be positive, got {rate_start}")
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
        if max_points < 1:
            raise ValueError(f"max_points must be at least 1, got {max_points}")
        self.rate_start, self.target = rate_start, target
        self.tolerance, self.max_points = tolerance, max_points
        self.points: list[tuple[float, float]] = []  # (rate, attainment), in probe order
        self._passing: float | None = None  # highest rate known to pass below `_failing`
        self._failing: float | None = None  # lowest rate known to fail
        self._bracketing = True  # doubling or halving; False: bisecting
        self._rate = rate_start  # the next bracketing probe

    def next_rate(self) -> float | None:
        """The rate to measure next, or None when the search is over."""
        if len(self.points) >= self.max_points:
            return None
        if self._bracketing:
            return self._rate
        if self._passing is None or self._failing is None or self._narrow_enough():
            return None
        return (self._passing + self._failing) / 2

    def record(self, rate: float, attainment: float) -> None:
        """The outcome of measuring `next_rate()`."""
        self.points.append((rate, attainment))
        passed = attainment >= self.target
        if passed:
            self._passing = rate
        else:
            self._failing = rate
        if not self._bracketing:
            return
        if passed:
            self._bracketing = self._failing is None
            self._rate = rate * 2
        else:
            floor = self.rate_start / 2**MAX_HALVINGS
            self._bracketing = self._passing is None and rate >= floor
            self._rate = rate / 2

    def _narrow_enough(self) -> bool:
        return (
            self._passing is not None
            and self._failing is not None
            and self._failing - self._passing <= self.tolerance * self._failing
        )

    def result(self) -> KneeSearch:
        """The points so far and the goodput they give."""
        estimate = interpolate_goodput(self.points, self.target)
        return KneeSearch(list(self.points), estimate, self._narrow_enough())


def find_knee(
    attainment_at: Callable[[float], float],
    rate_start: float,
    target: float = DEFAULT_TARGET,
    tolerance: float = 0.1,
    max_points: int = 10,
) -> KneeSearch:
    """Probe rates (see the module docstring) until the knee is bracketed to `tolerance`."""
    stepper = KneeStepper(rate_start, target, tolerance, max_points)
    while (rate := stepper.next_rate()) is not None:
        stepper.record(rate, attainment_at(rate))
    return stepper.result()


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
