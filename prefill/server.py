"""The prefill replica: computes prompts and streams their KV to decode, layer by layer.

A request's life here:

    prefill(request, ticket) ──connect (handshake)──▶ queued in the engine (prefill_only)
      ──last chunk: after each layer, send_layer──▶ first token sampled (FINISHED_PREFILLED,
      blocks held) ──finish──▶ transfer DONE ──release──▶ blocks freed ──▶ PrefillResult

The source blocks are freed by the sender's `release` callback in every terminal state
(done, failed, aborted, expired), so a dead or slow decode peer never strands them.

A replica of a pool with `serves_decode` also serves whole requests (`generate`, called by
the ingress's decode overflow while the decode pool is busier): prompt and decode on this
engine, no KV transfer, admitted and traced as on a decode replica (`replica/streams.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np

from engine.builtin import resolve_model_dir
from engine.config import EngineConfig
from engine.kv_cache import KVCacheSpec
from engine.loader import load_model_config
from engine.outputs import RequestOutput
from engine.scheduler import SchedulerOutput
from engine.tp_worker import RankSends
from kvtransfer import KVLayout, KVTransferError, Ticket, TransferOptions, TransferState
from kvtransfer import create_sender as create_kv_sender
from kvtransfer.ranks import AnySender, GroupSender, open_group_sender
from kvtransfer.reshard import Resharding
from prefill.trace import PrefillTrace
from replica.engine_replica import EngineReplica, ObserverFactory, model_id_for
from replica.generation_trace import GenerationTrace
from replica.protocol import GenerationSpec, PrefillRequest, PrefillResult, WarmRequest
from replica.signals import (
    SIGNAL_WINDOW_S,
    RecentSamples,
    prefill_signals,
    prompt_tokens_per_s,
)
from replica.streams import Streams

logger = logging.getLogger(__name__)


class PrefillServer:
    """One prefill replica (Ray Serve wraps it as the `PrefillServer` deployment)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        backend: str,
        transfer_options: TransferOptions = TransferOptions(),
        pool: str = "prefill",
        telemetry: Callable[[str], object] | None = None,
        observers: Sequence[ObserverFactory] = (),
        cpu_affinity: Sequence[int] | None = None,
        source_host: str | None = None,
        serves_decode: bool = False,
        per_rank: bool = False,
    ) -> None:
        """`telemetry(role)`, when given, sets up this process's tracing first (once);
        each of `observers` is called with `stats` once the replica is built;
        `cpu_affinity` pins the process to those cores (`PoolConfig.cpu_affinity`); tcp
        connections to decode replicas leave from `source_host` when given;
        `serves_decode` (`PoolConfig.serves_decode`): `generate` serves whole requests;
        `per_rank` (tensor parallel): every rank sends its own KV shard to the same rank of
        a decode replica of the same TP size (`kvtransfer.ranks`)."""
        if telemetry is not None:
            telemetry(f"prefill:{pool}")
        self.pool = pool
        ranks = None
        if per_rank and engine_config.tensor_parallel_size > 1:
            model_dir = str(resolve_model_dir(engine_config.model_dir))
            model_config = load_model_config(model_dir, engine_config.dtype)
            spec = KVCacheSpec.for_engine(engine_config, model_config)
            model_id = model_id_for(model_config, model_dir)
            ranks = open_group_sender(
                backend,
                spec,
                model_id=model_id,
                options=transfer_options,
                device=engine_config.device,
                source_host=source_host,
                release=self._on_release,
            )
        replica = None
        self.sender: AnySender
        try:
            replica = EngineReplica(
                f"prefill:{pool}",
                engine_config,
                cpu_affinity=cpu_affinity,
                rank_endpoints=None if ranks is None else ranks[1],
                calibrate=True,  # its rate is known before its first prompt
            )
            if ranks is not None:  # every rank sends its own KV shard (`kvtransfer.ranks`)
                workers = replica.engine.workers
                assert workers is not None
                layout = KVLayout.from_spec(replica.engine.kv_spec, replica.model_id)
                self.sender = GroupSender(ranks[0], workers.links, layout, ranks[2])
            else:
                self.sender = create_kv_sender(
                    backend,
                    replica.engine.kv_spec,
                    model_id=replica.model_id,
                    release=self._on_release,
                    options=transfer_options,
                    host=source_host if backend == "tcp" else None,
                )
        except BaseException:  # rank 0's sender, its threads and the workers go too
            if ranks is not None:
                ranks[0].close()
            if replica is not None:
                replica.shutdown()
            raise
        self.replica = replica
        self.engine = replica.engine
        self._tickets: dict[str, Ticket] = {}
        self._traces: dict[str, PrefillTrace] = {}
        self.replica.loop.layer_hook_for = self._layer_hook_for
        self._ttft_ms = RecentSamples()  # autoscaling signals (event loop only)
        # The latest prefill rate measured (at start, `replica/calibration.py`, then on the
        # prompts it computes): speed outlasts traffic.
        self._tokens_per_s = replica.calibrated_tokens_per_s
        # Prompt tokens accepted and not yet handed off, by priority (event loop only): the
        # ingress counts only the work at or above a request's priority as ahead of it.
        self._pending_tokens: Counter[int] = Counter()
        # Whole requests (`generate`), when the pool serves them; event loop only.
        self.streams: Streams | None = None
        if serves_decode:
            self.streams = Streams(self.replica.name, pool, engine_config.scheduler.max_num_seqs)
        self.replica.observers.extend(make(self.stats) for make in observers)

    # ---- the requests -----------------------------------------------------------------

    async def prefill(self, spec: PrefillRequest, ticket: Ticket) -> PrefillResult:
        """Called by a decode replica: prefill `spec`'s prompt into `ticket`'s blocks.

        Returns after the transfer is DONE. Raises `KVTransferError` when the hand-off
        fails (the decode side then retries elsewhere or prefills locally).
        """
        start = time.perf_counter()
        rid = spec.request_id
        request = self.replica.make_request(spec, prefill_only=True)
        num_prompt_blocks = self.engine.kv_manager.num_blocks_for(request.num_prompt_tokens)
        if ticket.num_cached_blocks + ticket.num_blocks != num_prompt_blocks:
            raise KVTransferError(
                f"ticket for {rid} has {ticket.num_blocks} blocks after "
                f"{ticket.num_cached_blocks} cached, prompt needs {num_prompt_blocks}"
            )
        self.replica.counters["requests"] += 1
        # what moves: the ticket's blocks in the receiver's items (its TP size, not ours)
        transfer_bytes = ticket.layout.cache_spec(ticket.num_blocks).total_bytes
        timeline = PrefillTrace(spec, self.replica.name, transfer_bytes)
        first = None
        self._pending_tokens[spec.priority] += len(spec.prompt_token_ids)
        try:
            # Inside the try: a caller cancelled mid-handshake still gets the transfer
            # aborted (the connect thread runs on; abort reaches the receiver either way).
            await asyncio.to_thread(self.sender.connect, ticket, ticket.seconds_left())
            self._tickets[rid] = ticket
            self._traces[rid] = timeline
            async for delta in self.replica.loop.generate(request):
                first = delta
            timeline.sampled()
            if first is None or first.finish_reason != "prefilled":
                raise KVTransferError(f"prefill of {rid} ended as {first and first.finish_reason}")
            self.sender.finish(ticket)
            state = await asyncio.to_thread(self.sender.wait, rid, max(ticket.seconds_left(), 0.1))
            if state != TransferState.DONE:
                error = self.sender.error(rid)
                raise error or KVTransferError(f"KV transfer of {rid} ended {state.value}")
        except BaseException as exc:
            self.sender.abort(rid)  # idempotent; release frees the blocks
            self.replica.counters["failed"] += 1
            timeline.finish(request, "failed" if isinstance(exc, Exception) else "aborted", exc)
            raise
        finally:
            self._tickets.pop(rid, None)
            self._traces.pop(rid, None)
            self._pending_tokens[spec.priority] -= len(spec.prompt_token_ids)
            if not self._pending_tokens[spec.priority]:
                del self._pending_tokens[spec.priority]
        phases = timeline.finish(request, state.value)
        self._count_tokens(request.num_prompt_tokens, first.num_cached_tokens, ticket)
        self.replica.counters["kv_transfer_bytes"] += transfer_bytes
        self.replica.counters["kv_transfer_us"] += round(phases.transfer_ms * 1000)
        self.replica.observe("queue_seconds", phases.queue_ms / 1000)
        self.replica.observe("prefill_seconds", (phases.compute_ms + phases.transfer_ms) / 1000)
        self._ttft_ms.add((time.perf_counter() - start) * 1000)
        return PrefillResult(
            request_id=rid,
            first_token_id=first.new_token_ids[0],
            logprobs=first.new_logprobs[0] if first.new_logprobs else None,
            num_cached_tokens=first.num_cached_tokens,
            replica=self.replica.name,
            prefill_ms=(time.perf_counter() - start) * 1000,
            queue_ms=phases.queue_ms,
            compute_ms=phases.compute_ms,
            transfer_ms=phases.transfer_ms,
        )

    def _count_tokens(self, num_prompt: int, num_cached: int, ticket: Ticket) -> None:
        """Per-prompt token counters (whole requests count the first two as well): of its
        prompt tokens, those this replica's prefix cache held (`cached_tokens`) or it
        computed (`computed_tokens`), those whose KV it sent (`transferred_tokens`) and
        those a transfer of the whole prompt would have sent (`full_transfer_tokens`: the
        decode replica held the rest already)."""
        skipped = ticket.num_cached_blocks * self.engine.kv_spec.block_size
        counters = self.replica.counters
        counters["prompt_tokens"] += num_prompt
        counters["cached_tokens"] += num_cached
        counters["computed_tokens"] += num_prompt - num_cached
        counters["transferred_tokens"] += num_prompt - skipped
        counters["full_transfer_tokens"] += num_prompt

    async def warm(self, request: WarmRequest) -> str:
        """Called by a decode replica (`decode/warm_up.py`): connect to its KV receiver now,
        so that its first transfer from here finds the connection ready. Returns this
        replica's name, or "" when it could not connect (logged; the first transfer then
        connects by itself)."""
        try:
            await asyncio.to_thread(self.sender.warm, request.endpoint, request.timeout_s)
        except KVTransferError as exc:
            logger.warning("could not connect to the decode receiver %s: %r", request.endpoint, exc)
            return ""
        return self.replica.name

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[RequestOutput]:
        """Called by the ingress while the decode pool is busier than this pool (decode
        overflow, `app/routing/overflow.py`): serve a whole request here, its prompt
        prefilled and decoded on this replica, no KV transfer. Streams its deltas once it
        holds one of the replica's slots, as a decode replica would."""
        if self.streams is None:
            raise RuntimeError(f"prefill pool {self.pool!r} does not serve whole requests")
        async with contextlib.aclosing(self.streams.serve(spec, self._generate)) as deltas:
            async for delta in deltas:
                yield delta

    async def _generate(
        self, spec: GenerationSpec, timeline: GenerationTrace
    ) -> AsyncGenerator[RequestOutput, None]:
        request = self.replica.make_request(spec)
        timeline.local_request = request
        counters = self.replica.counters
        counters["whole_requests"] += 1
        counted = False
        async for delta in self.replica.generate_whole(request):
            if not counted and delta.new_token_ids:  # the prompt is in the cache
                counted = True
                counters["prompt_tokens"] += delta.num_prompt_tokens
                counters["cached_tokens"] += delta.num_cached_tokens
                counters["computed_tokens"] += delta.num_prompt_tokens - delta.num_cached_tokens
            yield delta

    def _layer_hook_for(self, output: SchedulerOutput):  # noqa: ANN202 - LayerHook | None
        """Engine thread: send each layer of requests whose prompt completes this step.

        Earlier chunks of a long prompt are already in the cache; the last chunk's pass
        streams every block of the prompt the decode replica lacks (the ticket's blocks,
        after those it holds already), overlapping the transfer with its compute.
        """
        sends = []
        timelines = []
        for item in output.scheduled:
            ticket = self._tickets.get(item.request.request_id)
            if ticket is not None and item.samples:
                first = ticket.num_cached_blocks
                sends.append((ticket, item.block_table[first : first + ticket.num_blocks]))
                timeline = self._traces.get(item.request.request_id)
                if timeline is not None and timeline.layer_sent_ns is not None:
                    timelines.append(timeline)
        if not sends:
            return None
        kv = self.engine.kv_cache
        if isinstance(self.sender, GroupSender):  # kv: rank 0's shard; workers send theirs
            group = self.sender

            def own(layer: int) -> None:
                for ticket, block_ids in sends:
                    k, v = kv.key_caches[layer], kv.value_caches[layer]
                    group.send_layer(ticket, layer, k, v, block_ids)
                for timeline in timelines:
                    timeline.layer_sent()

            rows = tuple((t.request_id, tuple(int(b) for b in ids)) for t, ids in sends)
            return RankSends(own, rows)
        size = self.sender.layout.tensor_parallel_size

        def hook(layer: int) -> None:
            for ticket, block_ids in sends:
                if ticket.layout.tensor_parallel_size == size:
                    self.sender.send_layer(
                        ticket, layer, kv.key_caches[layer], kv.value_caches[layer], block_ids
                    )
                elif layer % size == 0:  # every rank has written model layer layer // size
                    self._send_resharded(ticket, layer // size, block_ids)
            for timeline in timelines:
                timeline.layer_sent()

        return hook

    def _send_resharded(self, ticket: Ticket, layer: int, block_ids: Sequence[int]) -> None:
        """Engine thread: model layer `layer` of `ticket`'s blocks into a decode replica of
        another TP size, re-sharded to its items (`kvtransfer.reshard`)."""
        try:
            if self.sender.poll(ticket.request_id).is_terminal:
                return  # ended (aborted, failed): nothing to build
        except KVTransferError:  # long forgotten
            return
        resharding = Resharding(self.sender.layout, ticket.layout)
        ids = np.asarray(block_ids, dtype=np.int64)
        rows = np.arange(len(ids), dtype=np.int64)
        for item, k, v in resharding.items(self.engine.kv_cache, layer, ids):
            self.sender.send_layer(ticket, item, k, v, rows)

    def _on_release(self, request_id: str) -> None:
        """Sender thread: the transfer ended; free the source blocks on the engine thread."""

        def free() -> None:
            scheduler = self.engine.scheduler
            if request_id in scheduler.held:
                scheduler.release_held(request_id)
            elif request_id in scheduler.requests:  # aborted before its prompt completed
                self.replica.loop.abort_now(request_id)

        self.replica.loop.call(free)

    # ---- operations ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Never waits on the engine thread: fine on the event loop or in Serve's threads."""
        return {"pool": self.pool, **self.replica.stats()}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this; our replica router reads it, and the ingress predicts TTFT
        from it (`queued_tokens`, `pending_tokens_by_priority`, `prefill_tokens_per_s`).
        Never blocks the event loop."""
        signals = await self.record_autoscaling_stats()
        stats = await self.replica.routing_stats()
        routing = {
            **stats,
            "prefill_tokens_per_s": signals["prefill_tokens_per_s"],
            "pending_tokens_by_priority": {str(p): n for p, n in self._pending_tokens.items()},
        }
        if self.streams is not None:  # load shedding weighs the wait for a stream slot
            routing["admission"] = self.streams.admission.snapshot()
        return routing

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve polls this for the pool's autoscaling policy (`replica/signals.py`
        names the signals). Never blocks the event loop."""
        window_start = time.perf_counter() - SIGNAL_WINDOW_S
        rate = prompt_tokens_per_s(self.engine.prompt_steps.copy(), window_start)
        self._tokens_per_s = rate or self._tokens_per_s
        return prefill_signals(self.replica.loop.occupancy, self._tokens_per_s, self._ttft_ms)

    def check_health(self) -> None:
        """Serve's health check: fails when the engine loop is dead or stuck, or the KV
        sender is closed or lost its threads (cheap: reads a few fields)."""
        self.replica.check_health()
        problem = self.sender.serving_problem()
        if problem is not None:
            raise RuntimeError(f"prefill KV sender cannot serve: {problem}")

    def shutdown(self) -> None:
        """Close the KV sender, then the replica: its engine loop and the engine's
        tensor-parallel worker processes (`EngineReplica.shutdown`)."""
        self.sender.close()
        self.replica.shutdown()

    def __del__(self) -> None:
        # Ray Serve calls __del__ when it stops a replica; free shm and threads then.
        with contextlib.suppress(Exception):
            self.shutdown()
