"""Where the time to first token went, aggregated: p50/p90 of each server-measured phase
over recent requests (`engine.outputs.TTFTBreakdown`, from the decode replicas)."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from engine.outputs import TTFTBreakdown

PHASES = ("queue_ms", "prefill_ms", "transfer_ms", "handover_ms", "first_step_ms", "total_ms")
MAX_KEPT = 10_000


def percentile(values: Sequence[float], p: float) -> float:
    """The `p`-th percentile (0..100) with linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(breakdowns: Sequence[TTFTBreakdown]) -> dict[str, Any]:
    """Count, remote count, and p50/p90/mean of every phase (None when empty)."""
    report: dict[str, Any] = {
        "num_requests": len(breakdowns),
        "num_remote_prefill": sum(b.remote for b in breakdowns),
    }
    for phase in PHASES:
        values = [float(getattr(b, phase)) for b in breakdowns]
        report[phase] = {
            "p50": percentile(values, 50) if values else None,
            "p90": percentile(values, 90) if values else None,
            "mean": sum(values) / len(values) if values else None,
        }
    return report


class TTFTStats:
    """The last `MAX_KEPT` breakdowns with the wall time each request finished."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._recent: deque[tuple[float, TTFTBreakdown]] = deque(maxlen=MAX_KEPT)

    def add(self, breakdown: TTFTBreakdown) -> None:
        self._recent.append((self.clock(), breakdown))

    def report(self, since: float | None = None) -> dict[str, Any]:
        """`summarize` over the kept requests that finished at or after `since` (Unix s)."""
        kept = [b for at, b in self._recent if since is None or at >= since]
        return summarize(kept)
