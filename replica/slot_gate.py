"""Decode admission: a replica's concurrent streams, admitted most important first.

A `generate` call's life in the gate (`SlotGate`, one per decode replica):

    arrives ──a slot is free and nobody waits──▶ active ──its stream ends──▶ released
       │                                           ▲
       └──▶ waiting (by priority, then arrival) ───┘  a released slot goes to the first waiter
              └── its wait bound passes, or its caller goes away ──▶ gone (held no slot)

Serve sends a replica up to its pool's `max_ongoing_requests` calls and queues the rest in
the caller, first come, first served. The gate keeps `max_active` (the engine's
`max_num_seqs`) of the calls it holds active; a pool whose `max_ongoing_requests` is above
that lets the others wait here instead, where an interactive request goes ahead of every
batch request that arrived before it. Every stream of a request with `n` choices takes its
own slot. Inside the engine, the waiting queue is ordered by priority too, and when KV runs
out the least important running sequence is preempted first (`engine/scheduler.py`).

`snapshot()` goes into the replica's routing stats as `admission`: `num_active`,
`max_active`, `num_waiting_by_priority` and `releases_per_s` (slots freed per second over
the last `window_s`), from which the ingress predicts a new request's wait here
(`app/admission/shedding.py`). Event loop only; the clock is injected for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from typing import Any

RELEASE_WINDOW_S = 10.0


class SlotGate:
    """`max_active` slots, handed out by priority (lower value first), FIFO within one."""

    def __init__(
        self,
        max_active: int,
        window_s: float = RELEASE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {max_active}")
        self.max_active = max_active
        self.num_active = 0
        self.window_s = window_s
        self._clock = clock
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap
        self._arrivals = itertools.count()
        self._releases: deque[float] = deque(maxlen=4096)

    @contextlib.asynccontextmanager
    async def slot(self, priority: int, max_wait_s: float) -> AsyncIterator[None]:
        """Hold a slot for the body; waits at most `max_wait_s` for it (`TimeoutError`)."""
        await self.acquire(priority, max_wait_s)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, priority: int, max_wait_s: float) -> None:
        """Take a slot, waiting behind every more important (or earlier, equally important)
        waiter; `TimeoutError` after `max_wait_s`. A cancelled or timed-out caller holds
        no slot."""
        if self.num_active < self.max_active and not self._waiting:
            self.num_active += 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), granted)
        heapq.heappush(self._waiting, entry)
        try:
            # Not wait_for: on Python 3.11 it returns normally when cancelled just after the
            # slot was handed over, and the cancelled caller would stream on with it.
            async with asyncio.timeout(max_wait_s):
                await asyncio.shield(granted)
        except BaseException:
            if granted.done() and not granted.cancelled():
                self.release()  # handed a slot as the wait ended: pass it on
            else:
                granted.cancel()
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    def release(self) -> None:
        """A stream ended: its slot goes to the first waiter, or back to the free ones."""
        self._releases.append(self._clock())
        while self._waiting:
            _, _, granted = heapq.heappop(self._waiting)
            if not granted.done():
                granted.set_result(None)  # the slot passes on: num_active is unchanged
                return
        self.num_active -= 1

    def snapshot(self) -> dict[str, Any]:
        """Slots and waiters now, for the replica's routing stats (module docstring)."""
        since = self._clock() - self.window_s
        while self._releases and self._releases[0] < since:
            self._releases.popleft()
        waiting = Counter(p for p, _, granted in self._waiting if not granted.done())
        return {
            "num_active": self.num_active,
            "max_active": self.max_active,
            "num_waiting_by_priority": dict(waiting),
            "releases_per_s": len(self._releases) / self.window_s,
        }
