"""How much load a deployed service takes, measured where the bench runs: a closed-loop probe
and the saturation search over it.

A closed-loop probe (`closed_loop`) keeps `concurrency` requests in flight (each of that many
workers sends its next request as soon as its last one ends) and counts the requests that
complete inside a window of `duration_s` seconds that opens `warmup_s` after the start: the
throughput X(C) in requests/s. By Little's law an open (Poisson) arrival process at rate X(C)
keeps about C requests in the service.

`find_saturation(measure)` doubles the concurrency from `start` until `patience` (2)
doublings in a row raise the throughput by less than `min_gain` (10%), or past
`max_concurrency`; the capacity is the highest throughput seen, the rate past which requests
only queue. `bench chaos` and `bench autoscale` size their load from it on the machine they
run on (so a phase stresses what it claims to on any machine, loaded or not); `bench compare`
and `bench overload` find a goodput knee against SLOs instead (`bench/goodput/knee.py`), which those
two benches' workloads do not have.

No I/O of its own: `closed_loop` awaits the `send` it is given, `find_saturation` the
`measure`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

Send = Callable[[int], Awaitable[bool]]  # request index -> completed?


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One closed-loop measurement: what completed (and failed) inside its window."""

    concurrency: int
    duration_s: float  # the counting window
    completed: int
    failed: int = 0
    sent: int = 0  # every request sent, counted or not
    mean_latency_s: float | None = None  # of the completed requests counted

    @property
    def throughput(self) -> float:
        """Completed requests per second of the window."""
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "throughput": self.throughput}


@dataclass(frozen=True, slots=True)
class Capacity:
    """The highest throughput a probe found, and the points it measured (in order)."""

    requests_per_s: float
    points: list[LoadPoint] = field(default_factory=list)
    saturated: bool = False  # the last doubling gained less than `min_gain`: past the knee

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests_per_s": self.requests_per_s,
            "saturated": self.saturated,
            "points": [p.to_dict() for p in self.points],
        }


async def find_saturation(
    measure: Callable[[int], Awaitable[LoadPoint]],
    start: int = 1,
    max_concurrency: int = 32,
    min_gain: float = 0.1,
    patience: int = 2,
) -> Capacity:
    """Measure at concurrency `start`, 2 x `start`, ... until `patience` doublings in a row
    each raise the throughput by less than `min_gain` of the best before them, or past
    `max_concurrency` (`measure`: typically `closed_loop` with the bench's own request);
    `saturated` says whether the last doubling gained less than that.
    One flat point is not enough to stop: on a shared machine a point can come out low."""
    if start < 1 or max_concurrency < start:
        raise ValueError(f"need 1 <= start <= max_concurrency, got {start}, {max_concurrency}")
    if min_gain < 0 or patience < 1:
        raise ValueError(f"need min_gain >= 0 and patience >= 1, got {min_gain}, {patience}")
    points: list[LoadPoint] = []
    best = 0.0
    flat = 0  # doublings in a row that gained less than min_gain
    concurrency = start
    while concurrency <= max_concurrency:
        point = await measure(concurrency)
        points.append(point)
        flat = flat + 1 if len(points) > 1 and point.throughput < best * (1 + min_gain) else 0
        best = max(best, point.throughput)
        if flat >= patience:
            return Capacity(best, points, saturated=True)
        concurrency *= 2
    return Capacity(best, points, saturated=flat > 0)


async def closed_loop(
    send: Send, concurrency: int, duration_s: float, warmup_s: float = 1.0, first_index: int = 0
) -> LoadPoint:
    """`concurrency` workers send requests back to back (`send(index)`, indices from
    `first_index`) until the window closes; the requests that end inside the window count.
    Returns once every request sent has ended, so the next probe starts on an idle service."""
    if concurrency < 1 or duration_s <= 0:
        raise ValueError(f"need concurrency >= 1, duration_s > 0: {concurrency}, {duration_s}")
    start = time.monotonic()
    opens, closes = start + warmup_s, start + warmup_s + duration_s
    next_index = first_index
    completed = failed = 0
    latencies: list[float] = []

    async def worker() -> None:
        nonlocal next_index, completed, failed
        while time.monotonic() < closes:
            index, next_index = next_index, next_index + 1
            sent = time.monotonic()
            ok = await send(index)
            ended = time.monotonic()
            if not opens <= ended <= closes:
                continue
            if ok:
                completed += 1
                latencies.append(ended - sent)
            else:
                failed += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    mean = sum(latencies) / len(latencies) if latencies else None
    return LoadPoint(concurrency, duration_s, completed, failed, next_index - first_index, mean)
