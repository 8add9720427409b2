"""How many batch lines an ingress replica keeps in flight: spare capacity, not interference.

Every job of a replica draws its lines' slots from one `Window`. `Pacer` moves the window's
limit every `pace_period_s` from what it observes:

- nothing more important running through this replica for the quiet period, none queued
  at a pool (`Pacer.idle`): the limit goes to `max_concurrency` at once, so an idle service runs
  a job at large batches from its first second (doubling from `busy_concurrency` took
  1.25 s at the default pace, a third of a 320-line job on `tiny`; the lines a sudden
  arrival needs back are preempted below, so a full window costs it no more than a ramp
  would), and lines of up to `batch.local_prefill_max_tokens` prefill where they decode
  (`LineExecutor`; under load only those of up to `busy_local_prefill_max_tokens`);
- more important requests running here, or seen within the quiet period: the limit drops
  to `busy_concurrency` at once, then grows by one per period up to it;
- more important work queued at a pool (a decode replica's admission waiters, prompt tokens
  pending at a prefill replica, from the routing stats every ingress already reads), or a
  line refused for load (429/503/504): the limit halves, down to `min_concurrency`.

The quiet period is `quiet_s`, or `QUIET_GAPS` times the recent gap between more important
arrivals when that is longer (at most `MAX_QUIET_FACTOR` x `quiet_s`): under Poisson
arrivals at 1/s a fixed 3 s reads as idle once every ~25 arrivals, and the window opening
to `max_concurrency` just before the next one costs that request and those behind it
seconds of TTFT (measured: `small` on 2 cores, TTFT 3-7 s for 15 s after one 5.3 s gap).

When more important requests arrive while more lines are in flight than the new limit, the
lines started last are stopped and queued again (`JobRunner.preempt`): a long line must not
hold a decode slot an interactive request needs. Their work so far is lost, never their
result (a line counts only once it has finished). The policy is pure (no Ray, no clock of
its own); `Window` is the event loop's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.config import BatchSettings


@dataclass(frozen=True, slots=True)
class Load:
    """What the pacer sees of more important work, at one moment."""

    num_running: int  # more important requests in flight through this ingress replica
    queued: bool  # more important work waiting at some pool
    now: float  # monotonic seconds
    num_arrived: int = 0  # more important requests arrived since the last look


QUIET_GAPS = 5.0  # idle only after this many recent inter-arrival gaps without an arrival
MAX_QUIET_FACTOR = 10.0  # the quiet period is at most this many `quiet_s`
GAP_WEIGHT = 0.25  # weight of the newest gap in the running estimate


class Pacer:
    """The window's next limit from the observed `Load` (module docstring)."""

    def __init__(self, settings: BatchSettings) -> None:
        self.min = settings.min_concurrency
        self.max = settings.max_concurrency
        self.busy = settings.busy_concurrency
        self.quiet_s = settings.quiet_s
        self.limit = self.busy
        self.busy_at = -math.inf  # when more important work was last seen
        # Nothing more important seen for the quiet period at the last look (window open)
        self.idle = False
        self.gap_s: float | None = None  # recent gap between more important arrivals
        self._arrived_at: float | None = None

    @property
    def quiet_period_s(self) -> float:
        """How long nothing more important must be seen before the window opens."""
        if self.gap_s is None:
            return self.quiet_s
        return min(max(self.quiet_s, QUIET_GAPS * self.gap_s), MAX_QUIET_FACTOR * self.quiet_s)

    def next_limit(self, load: Load) -> int:
        if load.queued or load.num_running:
            self.busy_at = load.now
        self._count_arrivals(load)
        self.idle = False
        if load.queued:
            self.limit = max(self.min, self.limit // 2)
        elif load.now - self.busy_at < self.quiet_period_s:
            self.limit = min(self.busy, self.limit + 1)
        else:
            self.limit = self.max
            self.idle = True
        return self.limit

    def _count_arrivals(self, load: Load) -> None:
        """Fold the gap since the previous arrival into `gap_s` (a gap longer than the
        longest quiet period counts as that: one request after an idle hour is not a rate)."""
        if load.num_arrived <= 0:
            return
        if self._arrived_at is not None:
            longest = MAX_QUIET_FACTOR * self.quiet_s / QUIET_GAPS
            gap = min((load.now - self._arrived_at) / load.num_arrived, longest)
            self.gap_s = gap if self.gap_s is None else self.gap_s + GAP_WEIGHT * (gap - self.gap_s)
        self._arrived_at = load.now

    def report(self) -> dict[str, Any]:
        """For `/v1/pdserve/stats` (`batch`): the window's limit, whether the service reads
        as idle, the quiet period now and the arrival gap behind it."""
        return {
            "limit": self.limit,
            "idle": self.idle,
            "quiet_period_s": round(self.quiet_period_s, 3),
            "arrival_gap_s": None if self.gap_s is None else round(self.gap_s, 3),
        }

    def refused(self) -> int:
        """A line was refused for load: halve."""
        self.idle = False
        self.limit = max(self.min, self.limit // 2)
        return self.limit


def queued_ahead(snapshots: Iterable[Mapping[str, Any]], priority: int) -> bool:
    """True when some replica's routing stats show work more important than `priority`
    waiting: decode admission waiters, or prompt tokens pending at a prefill replica."""
    for stats in snapshots:
        admission = stats.get("admission")
        if isinstance(admission, Mapping):
            waiting = admission.get("num_waiting_by_priority") or {}
            if any(int(p) < priority and int(n) > 0 for p, n in waiting.items()):
                return True
        pending = stats.get("pending_tokens_by_priority")
        if isinstance(pending, Mapping) and any(
            int(p) < priority and float(n) > 0 for p, n in pending.items()
        ):
            return True
    return False


class Window:
    """Slots for lines in flight, at most `limit` taken (event loop only). `release` and
    `set_limit` do not wait, so a line being cancelled always gives its slot back."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_taken = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        while self.num_taken >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        self.num_taken += 1

    def release(self) -> None:
        self.num_taken -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        free = self.limit - self.num_taken
        for waiter in list(self._waiters):
            if free <= 0:
                break
            if not waiter.done():
                waiter.set_result(None)
                free -= 1
