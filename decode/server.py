"""The decode replica, and the orchestrator of each request (decode-as-orchestrator).

A request's life here (one streaming `generate` call from the ingress):

    local prefill (short prompt, colocated, or no KV room now):
        queued in the engine ──prefill + decode──▶ deltas streamed
    remote prefill:
        reserve blocks (WAITING_FOR_KV) ──open ticket──▶ prefill pool `prefill(req, ticket)`
        ──KV lands layer by layer──▶ DONE ──first token──▶ RUNNING ──deltas streamed
        on failure: retry once (a fresh reservation and ticket), then prefill locally

Every attempt has its own transfer id (`<request id>#<attempt>`), so a late `release` of a
dead attempt can never free the blocks of the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from functools import partial
from typing import Any, Protocol

from decode.protocol import GenerationSpec
from engine.builtin import resolve_model_dir
from engine.config import EngineConfig
from engine.kv_cache import KVCache, KVCacheSpec
from engine.loader import load_model_config
from engine.outputs import RequestOutput
from engine.replica import EngineReplica, model_id_for
from engine.request import Request
from kvtransfer import KVReceiver, KVTransferError, TransferOptions, TransferState
from kvtransfer import create_receiver as create_kv_receiver
from prefill.protocol import PrefillRequest, PrefillResult

logger = logging.getLogger(__name__)

MAX_REMOTE_ATTEMPTS = 2  # the first try, then one retry (Serve may pick another replica)


class PrefillHandle(Protocol):
    """What the decode server needs of a prefill pool (a Serve `DeploymentHandle`)."""

    @property
    def prefill(self) -> Any: ...


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
    ) -> None:
        self.pool = pool
        self.deadline_s = deadline_s
        self.prefill_pools = dict(prefill_pools or {})
        self.receiver: KVReceiver | None = None
        kv_cache = None
        if self.prefill_pools:
            model_dir = str(resolve_model_dir(engine_config.model_dir))
            model_config = load_model_config(model_dir, engine_config.dtype)
            spec = KVCacheSpec.for_engine(engine_config, model_config)
            if backend != "shm":
                kv_cache = KVCache.allocate(spec, engine_config.device)
            self.receiver = create_kv_receiver(
                backend,
                spec,
                kv_cache,
                model_id=model_id_for(model_config, model_dir),
                release=self._on_release,
                options=transfer_options,
                **dict(receiver_endpoint or {}),
            )
            kv_cache = self.receiver.kv_cache
        self.replica = EngineReplica(f"decode:{pool}", engine_config, kv_cache=kv_cache)
        self.engine = self.replica.engine
        self.loop = self.replica.loop
        self._active_transfer: dict[str, str] = {}  # request id -> current transfer id

    # ---- the request -----------------------------------------------------------------

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[RequestOutput]:
        """Stream `spec`'s deltas; prefill remotely when the spec names a prefill pool."""
        request = self._make_request(spec)
        if spec.prefill_pool is None or self.receiver is None:
            self.replica.counters["local_prefill"] += 1
            async for delta in self.loop.generate(request):
                yield delta
            return
        stream = self.loop.open_stream(spec.request_id)
        started = await self._prefill_remotely(spec, request)
        if not started:
            self.replica.counters["local_prefill_fallback"] += 1
            await self.loop.call_async(lambda: self.engine.add_request(self._make_request(spec)))
        async for delta in self.loop.stream(spec.request_id, stream):
            yield delta

    def _make_request(self, spec: GenerationSpec) -> Request:
        return self.engine.make_request(
            list(spec.prompt_token_ids),
            spec.sampling_params,
            request_id=spec.request_id,
            tenant=spec.tenant,
            priority=spec.priority,
        )

    async def _prefill_remotely(self, spec: GenerationSpec, request: Request) -> bool:
        """Try remote prefill (with one retry). True when decoding has started."""
        assert self.receiver is not None and spec.prefill_pool is not None
        rid = spec.request_id
        for attempt in range(MAX_REMOTE_ATTEMPTS):
            if attempt:
                request = self._make_request(spec)
                self.replica.counters["prefill_retries"] += 1
            transfer_id = f"{rid}#{attempt}"
            self._active_transfer[rid] = transfer_id  # before reserving: see _on_release
            block_ids = await self.loop.call_async(partial(self.engine.reserve_for_kv, request))
            if block_ids is None:
                self._active_transfer.pop(rid, None)
                self.replica.counters["no_kv_room"] += 1
                return False  # prefill locally: the engine queues it until blocks free up
            ticket = self.receiver.open_ticket(transfer_id, block_ids, self.deadline_s)
            prefill_request = PrefillRequest(
                request_id=transfer_id,
                prompt_token_ids=spec.prompt_token_ids,
                sampling_params=spec.sampling_params,
                tenant=spec.tenant,
                priority=spec.priority,
            )
            response = self.prefill_pools[spec.prefill_pool].prefill.remote(prefill_request, ticket)
            try:
                # Bounded by the ticket's deadline: a prefill pool with no live replica
                # must not hang the request (Serve would queue the call indefinitely).
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
            except (asyncio.CancelledError, GeneratorExit):
                self._give_up(rid, transfer_id)
                _cancel(response)
                raise
            except Exception as exc:  # noqa: BLE001 - any prefill failure: retry or fall back
                logger.warning("remote prefill attempt %s failed: %r", transfer_id, exc)
                self.replica.counters["prefill_failures"] += 1
                self._give_up(rid, transfer_id)
                _cancel(response)
                await self.loop.call_async(lambda: self.engine.kv_failed(rid))
                continue
            self._active_transfer.pop(rid, None)
            self.replica.counters["remote_prefill"] += 1
            self.replica.counters[f"prefill_pool:{spec.prefill_pool}"] += 1
            self.replica.counters["remote_cached_tokens"] += result.num_cached_tokens

            def start(result: PrefillResult = result) -> None:
                delta = self.engine.kv_received(
                    rid, result.first_token_id, result.logprobs, result.num_cached_tokens
                )
                self.loop.publish(delta)

            await self.loop.call_async(start)
            return True
        return False

    def _give_up(self, request_id: str, transfer_id: str) -> None:
        """Stop a transfer attempt; its blocks come back through `release` → kv_failed."""
        assert self.receiver is not None
        if self._active_transfer.get(request_id) == transfer_id:
            self._active_transfer.pop(request_id, None)
            self.receiver.abort(transfer_id)
            self.loop.call(lambda: self.engine.kv_failed(request_id))

    def _on_release(self, transfer_id: str) -> None:
        """Receiver thread: a transfer ended without KV; free its blocks if still reserved."""
        request_id = transfer_id.rsplit("#", 1)[0]

        def free() -> None:
            # Only the live attempt owns the reservation; a stale release must not free it.
            if self._active_transfer.get(request_id) == transfer_id:
                self.engine.kv_failed(request_id)

        self.loop.call(free)

    # ---- operations ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"pool": self.pool, **self.replica.stats()}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this; our replica router reads it. Never blocks the event loop."""
        return await self.replica.routing_stats()

    def check_health(self) -> None:
        if not self.loop.is_alive:
            raise RuntimeError("decode engine loop is dead")

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.replica.shutdown()

    def __del__(self) -> None:
        # Ray Serve calls __del__ when it stops a replica; free shm and threads then.
        with contextlib.suppress(Exception):
            self.shutdown()


async def _resolve(response: Any) -> Any:
    return await response


def _cancel(response: Any) -> None:
    cancel = getattr(response, "cancel", None)
    if cancel is not None:
        cancel()
