"""The prefill replica: computes prompts and streams their KV to decode, layer by layer.

A request's life here:

    prefill(request, ticket) ──connect (handshake)──▶ queued in the engine (prefill_only)
      ──last chunk: after each layer, send_layer──▶ first token sampled (FINISHED_PREFILLED,
      blocks held) ──finish──▶ transfer DONE ──release──▶ blocks freed ──▶ PrefillResult

The source blocks are freed by the sender's `release` callback in every terminal state
(done, failed, aborted, expired), so a dead or slow decode peer never strands them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from engine.config import EngineConfig
from engine.replica import EngineReplica
from engine.scheduler import SchedulerOutput
from kvtransfer import KVSender, KVTransferError, Ticket, TransferOptions, TransferState
from kvtransfer import create_sender as create_kv_sender
from prefill.protocol import PrefillRequest, PrefillResult

logger = logging.getLogger(__name__)


class PrefillServer:
    """One prefill replica (Ray Serve wraps it as the `PrefillServer` deployment)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        backend: str,
        transfer_options: TransferOptions = TransferOptions(),
        pool: str = "prefill",
    ) -> None:
        self.pool = pool
        self.replica = EngineReplica(f"prefill:{pool}", engine_config)
        self.engine = self.replica.engine
        self.sender: KVSender = create_kv_sender(
            backend,
            self.engine.kv_spec,
            model_id=self.replica.model_id,
            release=self._on_release,
            options=transfer_options,
        )
        self._tickets: dict[str, Ticket] = {}
        self.replica.loop.layer_hook_for = self._layer_hook_for

    # ---- the request -----------------------------------------------------------------

    async def prefill(self, spec: PrefillRequest, ticket: Ticket) -> PrefillResult:
        """Called by a decode replica: prefill `spec`'s prompt into `ticket`'s blocks.

        Returns after the transfer is DONE. Raises `KVTransferError` when the hand-off
        fails (the decode side then retries elsewhere or prefills locally).
        """
        start = time.perf_counter()
        rid = spec.request_id
        request = self.engine.make_request(
            list(spec.prompt_token_ids),
            spec.sampling_params,
            request_id=rid,
            tenant=spec.tenant,
            priority=spec.priority,
            prefill_only=True,
        )
        if len(ticket.block_ids) != self.engine.kv_manager.num_blocks_for(
            len(request.prompt_token_ids)
        ):
            raise KVTransferError(
                f"ticket for {rid} has {len(ticket.block_ids)} blocks, prompt needs "
                f"{self.engine.kv_manager.num_blocks_for(len(request.prompt_token_ids))}"
            )
        self.replica.counters["requests"] += 1
        first = None
        try:
            # Inside the try: a caller cancelled mid-handshake still gets the transfer
            # aborted (the connect thread runs on; abort reaches the receiver either way).
            await asyncio.to_thread(self.sender.connect, ticket, ticket.seconds_left())
            self._tickets[rid] = ticket
            async for delta in self.replica.loop.generate(request):
                first = delta
            if first is None or first.finish_reason != "prefilled":
                raise KVTransferError(f"prefill of {rid} ended as {first and first.finish_reason}")
            self.sender.finish(ticket)
            state = await asyncio.to_thread(self.sender.wait, rid, max(ticket.seconds_left(), 0.1))
            if state != TransferState.DONE:
                error = self.sender.error(rid)
                raise error or KVTransferError(f"KV transfer of {rid} ended {state.value}")
        except BaseException:
            self.sender.abort(rid)  # idempotent; release frees the blocks
            self.replica.counters["failed"] += 1
            raise
        finally:
            self._tickets.pop(rid, None)
        self.replica.counters["prompt_tokens"] += len(spec.prompt_token_ids)
        return PrefillResult(
            request_id=rid,
            first_token_id=first.new_token_ids[0],
            logprobs=first.new_logprobs[0] if first.new_logprobs else None,
            num_cached_tokens=first.num_cached_tokens,
            replica=self.replica.name,
            prefill_ms=(time.perf_counter() - start) * 1000,
        )

    def _layer_hook_for(self, output: SchedulerOutput):  # noqa: ANN202 - LayerHook | None
        """Engine thread: send each layer of requests whose prompt completes this step.

        Earlier chunks of a long prompt are already in the cache; the last chunk's pass
        streams every block of the prompt, overlapping the transfer with its compute.
        """
        sends = []
        for item in output.scheduled:
            ticket = self._tickets.get(item.request.request_id)
            if ticket is not None and item.samples:
                sends.append((ticket, item.block_table[: ticket.num_blocks]))
        if not sends:
            return None
        kv = self.engine.kv_cache

        def hook(layer: int) -> None:
            for ticket, block_ids in sends:
                self.sender.send_layer(
                    ticket, layer, kv.key_caches[layer], kv.value_caches[layer], block_ids
                )

        return hook

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
        """Ray Serve polls this; our replica router reads it. Never blocks the event loop."""
        return await self.replica.routing_stats()

    def check_health(self) -> None:
        """Serve's health check: fails when the engine loop is dead or stuck (cheap)."""
        self.replica.check_health()

    def shutdown(self) -> None:
        self.sender.close()
        self.replica.shutdown()

    def __del__(self) -> None:
        # Ray Serve calls __del__ when it stops a replica; free shm and threads then.
        with contextlib.suppress(Exception):
            self.shutdown()
