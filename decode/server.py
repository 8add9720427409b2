"""The decode replica (the `DecodeServer` deployment), and the orchestrator of each request
(decode-as-orchestrator); remote-prefill attempts are `decode/remote_prefill.py`'s.

A request's life here (one streaming `generate` call from the ingress), once it holds one
of the replica's stream slots (`replica/slot_gate.py`: waiters admitted by priority):

    local prefill (short prompt, colocated, a short suffix after a cached prefix, or no
    KV room now):
        queued in the engine ──prefill (after its cached prefix) + decode──▶ deltas streamed
    remote prefill:
        pin the cached prefix + reserve the rest (WAITING_FOR_KV) ──open ticket (the rest's
        blocks)──▶ prefill pool `prefill(req, ticket)`
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
Prefix reuse: the blocks of the prompt's prefix this replica's cache holds for the tenant
are pinned by the reservation (a reference each, never in the ticket, so no writer touches
them) and pass with the rest to the decoding request; every path that frees a reservation
drops those references too, and the prefix stays cached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from functools import partial
from typing import Any, cast

from decode.breaker import BreakerBoard, BreakerSettings, PrefillPlanner
from decode.remote_prefill import (
    FENCE_MARGIN_S,
    MAX_REMOTE_ATTEMPTS,
    PrefillHandle,
    RemotePrefill,
    known_replicas,
    on_engine,
    transfer_id,
)
from decode.reservations import ReservationTable
from decode.warm_up import PrefillWarmer
from engine.builtin import resolve_model_dir
from engine.config import EngineConfig
from engine.kv_cache import KVCacheSpec
from engine.loader import load_model_config
from engine.outputs import RequestOutput
from engine.request import Request
from engine.tp_kv import allocate_for_engine
from kvtransfer import KVLayout, TransferOptions
from kvtransfer import create_receiver as create_kv_receiver
from kvtransfer.ranks import AnyReceiver, GroupReceiver, open_group_receiver
from replica.calls import PoolCalls
from replica.engine_replica import EngineReplica, ObserverFactory, model_id_for
from replica.generation_trace import GenerationTrace
from replica.protocol import GenerationSpec
from replica.signals import decode_signals
from replica.streams import Streams


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
        calls: PoolCalls = PoolCalls(),
        local_prefill_threshold: int = 0,
        per_rank: bool = False,
    ) -> None:
        """`telemetry(role)`, when given, sets up this process's tracing first (once);
        `cpu_affinity` pins the process to those cores (`PoolConfig.cpu_affinity`);
        `calls`: the serving framework's hooks for calls to the prefill pools (the app
        passes Serve's, `app/serve/calls.py`); a request routed to a prefill pool is
        prefilled here when this replica holds a prefix of its prompt and the rest is
        shorter than `local_prefill_threshold` tokens (0: never); `per_rank` (tensor
        parallel): every rank lands its own KV shard (`kvtransfer.ranks`)."""
        if telemetry is not None:
            telemetry(f"decode:{pool}")
        self.pool = pool
        self.deadline_s = deadline_s
        self.local_prefill_threshold = local_prefill_threshold
        self.breakers = BreakerBoard(breaker)  # event loop only
        self.planner = PrefillPlanner(self.breakers, known_replicas)
        self.prefill_pools = dict(prefill_pools or {})
        self.receiver: AnyReceiver | None = None
        kv_cache = None
        ranks = None
        if self.prefill_pools:
            model_dir = str(resolve_model_dir(engine_config.model_dir))
            model_config = load_model_config(model_dir, engine_config.dtype)
            spec = KVCacheSpec.for_engine(engine_config, model_config)
            model_id = model_id_for(model_config, model_dir)
            network = _network_endpoint(backend, receiver_endpoint or {})
            if per_rank and engine_config.tensor_parallel_size > 1:
                ranks = open_group_receiver(
                    backend,
                    spec,
                    model_id=model_id,
                    options=transfer_options,
                    device=engine_config.device,
                    network=network,
                    release=lambda tid: self.reservations.on_release(tid),
                )
                kv_cache = ranks[0].kv_cache  # rank 0's shard; each worker lands its own
            else:
                if backend != "shm":
                    kv_cache = allocate_for_engine(
                        spec, engine_config.device, engine_config.tensor_parallel_size
                    )
                self.receiver = create_kv_receiver(
                    backend,
                    spec,
                    kv_cache,
                    model_id=model_id,
                    release=lambda tid: self.reservations.on_release(tid),
                    options=transfer_options,
                    **network,
                )
                kv_cache = self.receiver.kv_cache
        replica = None
        try:
            replica = EngineReplica(
                f"decode:{pool}",
                engine_config,
                kv_cache=kv_cache,
                cpu_affinity=cpu_affinity,
                rank_endpoints=None if ranks is None else ranks[1],
            )
            if ranks is not None:
                workers = replica.engine.workers
                assert workers is not None
                self.receiver = GroupReceiver(
                    ranks[0],
                    workers.links,
                    workers.rank_endpoints,
                    KVLayout.from_spec(spec, model_id),
                    ranks[2],
                )
        except BaseException:  # the receiver's listener, threads and shared memory go too
            for endpoint in (self.receiver, None if ranks is None else ranks[0]):
                if endpoint is not None:
                    endpoint.close()
            if replica is not None:
                replica.shutdown()
            raise
        self.replica = replica
        self.engine = self.replica.engine
        self.loop = self.replica.loop
        # Streams at once, admitted by priority, and their timelines; event loop only.
        self.streams = Streams(self.replica.name, pool, engine_config.scheduler.max_num_seqs)
        self.reservations = ReservationTable(self.engine, self.loop, self.receiver)
        self._reservations = self.reservations.entries  # by transfer id
        self.remote: RemotePrefill | None = None  # None: every prompt is prefilled here
        self.warmer: PrefillWarmer | None = None
        if self.receiver is not None:
            self.loop.between_steps.append(self.reservations.check_leases)
            self.remote = RemotePrefill(
                self.replica,
                self.receiver,
                self.reservations,
                self.prefill_pools,
                self.planner,
                deadline_s,
                transfer_options.fence_timeout_s + FENCE_MARGIN_S,
                calls,
            )
            self.warmer = PrefillWarmer(
                self.prefill_pools,
                self.receiver.endpoint,
                known_replicas,
                new_call_id=calls.new_call_id,
            )
        self.replica.observers.extend(make(self.stats) for make in observers)

    # ---- the request -----------------------------------------------------------------

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[RequestOutput]:
        """Stream `spec`'s deltas once it holds one of the replica's slots (`Streams`:
        most important first); prefill remotely when the spec names a prefill pool."""
        async with contextlib.aclosing(self.streams.serve(spec, self._generate)) as deltas:
            async for delta in deltas:
                yield delta

    async def _generate(
        self, spec: GenerationSpec, timeline: GenerationTrace
    ) -> AsyncGenerator[RequestOutput, None]:
        counted = False
        deltas = self._deltas(spec, timeline)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                if not counted and delta.new_token_ids:  # the prompt is in the cache
                    counted = True
                    self._count_prompt(delta)
                yield delta

    async def _deltas(
        self, spec: GenerationSpec, timeline: GenerationTrace
    ) -> AsyncGenerator[RequestOutput, None]:
        request = self.replica.make_request(spec)
        timeline.local_request = request
        remote = None if spec.prefill_pool is None else self.remote
        if remote is not None and self._suffix_is_short(request):
            self.replica.counters["local_suffix_prefill"] += 1
            remote = None
        if remote is None:
            self.replica.counters["local_prefill"] += 1
            async with contextlib.aclosing(self.replica.generate_whole(request)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        rid = spec.request_id
        deadline = time.monotonic() + (spec.timeout_s if spec.timeout_s is not None else 1e9)
        try:
            started = await remote.run(spec, deadline, timeline)
            if started is None:
                self.replica.counters["local_prefill_fallback"] += 1
                started = rid, self.loop.open_stream(rid)
                await on_engine(self.replica, partial(self.engine.add_request, request), rid)
            engine_id, stream = started
            deltas = cast(AsyncGenerator[RequestOutput, None], self.loop.stream(engine_id, stream))
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    yield dataclasses.replace(delta, request_id=rid)
        finally:
            for engine_id in (rid, *(transfer_id(rid, i) for i in range(MAX_REMOTE_ATTEMPTS))):
                self.loop.close_stream(engine_id)
                reservation = self._reservations.get(engine_id)
                if reservation is not None:  # its release (or the lease check) frees it
                    reservation.owned = False

    def _suffix_is_short(self, request: Request) -> bool:
        """Whether the part of `request`'s prompt this replica's prefix cache lacks (for
        its tenant) is short enough to compute here, against the cached prefix, rather
        than on a prefill replica: shorter than `local_prefill_threshold`, the length
        below which the router prefills whole prompts where they decode."""
        cached = self.engine.kv_manager.cached_prefix_tokens(
            request.prompt_token_ids, request.tenant
        )
        return cached > 0 and request.num_prompt_tokens - cached < self.local_prefill_threshold

    def _count_prompt(self, delta: RequestOutput) -> None:
        """Token counters of a request whose prompt is in this replica's cache: of its
        prompt tokens, those this replica's prefix cache held (`cached_tokens`), computed
        here (`computed_tokens`), received by a transfer (`transferred_tokens`), and the
        prompt tokens of remotely prefilled requests (`full_transfer_tokens`: what whole
        transfers would have moved)."""
        counters = self.replica.counters
        num_prompt, num_moved = delta.num_prompt_tokens, delta.num_transferred_tokens
        counters["prompt_tokens"] += num_prompt
        if num_moved:  # prefilled remotely, after the prefix this replica held
            counters["cached_tokens"] += num_prompt - num_moved
            counters["transferred_tokens"] += num_moved
            counters["full_transfer_tokens"] += num_prompt
        else:
            counters["cached_tokens"] += delta.num_cached_tokens
            counters["computed_tokens"] += num_prompt - delta.num_cached_tokens

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
        itself, from their first step to their first token) and sends degradable requests
        to the fallback pool while `prefill_breakers` (prefill pool -> `open`/`half_open`;
        closed ones left out) says a prefill pool is cut off here. Also connects new
        prefill replicas to this replica's KV receiver (`decode/warm_up.py`). Never blocks."""
        if self.warmer is not None:
            self.warmer.tick()
        return {
            **await self.replica.routing_stats(),
            "prefill_tokens_per_s": self.replica.local_prefill.tokens_per_s(),
            "prefill_breakers": self.planner.blocked_pools(),
            "admission": self.streams.admission.snapshot(),
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve polls this for the pool's autoscaling policy (`replica/signals.py`
        names the signals). Never blocks the event loop."""
        return decode_signals(self.loop.occupancy, self.streams.itl_ms)

    def check_health(self) -> None:
        """Serve's health check: fails when the engine loop is dead or stuck, or the KV
        receiver is closed or lost its threads (cheap: reads a few fields)."""
        self.replica.check_health()
        problem = self.receiver.serving_problem() if self.receiver is not None else None
        if problem is not None:
            raise RuntimeError(f"decode KV receiver cannot serve: {problem}")

    def shutdown(self) -> None:
        """Close the KV receiver, then the replica: its engine loop and the engine's
        tensor-parallel worker processes (`EngineReplica.shutdown`)."""
        if self.receiver is not None:
            self.receiver.close()
        self.replica.shutdown()

    def __del__(self) -> None:
        # Ray Serve calls __del__ when it stops a replica; free shm and threads then.
        with contextlib.suppress(Exception):
            self.shutdown()
