"""Running a placed request: what `Frontend.run` does once `admit` has placed it.

    PreparedRequest ──quota (Admission.admit, within its deadline)──▶ n choices streamed from
    the decode pool (`app/choices.py`) ──deltas merged, output tokens charged──▶ the caller
      └─ the decode pool's queue full before the first token: every choice starts over on
         the fallback pool (`app/routing/fallback.py`), when the request may degrade

Every path ends the request's metrics, telemetry, quota charge and overflow counts exactly
once; a caller that goes away cancels every choice on both pools.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from app.admission.controller import Admission
from app.admission.overload import OverloadGuard
from app.choices import cancel_choices, pump_choice, ready_items
from app.errors import APIError
from app.observability.request_metrics import (
    STATUS_CLIENT_GONE,
    STATUS_OK,
    RequestMetrics,
    RequestRecorder,
    SLOTargets,
)
from app.observability.telemetry import IngressTelemetry
from app.prepared import PreparedRequest
from app.routing.fallback import TRIGGER_BACKPRESSURE, FallbackPolicy, is_backpressure
from app.routing.log import RoutingLog
from app.routing.overflow import DecodeOverflow
from engine.outputs import RequestOutput


class RequestRunner:
    """Runs placed requests on the decode pools' handles (event loop only)."""

    def __init__(
        self,
        *,
        admission: Admission,
        overload: OverloadGuard,
        overflow: DecodeOverflow,
        fallback: FallbackPolicy,
        routing: RoutingLog,
        metrics: RequestMetrics,
        telemetry: IngressTelemetry,
        decode_handles: Mapping[str, Any],
        in_flight: Counter[str],
    ) -> None:
        """`decode_handles`: streaming handles by pool (decode pools, and prefill pools
        that serve whole requests); `in_flight`: requests running, by tenant (shared with
        the front door, which reports it)."""
        self.admission = admission
        self.overload = overload
        self.overflow = overflow
        self.fallback = fallback
        self.routing = routing
        self.metrics = metrics
        self.telemetry = telemetry
        self.decode_handles = decode_handles
        self.in_flight = in_flight
        # Requests running, by priority: batch jobs pace themselves by the more important.
        self.in_flight_by_priority: Counter[int] = Counter()

    async def run(self, prepared: PreparedRequest) -> AsyncGenerator[tuple[int, RequestOutput]]:
        """Stream `(choice index, delta)` of every choice until all have finished."""
        async with contextlib.aclosing(self.run_batches(prepared)) as batches:
            async for batch in batches:
                for item in batch:
                    yield item

    async def run_batches(
        self, prepared: PreparedRequest
    ) -> AsyncGenerator[list[tuple[int, RequestOutput]]]:
        """`run`, a list at a time: every `(index, delta)` ready by then, in arrival order
        (a busy ingress writes them at once); each delta is still timed on its own."""
        recorder = self._recorder(prepared)
        telemetry = self.telemetry.start(
            prepared.request_id,
            prepared.tenant,
            prepared.service_class.name,
            prepared.route,
            prepared.prompt_token_ids,
        )
        try:
            admission = self.admission.admit(
                prepared.tenant,
                prepared.request_id,
                len(prepared.prompt_token_ids),
                prepared.n,
                prepared.route.priority,
                prepared.route.decode_pool,
                prepared.sampling_params.max_tokens,
            )
            if prepared.deadline is not None:
                admitted = await self.overload.within(prepared.deadline, admission)
            else:
                admitted = await admission
        except APIError as exc:
            if exc.status_code in (429, 503, 504):  # refused, or its deadline passed waiting
                self.metrics.shed(recorder.labels, exc.code or "refused", exc.status_code)
            recorder.finish(exc.status_code)
            telemetry.finish(exc.status_code)
            raise
        except BaseException as exc:
            failed = 500 if isinstance(exc, Exception) else STATUS_CLIENT_GONE
            recorder.finish(failed)
            telemetry.finish(failed)
            raise
        status = STATUS_CLIENT_GONE  # unless the loop below ends or raises
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        # `computing`: where the prompt computes and its length, until its first output
        # (decode overflow's figure; None once reported computed).
        computing: tuple[str, int] | None
        try:
            self.routing.record(prepared)
            tasks, timer, computing = self._start(prepared, queue)
        except BaseException:
            admitted.release()
            recorder.finish(500)
            telemetry.finish(500)
            raise
        self.in_flight[prepared.tenant] += 1
        priority = prepared.route.priority
        self.in_flight_by_priority[priority] += 1
        started = False  # a delta was passed on: too late to move to the fallback pool
        try:
            remaining = prepared.n
            while remaining:
                batch: list[tuple[int, RequestOutput]] = []
                for item in await ready_items(queue):
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        fallback = None
                        if not started and is_backpressure(item):
                            fallback = self.fallback.move(prepared, TRIGGER_BACKPRESSURE)
                        if fallback is None:
                            if batch:  # the deltas before the error still reach the client
                                yield batch
                            raise item
                        # The decode pool's queue is full: every choice starts over on the
                        # fallback pool, on a fresh queue (the old one may get late items).
                        cancel_choices(tasks, timer)
                        self.overflow.ended(prepared.route.decode_pool, prepared.n)
                        self._prompt_computed(computing)
                        computing = None
                        prepared = fallback
                        recorder.labels.update(
                            prefill_pool="local", decode_pool=fallback.route.decode_pool
                        )
                        self.routing.record(prepared)
                        queue = asyncio.Queue()
                        tasks, timer, computing = self._start(prepared, queue)
                        remaining = prepared.n
                        break  # what else was ready came from the old pool
                    else:
                        started = True
                        self._prompt_computed(computing)
                        computing = None
                        admitted.on_output(len(item[1].new_token_ids))
                        recorder.on_delta(*item)
                        telemetry.on_delta(*item)
                        batch.append(item)
                if batch:
                    yield batch
            status = STATUS_OK
        except APIError as exc:
            status = exc.status_code
            raise
        except Exception:
            status = 500
            raise
        finally:
            # What frees capacity first, whatever the bookkeeping after it does: a client
            # that went away cancels every choice on both pools, and the slot goes back.
            try:
                cancel_choices(tasks, timer)
            finally:
                admitted.release()
            recorder.finish(status)
            telemetry.finish(status)
            self.overflow.ended(prepared.route.decode_pool, prepared.n)
            self._prompt_computed(computing)
            self.in_flight[prepared.tenant] -= 1
            self.in_flight_by_priority[priority] -= 1

    def _start(
        self, prepared: PreparedRequest, queue: asyncio.Queue
    ) -> tuple[list[asyncio.Task[None]], asyncio.TimerHandle | None, tuple[str, int]]:
        """Start every choice's stream into `queue`; at the deadline a 504 error joins it
        (the caller then cancels every choice). Tells decode overflow of the streams and of
        the prompt (returned: the pool it computes on, its length); `run_batches` ends both."""
        route = prepared.route
        handle = self.decode_handles[route.decode_pool]
        tasks = [
            asyncio.create_task(pump_choice(handle, prepared, i, queue)) for i in range(prepared.n)
        ]
        self.overflow.started(route.decode_pool, prepared.n)
        pool = route.decode_pool if route.local_prefill else route.prefill_pool
        computing = route.computes or (pool or route.decode_pool, len(prepared.prompt_token_ids))
        self.overflow.prompt_started(*computing)
        return tasks, self.overload.deadline_timer(prepared.deadline, queue), computing

    def _prompt_computed(self, computing: tuple[str, int] | None) -> None:
        """Its first output came back, or it ended or moved to the fallback pool."""
        if computing is not None:
            self.overflow.prompt_computed(*computing)

    def _recorder(self, prepared: PreparedRequest) -> RequestRecorder:
        """Start the request's metrics (labels: tenant, class, pools; its class's targets)."""
        route, service_class = prepared.route, prepared.service_class
        labels = RequestMetrics.labels(
            prepared.tenant,
            service_class.name,
            None if route.local_prefill else route.prefill_pool,
            route.decode_pool,
        )
        default = self.metrics.default_slo
        slo = SLOTargets(
            service_class.ttft_s or default.ttft_s, service_class.tpot_s or default.tpot_s
        )
        return self.metrics.start(labels, len(prepared.prompt_token_ids), slo)
