"""Remote prefill for one decode request: attempts, retries and the hand-off to decoding.

`RemotePrefill.run` drives a request whose route names a prefill pool (called by
`DecodeServer` once the request holds a stream slot):

    plan (breakers, deadline) ──remote──▶ reserve blocks (WAITING_FOR_KV) + open ticket
      ──▶ prefill pool `prefill(req, ticket)` ──KV DONE──▶ first token published: decoding
    a failed attempt: abort its transfer (its blocks come back through `release`), record
    it in the breakers, retry once on another replica; after that, or when no room, the
    breakers or the deadline say so: None, and the caller prefills locally

Every attempt has its own transfer id (`transfer_id(request id, attempt)`), which is also
the engine request id of its reservation (`decode/reservations.py` says who frees what).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol, TypeVar

from decode.breaker import BreakerBoard, PrefillPlan, PrefillPlanner
from decode.reservations import Reservation, ReservationTable
from engine.async_engine import EngineDeadError
from kvtransfer import KVTransferError, Ticket, TransferState
from kvtransfer.ranks import AnyReceiver, GroupReceiver
from replica.calls import PoolCalls
from replica.engine_replica import EngineReplica
from replica.generation_trace import GenerationTrace
from replica.placement import placements, pool_view
from replica.protocol import GenerationSpec, PrefillRequest, PrefillResult

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_REMOTE_ATTEMPTS = 2  # the first try, then one retry (Serve may pick another replica)
OPENER_THREADS = 8  # group tickets opened at once
FENCE_MARGIN_S = 2.0  # on top of fence_timeout_s: the release's trip to the engine thread


class PrefillHandle(Protocol):
    """What the decode server needs of a prefill pool (a Serve `DeploymentHandle`)."""

    @property
    def prefill(self) -> Any: ...

    @property
    def warm(self) -> Any: ...


def transfer_id(request_id: str, attempt: int) -> str:
    """The transfer id of a request's remote-prefill attempt (also its reservation's
    engine request id)."""
    return f"{request_id}#{attempt}"


def known_replicas(pool: str) -> Collection[str] | None:
    """The replicas of prefill pool `pool` as the replica router last saw them (None:
    not seen yet)."""
    snapshot = pool_view.get(pool)
    return None if snapshot is None else snapshot.replicas.keys()


async def on_engine(replica: EngineReplica, fn: Callable[[], T], engine_id: str) -> T:
    """Run `fn` (which starts `engine_id` decoding) on the engine thread. If the caller is
    cancelled meanwhile, `fn` still runs and an abort of the request follows it."""
    future = replica.loop.call(fn)
    try:
        return await asyncio.shield(asyncio.wrap_future(future))
    except BaseException:
        with contextlib.suppress(EngineDeadError):
            replica.loop.abort(engine_id)  # queued after fn: commands run in order
        raise


class RemotePrefill:
    """A decode replica's remote-prefill attempts (event loop only)."""

    def __init__(
        self,
        replica: EngineReplica,
        receiver: AnyReceiver,
        reservations: ReservationTable,
        prefill_pools: Mapping[str, PrefillHandle],
        planner: PrefillPlanner,
        deadline_s: float,
        fence_allowance_s: float,
        calls: PoolCalls = PoolCalls(),
    ) -> None:
        """`deadline_s`: the longest a ticket stays open; `fence_allowance_s`: how long after
        its ticket's deadline a reservation's blocks may still be written (fenced); `calls`:
        the serving framework's hooks for calls to the prefill pools."""
        self.replica = replica
        self.receiver = receiver
        self.reservations = reservations
        self.prefill_pools = prefill_pools
        self.planner = planner
        self.breakers: BreakerBoard = planner.board
        self.deadline_s = deadline_s
        self.fence_allowance_s = fence_allowance_s
        self.calls = calls
        # Group tickets ask every rank (`GroupReceiver.open_ticket`, at most 10 s each): on
        # threads of their own, so a stuck rank holds up ticket opens only, never the
        # default executor the rest of the replica uses.
        self._opener = ThreadPoolExecutor(OPENER_THREADS, thread_name_prefix="kv-open")

    async def run(
        self, spec: GenerationSpec, deadline: float, timeline: GenerationTrace
    ) -> tuple[str, asyncio.Queue] | None:
        """Try remote prefill (with one retry on another replica) while the breakers and
        the request's `deadline` (monotonic) allow. When decoding has started: the engine
        request id it runs under and its delta stream; None: prefill locally."""
        assert spec.prefill_pool is not None
        counters = self.replica.counters
        failed: list[str] = []  # replicas that failed this request: never retried
        for attempt in range(MAX_REMOTE_ATTEMPTS):
            plan = self._plan(spec, failed, deadline)
            if not plan.remote:
                return None
            if attempt:
                counters["prefill_retries"] += 1
            reservation = Reservation(transfer_id(spec.request_id, attempt))
            window_s = min(self.deadline_s, deadline - time.monotonic())
            timeline.reserve_started()
            try:
                ticket = await self.reserve(spec, reservation, window_s)
            except KVTransferError as exc:  # a rank of this replica could not open it
                logger.warning("opening KV transfer %s failed: %r", reservation.transfer_id, exc)
                counters["kv_open_failed"] += 1
                return None  # prefill locally: nothing was sent, the blocks are dropped
            timeline.reserved(reservation.transfer_id, ticket is not None)
            if ticket is None:
                counters["no_kv_room"] += 1
                return None  # prefill locally: the engine queues it until blocks free up
            timeline.prefill_call_started(reservation.transfer_id, spec.prefill_pool)
            result, replica, may_retry = await self._transfer(
                spec, reservation, ticket, plan, timeline.carrier
            )
            timeline.prefill_call_ended(result, replica)
            if result is None:
                if not may_retry:
                    return None
                if replica is not None:
                    failed.append(replica)
                continue  # the dead attempt's blocks come back through its release
            counters["remote_prefill"] += 1
            counters[f"prefill_pool:{spec.prefill_pool}"] += 1
            counters["remote_cached_tokens"] += result.num_cached_tokens
            engine_id = reservation.transfer_id
            stream = self.replica.loop.open_stream(engine_id)
            start = partial(self._start_decoding, result, reservation, timeline)
            await on_engine(self.replica, start, engine_id)
            return engine_id, stream
        return None

    def _start_decoding(
        self, result: PrefillResult, landed: Reservation, timeline: GenerationTrace
    ) -> None:
        """On the engine thread: the KV landed (DONE), no writer is left, so the blocks pass
        to the decoding request, which starts from the prefill's first token."""
        self.reservations.forget(landed)
        delta = self.replica.engine.kv_received(
            landed.transfer_id, result.first_token_id, result.logprobs, result.num_cached_tokens
        )
        self.replica.loop.publish(delta)
        timeline.published()

    def _plan(self, spec: GenerationSpec, failed: list[str], deadline: float) -> PrefillPlan:
        """Where the next remote attempt may go (remote=False: prefill locally), and why."""
        assert spec.prefill_pool is not None
        seconds_left = deadline - time.monotonic()
        plan = self.planner.plan(spec.request_id, spec.prefill_pool, tuple(failed), seconds_left)
        if not plan.remote:
            local = "deadline_local_prefill" if plan.deadline_bound else "breaker_local_prefill"
            self.replica.counters[local] += 1
        return plan

    def _decide(self, spec: GenerationSpec, reason: str) -> None:
        assert spec.prefill_pool is not None
        self.planner.decide(spec.request_id, spec.prefill_pool, reason)

    async def reserve(
        self, spec: GenerationSpec, reservation: Reservation, window_s: float | None = None
    ) -> Ticket | None:
        """Reserve the attempt's blocks and open its ticket (deadline `window_s` from now,
        default `deadline_s`); None: no room now."""
        loop = self.replica.loop
        request = self.replica.make_request(spec, reservation.transfer_id)
        self.reservations.add(reservation)
        reserve = loop.call(partial(self.replica.engine.reserve_for_kv, request))
        try:
            block_ids = await asyncio.shield(asyncio.wrap_future(reserve))
        except BaseException:
            # Cancelled before the ticket: no writer can have these blocks. Drop them after
            # the reservation has run (engine commands run in order).
            with contextlib.suppress(EngineDeadError):
                loop.call(partial(self.reservations.drop_unticketed, reservation, reserve))
            raise
        if block_ids is None:
            self.reservations.forget(reservation)
            return None
        # The leading blocks this replica's prefix cache held are pinned (the reservation
        # holds them, as it holds the rest) and never written: only the others move.
        num_cached_blocks = request.num_computed_tokens // self.replica.engine.kv_spec.block_size
        open_ticket = partial(
            self.receiver.open_ticket,
            reservation.transfer_id,
            block_ids[num_cached_blocks:],
            window_s or self.deadline_s,
            num_cached_blocks,
        )
        cancelled = False
        try:
            if isinstance(self.receiver, GroupReceiver):  # asks every rank: off the loop
                opening = asyncio.get_running_loop().run_in_executor(self._opener, open_ticket)
                ticket, cancelled = await _run_to_end(opening)
            else:
                ticket = open_ticket()
        except BaseException:
            with contextlib.suppress(EngineDeadError):
                loop.call(partial(self.reservations.drop_unticketed, reservation, reserve))
            raise
        reservation.ticket_open = True
        reservation.expires_at = time.monotonic() + ticket.seconds_left() + self.fence_allowance_s
        if cancelled:  # opened after all: the blocks come back through release
            self.receiver.abort(reservation.transfer_id)
            raise asyncio.CancelledError
        return ticket

    async def _transfer(
        self,
        spec: GenerationSpec,
        reservation: Reservation,
        ticket: Ticket,
        plan: PrefillPlan,
        trace_context: dict[str, str],
    ) -> tuple[PrefillResult | None, str | None, bool]:
        """Have the prefill pool fill the attempt's ticket: (the result, or None when the
        attempt failed; the replica that served or failed it, None if unknown or never
        routed; whether a retry may help: not after a timeout no replica took, nor when the
        pool's queue is full).
        A failed transfer is aborted and its blocks come back through `release`. The
        outcome feeds the pool's and the replica's circuit breakers. `trace_context`: the
        decode span the prefill call belongs to."""
        assert spec.prefill_pool is not None
        pool = spec.prefill_pool
        counters = self.replica.counters
        tid = reservation.transfer_id
        prefill_request = PrefillRequest.derive(
            spec,
            request_id=tid,
            exclude_replicas=plan.exclude_replicas,
            probe_replica=plan.probe_replica,
            trace_context=trace_context,
        )
        response: Any = None
        try:
            self.calls.new_call_id()  # an earlier attempt may still be pending in the router
            response = self.prefill_pools[pool].prefill.remote(prefill_request, ticket)
            # Bounded by the ticket's deadline: a prefill pool with no live replica must
            # not hang the request (Serve would queue the call indefinitely).
            result: PrefillResult = await asyncio.wait_for(
                _resolve(response), timeout=max(ticket.seconds_left(), 0.0) + 1.0
            )
            state = self.receiver.poll(tid)
            if not state.is_terminal:
                state = await asyncio.to_thread(self.receiver.wait, tid, 5.0)
            if state != TransferState.DONE:
                raise self.receiver.error(tid) or KVTransferError(
                    f"KV of {tid} ended {state.value}"
                )
            placements.pop(tid)
            self.breakers.record(pool, result.replica, ok=True)
            counters[f"prefill_ok:{result.replica}"] += 1
            return result, result.replica, False
        except BaseException as exc:
            self.receiver.abort(tid)  # the blocks come back through release
            ended = self.receiver.poll(tid)
            if ended is TransferState.DONE:
                # It landed after all: no release will come, and no writer is left.
                with contextlib.suppress(EngineDeadError):
                    self.replica.loop.call(partial(self.reservations.free, reservation))
            if response is not None:
                _cancel(response)
            replica = placements.pop(tid)
            if not isinstance(exc, Exception):  # cancelled, or the generator closed
                raise
            logger.warning("remote prefill attempt %s on %s failed: %r", tid, replica, exc)
            counters["prefill_failures"] += 1
            counters[f"kv_transfer_failures:{ended.value}"] += 1
            if self.calls.is_backpressure(exc):  # the pool's queue is full: not the replica's fault
                counters["prefill_backpressure"] += 1
                self._decide(spec, f"pool {pool} queue full -> local prefill")
                return None, None, False
            if isinstance(exc, TimeoutError) and replica is None:
                # Never routed (the pool is saturated or down): no blind retry.
                self.breakers.record(pool, None, ok=False)
                counters["prefill_failed:unrouted"] += 1
                self._decide(spec, f"attempt {tid} timed out unrouted -> local prefill")
                return None, None, False
            self.breakers.record(pool, replica, ok=False)
            counters[f"prefill_failed:{replica or 'unknown'}"] += 1
            kind = "timed out" if isinstance(exc, TimeoutError) else "failed"
            self._decide(spec, f"attempt {tid} {kind} on {replica or 'unknown replica'}")
            return None, replica, True


async def _run_to_end(work: Awaitable[T]) -> tuple[T, bool]:
    """`work`'s result, waiting for it even if this task is cancelled meanwhile, and whether
    it was (then the caller undoes what the work did). A cancelled task whose work failed
    raises CancelledError (from the work's error)."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:  # noqa: BLE001 - the work's own error, raised below
            break
    if task.cancelled():
        raise asyncio.CancelledError
    error = task.exception()
    if error is not None:
        if cancelled:
            raise asyncio.CancelledError from error
        raise error
    return task.result(), cancelled


async def _resolve(response: Any) -> Any:
    return await response


def _cancel(response: Any) -> None:
    cancel = getattr(response, "cancel", None)
    if cancel is not None:
        cancel()
