"""What the ingress does against overload, per request: deadline, shedding, bounded waits.

`OverloadGuard` is the one object `app/frontend.py` holds for it:

- `deadline(timeout_s, slo_class)`: the request's `Deadline` (`app/admission/deadlines.py`);
- `check_shed(...)`: predict the TTFT on the request's prefill pool (plus its admission
  wait on its decode pool) and refuse it early
  (503 `overloaded` with Retry-After, `app/admission/shedding.py`), or say why it passed;
- `within(deadline, awaitable)`: await something no longer than the deadline allows
  (504 `deadline_exceeded` after it);
- `deadline_timer(deadline, queue)`: put that error into a request's delta queue when the
  deadline passes (one timer per request, nothing per delta);
- `backpressure(exc)`: Serve's `BackPressureError` (a pool's `max_queued_requests` reached)
  as a clean 503 `overloaded`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from app.admission.deadlines import Deadline, resolve_timeout_s
from app.admission.load_monitor import PoolLoadMonitor
from app.admission.shedding import LoadShedder, ShedCheck, overloaded
from app.config import OverloadSettings
from app.errors import ServiceUnavailableError
from app.serve.calls import is_backpressure

_T = TypeVar("_T")
BACKPRESSURE_RETRY_AFTER_S = 1.0


class OverloadGuard:
    """Deadlines and load shedding of one ingress replica."""

    def __init__(
        self,
        settings: OverloadSettings,
        prefill_handles: Mapping[str, Any],
        class_priorities: list[int],
    ) -> None:
        self.settings = settings
        self.shedder = LoadShedder(settings.shedding, class_priorities)
        self.monitor = PoolLoadMonitor(prefill_handles, settings.shedding)

    def deadline(self, timeout_s: float | None, slo_class: str | None, param: str) -> Deadline:
        """The request's deadline, starting now (`timeout_s`: what it asked for, if any;
        `param` names where it came from in a 400 about it)."""
        return Deadline.start(resolve_timeout_s(self.settings, timeout_s, slo_class, param))

    def check_shed(
        self,
        prefill_pool: str | None,
        num_prompt_tokens: int,
        ttft_slo_s: float | None,
        priority: int,
        decode_pool: str | None = None,
    ) -> ShedCheck:
        """Predict the request's TTFT on `prefill_pool` (None: prefilled locally) plus its
        admission wait on `decode_pool` (None: not counted) from the pools' latest load;
        never waits."""
        snapshot = self.monitor.snapshot(prefill_pool) if prefill_pool is not None else None
        decode = self.monitor.snapshot(decode_pool) if decode_pool is not None else None
        return self.shedder.check(
            prefill_pool, snapshot, num_prompt_tokens, ttft_slo_s, priority, decode_pool, decode
        )

    @staticmethod
    def shed_error(check: ShedCheck, route_reason: str) -> ServiceUnavailableError:
        """The 503 for a shed request; its `x-pdserve-route` says why."""
        return overloaded(check, {"x-pdserve-route": f"{route_reason}; {check.reason}"})

    @staticmethod
    async def within(deadline: Deadline, awaitable: Awaitable[_T]) -> _T:
        """`await awaitable`, cancelled with `DeadlineExceededError` when the deadline
        passes first."""
        try:
            return await asyncio.wait_for(awaitable, timeout=deadline.remaining_s())
        except TimeoutError:
            raise deadline.error() from None

    @staticmethod
    def deadline_timer(
        deadline: Deadline | None, queue: asyncio.Queue[Any]
    ) -> asyncio.TimerHandle | None:
        """Schedule `deadline.error()` into `queue` when the deadline passes (None: no
        deadline). Cancel the handle when the request ends first."""
        if deadline is None:
            return None
        loop = asyncio.get_running_loop()
        return loop.call_later(deadline.remaining_s(), queue.put_nowait, deadline.error())

    @staticmethod
    def backpressure(exc: BaseException) -> ServiceUnavailableError | None:
        """Serve's `BackPressureError` as 503 `overloaded`; None for anything else."""
        if not is_backpressure(exc):
            return None
        return ServiceUnavailableError(
            "the service is overloaded: a pool's request queue is full; retry later",
            code="overloaded",
            retry_after_s=BACKPRESSURE_RETRY_AFTER_S,
        )

    def close(self) -> None:
        self.monitor.close()
