"""What every entry point (HTTP and Python handle) does before and around decode.

Authenticate the key → tenant, validate and tokenize, route (pool choice recorded), enforce
the tenant's concurrency quota, then fan `n` choices out as streaming calls to a decode
pool and merge their deltas. No FastAPI here: `app/ingress.py` adds HTTP on top.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncGenerator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from app.config import PDServeConfig
from app.errors import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    ModelNotFoundError,
    RateLimitError,
)
from app.protocol import choice_sampling_params
from app.router import RouteDecision, RouterPolicy
from decode.protocol import GenerationSpec
from engine.builtin import resolve_model_dir
from engine.loader import load_model_config, load_tokenizer
from engine.outputs import RequestOutput
from engine.request import SamplingParams, context_overflow


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request that passed every check, ready to run."""

    request_id: str
    tenant: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    n: int
    route: RouteDecision


class Frontend:
    """Checks, routes and runs requests against the decode pools' handles."""

    def __init__(self, config: PDServeConfig, decode_handles: Mapping[str, Any]) -> None:
        self.config = config
        self.policy = RouterPolicy(config)
        model_dir = str(resolve_model_dir(config.model.model))
        self.tokenizer = load_tokenizer(model_dir)
        self.model_config = load_model_config(model_dir, config.model.dtype)
        self.model_name = config.model.served_model_name or config.model.model
        self.decode_handles = {name: h.options(stream=True) for name, h in decode_handles.items()}
        self.in_flight: Counter[str] = Counter()
        self.route_counts: Counter[str] = Counter()
        self.recent_routes: deque[dict[str, Any]] = deque(maxlen=1000)

    # ---- checks ----------------------------------------------------------------------

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """Output budget when the client names none: the service limit, within the context."""
        room = self.model_config.max_model_len - num_prompt_tokens
        return max(1, min(self.config.limits.max_output_tokens, room))

    def check_admin(self, api_key: str | None) -> None:
        """Operator endpoints: open without tenants, else an admin key is required."""
        if self.policy.requires_api_key and api_key not in self.config.admin_api_keys:
            raise AuthenticationError("this endpoint needs an admin API key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model.model):
            raise ModelNotFoundError(model)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise BadRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids: Any = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def prepare(
        self,
        api_key: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int = 1,
    ) -> PreparedRequest:
        """Authenticate, check limits and route. Raises an `APIError` (→ 4xx) on bad input."""
        tenant = self.policy.tenant_for_key(api_key)
        route = self.policy.route(len(prompt_token_ids), tenant)
        limits = self.config.limits
        if params.max_tokens > limits.max_output_tokens:
            raise BadRequestError(
                f"max_tokens ({params.max_tokens}) exceeds this service's limit of "
                f"{limits.max_output_tokens}",
                param="max_tokens",
            )
        overflow = context_overflow(
            len(prompt_token_ids), params.max_tokens, self.model_config.max_model_len
        )
        if overflow is not None:
            raise ContextLengthExceededError(overflow, param="max_tokens")
        return PreparedRequest(
            request_id=uuid.uuid4().hex,
            tenant=tenant,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            n=n,
            route=route,
        )

    # ---- running ---------------------------------------------------------------------

    async def run(self, prepared: PreparedRequest) -> AsyncGenerator[tuple[int, RequestOutput]]:
        """Stream `(choice index, delta)` of every choice until all have finished."""
        tenant_config = self.policy.tenant_config(prepared.tenant)
        quota = tenant_config.max_concurrent_requests if tenant_config else None
        if quota is not None and self.in_flight[prepared.tenant] >= quota:
            raise RateLimitError(
                f"tenant {prepared.tenant!r} has {quota} requests in flight, its quota",
                retry_after_s=1,
            )
        self.in_flight[prepared.tenant] += 1
        self._record(prepared)
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(prepared, i, queue)) for i in range(prepared.n)]
        try:
            remaining = prepared.n
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # a client that went away cancels every choice on both pools
            self.in_flight[prepared.tenant] -= 1

    async def _pump(self, prepared: PreparedRequest, index: int, queue: asyncio.Queue) -> None:
        route = prepared.route
        spec = GenerationSpec(
            request_id=f"{prepared.request_id}-{index}",
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=choice_sampling_params(prepared.params, index),
            tenant=prepared.tenant,
            priority=route.priority,
            prefill_pool=None if route.local_prefill else route.prefill_pool,
        )
        stream = self.decode_handles[route.decode_pool].generate.remote(spec)
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
            queue.put_nowait(None)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller
            queue.put_nowait(exc)

    def _record(self, prepared: PreparedRequest) -> None:
        route = prepared.route
        pool = "local" if route.local_prefill else route.prefill_pool
        self.route_counts[f"{prepared.tenant}|{pool}|{route.decode_pool}"] += 1
        self.recent_routes.append(
            {
                "request_id": prepared.request_id,
                "tenant": prepared.tenant,
                "num_prompt_tokens": len(prepared.prompt_token_ids),
                "time": time.time(),
                **asdict(route),
            }
        )

    def routing_report(self) -> dict[str, Any]:
        return {"counts": dict(self.route_counts), "recent": list(self.recent_routes)}
