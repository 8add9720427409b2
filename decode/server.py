"""The decode replica, and the orchestrator of each request (decode-as-orchestrator).

A request's life here (one streaming `generate` call from the ingress), once it holds one
of the replica's stream slots (`decode/admission.py`: waiters admitted by priority):

    local prefill (short prompt, colocated, or no KV room now):
        queued in the engine ──prefill + decode──▶ deltas streamed
    remote prefill:
        reserve blocks (WAITING_FOR_KV) ──open ticket──▶ prefill pool `prefill(req, ticket)`
        ──KV lands layer by layer──▶ DONE ──first token──▶ RUNNING ──deltas streamed
        on failure: abort the transfer, retry once (a fresh reservation and ticket) on
        another replica, then prefill locally; circuit breakers (`decode/breaker.py`) skip
        replicas and pools that keep failing, and the request's deadline bounds it all

KV ownership (`decode/reservations.py`): once a ticket is open, reserved blocks return to
the pool only through the receiver's `release`, never right after `abort`. Every attempt
has its own transfer id (`<request id>#<attempt>`), which is also the engine request id of
its reservation (and of the decoding that follows, relabelled for the caller): a late
`release` of a dead attempt can never free the blocks of the next one, and a retry need not
wait for a dead attempt's blocks, which stay fenced as long as its writer may still run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Collection,
    Mapping,
    Sequence,
)
from functools import partial
from typing import Any, Protocol, TypeVar, cast

from decode.admission import SlotGate
from decode.breaker import BreakerBoard, BreakerSettings, PrefillPlan, PrefillPlanner
from decode.placement import placements, pool_view
from decode.protocol import GenerationSpec
from decode.reservations import Reservation, ReservationTable
from decode.serve_calls import new_call_id
from decode.trace import GenerationTrace
from engine.async_engine import EngineDeadError
from engine.builtin import resolve_model_dir
from engine.config import EngineConfig
from engine.kv_cache import KVCacheSpec
from engine.loader import load_model_config
from engine.outputs import RequestOutput
from engine.replica import EngineReplica, ObserverFactory, PrefillRate, model_id_for
from engine.request import Request
from engine.signals import RecentSamples, decode_signals
from engine.tp_kv import allocate_for_engine
from kvtransfer import (
    KVTransferError,
    Receiver,
    Ticket,
    TransferOptions,
    TransferState,
)
from kvtransfer import create_receiver as create_kv_receiver
from prefill.protocol import PrefillRequest, PrefillResult

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_REMOTE_ATTEMPTS = 2  # the first try, then one retry (Serve may pick another replica)
FENCE_MARGIN_S = 2.0  # on top of fence_timeout_s: the release's trip to the engine thread
MAX_ADMISSION_WAIT_S = 600.0  # for a slot, when the request has no deadline of its own
ADMISSION_MARGIN_S = 1.0  # past the request's deadline: the ingress's 504 comes first


class PrefillHandle(Protocol):
    """What the decode server needs of a prefill pool (a Serve `DeploymentHandle`)."""

    @property
    def prefill(self) -> Any: ...


def _network_endpoint(backend: str, endpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The receiver's address settings: tcp/nccl only (shm has none); a receiver listening on
    every interface with no `advertise_host` names this node's IP (from Ray) in tickets."""
    if backend == "shm":
        return {}
    settings = dict(endpoint)
    if settings.get("host") in ("0.0.0.0", "::") and not settings.get("advertise_host"):
        import ray.util

        settings["advertise_host"] = ray.util.get_node_ip_address()
    return settings


class DecodeServer:
    """One decode replica (Ray Serve wraps it as the `DecodeServer` deployment)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        backend: str,
        transfer_options: TransferOptions = TransferOptions(),
        deadline_s: float = 30.0,
        prefill_pools: Mapping[str, PrefillHandle] | None = None,
        pool: str = "decode",
        receiver_endpoint: Mapping[str, Any] | None = None,
        breaker: BreakerSettings = BreakerSettings(),
        observers: Sequence[ObserverFactory] = (),
        telemetry: Callable[[str], object] | None = None,
        cpu_affinity: Sequence[int] | None = None,
    ) -> None:
        """`telemetry(role)`, when given, sets up this process's tracing first (once);
        `cpu_affinity` pins the process to those cores (`PoolConfig.cpu_affinity`)."""
        if telemetry is not None:
            telemetry(f"decode:{pool}")
        self.pool = pool
        self._timelines: dict[str, GenerationTrace] = {}  # by request id (event loop only)
        self.deadline_s = deadline_s
        self.breakers = BreakerBoard(breaker)  # event loop only
        self.planner = PrefillPlanner(self.breakers, _known_replicas)
        # Streams at once, admitted by priority (`decode/admission.py`); event loop only.
        self.admission = SlotGate(engine_config.scheduler.max_num_seqs)
        self.prefill_pools = dict(prefill_pools or {})
        self.receiver: Receiver | None = None
        self.fence_allowance_s = transfer_options.fence_timeout_s + FENCE_MARGIN_S
        kv_cache = None
        if self.prefill_pools:
            model_dir = str(resolve_model_dir(engine_config.model_dir))
            model_config = load_model_config(model_dir, engine_config.dtype)
            spec = KVCacheSpec.for_engine(engine_config, model_config)
            if backend != "shm":
                kv_cache = allocate_for_engine(
                    spec, engine_config.device, engine_config.tensor_parallel_size
                )
            self.receiver = create_kv_receiver(
                backend,
                spec,
                kv_cache,
                model_id=model_id_for(model_config, model_dir),
                release=lambda transfer_id: self.reservations.on_release(transfer_id),
                options=transfer_options,
                **_network_endpoint(backend, receiver_endpoint or {}),
            )
            kv_cache = self.receiver.kv_cache
        self.replica = EngineReplica(
            f"decode:{pool}", engine_config, kv_cache=kv_cache, cpu_affinity=cpu_affinity
        )
        self.engine = self.replica.engine
        self.loop = self.replica.loop
        self.reservations = ReservationTable(self.engine, self.loop, self.receiver)
        self._reservations = self.reservations.entries  # by transfer id
        if self.receiver is not None:
            self.loop.between_steps.append(self.reservations.check_leases)
        self._itl_ms = RecentSamples()  # autoscaling signal (event loop only)
        self._local_prefill = PrefillRate()  # for adaptive disaggregation (event loop only)
        self._num_routing_reports = 0
        self.replica.observers.extend(make(self.stats) for make in observers)

    # ---- the request -----------------------------------------------------------------

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[RequestOutput]:
        """Stream `spec`'s deltas once it holds one of the replica's slots (`SlotGate`:
        most important first); prefill remotely when the spec names a prefill pool."""
        last_token_at: float | None = None
        timeline = self._timelines[spec.request_id] = GenerationTrace(
            spec, self.replica.name, self.pool
        )
        finish_reason: str | None = None
        error: BaseException | None = None
        wait_s = MAX_ADMISSION_WAIT_S
        if spec.timeout_s is not None:
            wait_s = spec.timeout_s + ADMISSION_MARGIN_S
        try:
            # aclosing: when our caller goes away, the inner generator's cleanup runs now.
            async with (
                self.admission.slot(spec.priority, wait_s),
                contextlib.aclosing(self._generate(spec)) as deltas,
            ):
                async for delta in deltas:
                    delta = timeline.on_delta(delta)
                    finish_reason = delta.finish_reason or finish_reason
                    if delta.new_token_ids:
                        now = time.perf_counter()
                        if last_token_at is not None:
                            per_token = (now - last_token_at) * 1000 / len(delta.new_token_ids)
                            self._itl_ms.add(per_token)
                        last_token_at = now
                    yield delta
        except BaseException as exc:
            error = exc
            raise
        finally:
            if self._timelines.get(spec.request_id) is timeline:
                del self._timelines[spec.request_id]
            timeline.finish(finish_reason, error)

    async def _generate(self, spec: GenerationSpec) -> AsyncGenerator[RequestOutput, None]:
        request = self._make_request(spec)
        self._timelines[spec.request_id].local_request = request
        if spec.prefill_pool is None or self.receiver is None:
            self.replica.counters["local_prefill"] += 1
            submitted = time.perf_counter()
            async for delta in self.loop.generate(request):
                if delta.new_token_ids and delta.num_output_tokens == len(delta.new_token_ids):
                    # The first token: the prompt was computed (after any queueing) by now.
                    computed = len(request.prompt_token_ids) - delta.num_cached_tokens
                    self._local_prefill.add(computed, time.perf_counter() - submitted)
                yield delta
            return
        rid = spec.request_id
        deadline = time.monotonic() + (spec.timeout_s if spec.timeout_s is not None else 1e9)
        try:
            started = await self._prefill_remotely(spec, deadline)
            if started is None:
                self.replica.counters["local_prefill_fallback"] += 1
                started = rid, self.loop.open_stream(rid)
                await self._on_engine(partial(self.engine.add_request, request), rid)
            engine_id, stream = started
            deltas = cast(AsyncGenerator[RequestOutput, None], self.loop.stream(engine_id, stream))
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    yield dataclasses.replace(delta, request_id=rid)
        finally:
            for engine_id in (rid, *(_transfer_id(rid, i) for i in range(MAX_REMOTE_ATTEMPTS))):
                self.loop.close_stream(engine_id)
                reservation = self._reservations.get(engine_id)
                if reservation is not None:  # its release (or the lease check) frees it
                    reservation.owned = False

    def _make_request(self, spec: GenerationSpec, request_id: str | None = None) -> Request:
        return self.engine.make_request(
            list(spec.prompt_token_ids),
            spec.sampling_params,
            request_id=request_id or spec.request_id,
            tenant=spec.tenant,
            priority=spec.priority,
        )

    async def _on_engine(self, fn: Callable[[], T], engine_id: str) -> T:
        """Run `fn` (which starts `engine_id` decoding) on the engine thread. If the caller
        is cancelled meanwhile, `fn` still runs and an abort of the request follows it."""
        future = self.loop.call(fn)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except BaseException:
            with contextlib.suppress(EngineDeadError):
                self.loop.abort(engine_id)  # queued after fn: commands run in order
            raise

    async def _prefill_remotely(
        self, spec: GenerationSpec, deadline: float
    ) -> tuple[str, asyncio.Queue] | None:
        """Try remote prefill (with one retry on another replica) while the breakers and
        the request's `deadline` (monotonic) allow. When decoding has started: the engine
        request id it runs under and its delta stream; None: prefill locally."""
        assert self.receiver is not None and spec.prefill_pool is not None
        failed: list[str] = []  # replicas that failed this request: never retried
        for attempt in range(MAX_REMOTE_ATTEMPTS):
            plan = self._plan(spec, failed, deadline)
            if not plan.remote:
                return None
            if attempt:
                self.replica.counters["prefill_retries"] += 1
            reservation = Reservation(_transfer_id(spec.request_id, attempt))
            window_s = min(self.deadline_s, deadline - time.monotonic())
            timeline = self._timelines[spec.request_id]
            timeline.reserve_started()
            ticket = await self._reserve(spec, reservation, window_s)
            timeline.reserved(reservation.transfer_id, ticket is not None)
            if ticket is None:
                self.replica.counters["no_kv_room"] += 1
                return None  # prefill locally: the engine queues it until blocks free up
            timeline.prefill_call_started(reservation.transfer_id, spec.prefill_pool)
            result, replica, may_retry = await self._transfer(spec, reservation, ticket, plan)
            timeline.prefill_call_ended(result, replica)
            if result is None:
                if not may_retry:
                    return None
                if replica is not None:
                    failed.append(replica)
                continue  # the dead attempt's blocks come back through its release
            self.replica.counters["remote_prefill"] += 1
            self.replica.counters[f"prefill_pool:{spec.prefill_pool}"] += 1
            self.replica.counters["remote_cached_tokens"] += result.num_cached_tokens
            engine_id = reservation.transfer_id
            stream = self.loop.open_stream(engine_id)

            def start(
                result: PrefillResult = result,
                landed: Reservation = reservation,
                timeline: GenerationTrace = timeline,
            ) -> None:
                # The KV landed (DONE): no writer left, the blocks pass to the decoding request.
                self.reservations.forget(landed)
                delta = self.engine.kv_received(
                    landed.transfer_id,
                    result.first_token_id,
                    result.logprobs,
                    result.num_cached_tokens,
                )
                self.loop.publish(delta)
                timeline.published()

            await self._on_engine(start, engine_id)
            return engine_id, stream
        return None

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

    async def _reserve(
        self, spec: GenerationSpec, reservation: Reservation, window_s: float | None = None
    ) -> Ticket | None:
        """Reserve the attempt's blocks and open its ticket (deadline `window_s` from now,
        default `deadline_s`); None: no room now."""
        assert self.receiver is not None
        request = self._make_request(spec, reservation.transfer_id)
        self.reservations.add(reservation)
        reserve = self.loop.call(partial(self.engine.reserve_for_kv, request))
        try:
            block_ids = await asyncio.shield(asyncio.wrap_future(reserve))
        except BaseException:
            # Cancelled before the ticket: no writer can have these blocks. Drop them after
            # the reservation has run (engine commands run in order).
            with contextlib.suppress(EngineDeadError):
                self.loop.call(partial(self.reservations.drop_unticketed, reservation, reserve))
            raise
        if block_ids is None:
            self.reservations.forget(reservation)
            return None
        try:
            ticket = self.receiver.open_ticket(
                reservation.transfer_id, block_ids, window_s or self.deadline_s
            )
        except BaseException:
            with contextlib.suppress(EngineDeadError):
                self.loop.call(partial(self.reservations.drop_unticketed, reservation, reserve))
            raise
        reservation.ticket_open = True
        reservation.expires_at = time.monotonic() + ticket.seconds_left() + self.fence_allowance_s
        return ticket

    async def _transfer(
        self, spec: GenerationSpec, reservation: Reservation, ticket: Ticket, plan: PrefillPlan
    ) -> tuple[PrefillResult | None, str | None, bool]:
        """Have the prefill pool fill the attempt's ticket: (the result, or None when the
        attempt failed; the replica that served or failed it, None if unknown or never
        routed; whether a retry may help: not after a timeout no replica took, nor when the
        pool's queue is full).
        A failed transfer is aborted and its blocks come back through `release`. The
        outcome feeds the pool's and the replica's circuit breakers."""
        assert self.receiver is not None and spec.prefill_pool is not None
        pool = spec.prefill_pool
        transfer_id = reservation.transfer_id
        prefill_request = PrefillRequest(
            request_id=transfer_id,
            prompt_token_ids=spec.prompt_token_ids,
            sampling_params=spec.sampling_params,
            tenant=spec.tenant,
            priority=spec.priority,
            exclude_replicas=plan.exclude_replicas,
            probe_replica=plan.probe_replica,
            trace_context=self._timelines[spec.request_id].carrier,
        )
        response: Any = None
        try:
            new_call_id()  # an earlier attempt may still be pending in the router
            response = self.prefill_pools[spec.prefill_pool].prefill.remote(prefill_request, ticket)
            # Bounded by the ticket's deadline: a prefill pool with no live replica must
            # not hang the request (Serve would queue the call indefinitely).
            result: PrefillResult = await asyncio.wait_for(
                _resolve(response), timeout=max(ticket.seconds_left(), 0.0) + 1.0
            )
            state = self.receiver.poll(transfer_id)
            if not state.is_terminal:
                state = await asyncio.to_thread(self.receiver.wait, transfer_id, 5.0)
            if state != TransferState.DONE:
                raise self.receiver.error(transfer_id) or KVTransferError(
                    f"KV of {transfer_id} ended {state.value}"
                )
            placements.pop(transfer_id)
            self.breakers.record(pool, result.replica, ok=True)
            self.replica.counters[f"prefill_ok:{result.replica}"] += 1
            return result, result.replica, False
        except BaseException as exc:
            self.receiver.abort(transfer_id)  # the blocks come back through release
            ended = self.receiver.poll(transfer_id)
            if ended is TransferState.DONE:
                # It landed after all: no release will come, and no writer is left.
                with contextlib.suppress(EngineDeadError):
                    self.loop.call(partial(self.reservations.free, reservation))
            if response is not None:
                _cancel(response)
            replica = placements.pop(transfer_id)
            if not isinstance(exc, Exception):  # cancelled, or the generator closed
                raise
            logger.warning("remote prefill attempt %s on %s failed: %r", transfer_id, replica, exc)
            self.replica.counters["prefill_failures"] += 1
            self.replica.counters[f"kv_transfer_failures:{ended.value}"] += 1
            if _is_backpressure(exc):  # the pool's queue is full: not the replica's fault
                self.replica.counters["prefill_backpressure"] += 1
                self._decide(spec, f"pool {pool} queue full -> local prefill")
                return None, None, False
            if isinstance(exc, TimeoutError) and replica is None:
                # Never routed (the pool is saturated or down): no blind retry.
                self.breakers.record(pool, None, ok=False)
                self.replica.counters["prefill_failed:unrouted"] += 1
                self._decide(spec, f"attempt {transfer_id} timed out unrouted -> local prefill")
                return None, None, False
            self.breakers.record(pool, replica, ok=False)
            self.replica.counters[f"prefill_failed:{replica or 'unknown'}"] += 1
            kind = "timed out" if isinstance(exc, TimeoutError) else "failed"
            self._decide(spec, f"attempt {transfer_id} {kind} on {replica or 'unknown replica'}")
            return None, replica, True

    # ---- operations ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Never waits on the engine thread: fine on the event loop or in Serve's threads."""
        stats = {"pool": self.pool, **self.replica.stats()}
        stats.update(self.planner.snapshot())  # breakers, prefill_decisions
        if self.receiver is not None:  # blocks of ended transfers still fenced, quarantined
            stats["kv_transfers"] = self.receiver.transfer_counts()
            stats["kv_endpoint"] = self.receiver.endpoint_stats()  # peers refused, by reason
        return stats

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this; our replica router reads it, and the ingress weighs a local
        prefill's cost from it (`prefill_tokens_per_s`: the prompts this replica prefilled
        itself, queueing included) and sends degradable requests to the fallback pool
        while `prefill_breakers` (prefill pool -> `open`/`half_open`; closed ones left out)
        says a prefill pool is cut off here. `num_reports` makes every report differ, so
        Serve passes each on and a live idle replica's load never looks stale. Never blocks."""
        self._num_routing_reports += 1
        return {
            **await self.replica.routing_stats(),
            "prefill_tokens_per_s": self._local_prefill.tokens_per_s(),
            "prefill_breakers": self.planner.blocked_pools(),
            "admission": self.admission.snapshot(),
            "num_reports": self._num_routing_reports,
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve polls this for the pool's autoscaling policy (`engine/signals.py`
        names the signals). Never blocks the event loop."""
        return decode_signals(self.loop.occupancy, self._itl_ms)

    def check_health(self) -> None:
        """Serve's health check: fails when the engine loop is dead or stuck, or the KV
        receiver is closed or lost its threads (cheap: reads a few fields)."""
        self.replica.check_health()
        problem = self.receiver.serving_problem() if self.receiver is not None else None
        if problem is not None:
            raise RuntimeError(f"decode KV receiver cannot serve: {problem}")

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.replica.shutdown()

    def __del__(self) -> None:
        # Ray Serve calls __del__ when it stops a replica; free shm and threads then.
        with contextlib.suppress(Exception):
            self.shutdown()


def _known_replicas(pool: str) -> Collection[str] | None:
    snapshot = pool_view.get(pool)
    return None if snapshot is None else snapshot.replicas.keys()


def _transfer_id(request_id: str, attempt: int) -> str:
    return f"{request_id}#{attempt}"


def _is_backpressure(exc: BaseException) -> bool:
    """Serve's `BackPressureError` (the handle's `max_queued_requests` is reached), by name:
    nothing below `app/` imports Ray Serve."""
    return any(type(e).__name__ == "BackPressureError" for e in (exc, exc.__cause__))


async def _resolve(response: Any) -> Any:
    return await response


def _cancel(response: Any) -> None:
    cancel = getattr(response, "cancel", None)
    if cancel is not None:
        cancel()
