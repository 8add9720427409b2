"""What every entry point (HTTP and Python handle) does before and around decode.

Authenticate the key → tenant, validate and tokenize (off the event loop), route (pool choice
recorded), enforce the tenant's concurrency quota, then fan `n` choices out as streaming calls
to a decode pool and merge their deltas. A decode replica that dies under a request fails it
with `ReplicaLostError` (503); a request the engine failed (and isolated) gets a 500 with code
"request_failed". No FastAPI here: `app/ingress.py` adds HTTP on top.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from ray.exceptions import RayActorError

from app.config import PDServeConfig
from app.errors import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    InternalServerError,
    ModelNotFoundError,
    RateLimitError,
    ReplicaLostError,
)
from app.prompts import PromptTokenizer
from app.protocol import choice_sampling_params
from app.router import RouteDecision, RouterPolicy
from decode.protocol import GenerationSpec
from engine.builtin import resolve_model_dir
from engine.loader import load_model_config, load_tokenizer
from engine.outputs import RequestFailedError, RequestOutput
from engine.request import SamplingParams, context_overflow

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


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
        self.prompts = PromptTokenizer(self.tokenizer, self.model_config.vocab_size)
        # One thread: tokenizing a large prompt takes about a second per megabyte of CPU, and
        # the tokenizer is not used from two threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenize")
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

    def authenticate(self, api_key: str | None) -> str:
        """The key's tenant; raises `AuthenticationError` (401). Call before any other work."""
        return self.policy.tenant_for_key(api_key)

    def check_admin(self, api_key: str | None) -> None:
        """Operator endpoints: open without tenants, else an admin key is required."""
        if self.policy.requires_api_key and not self.policy.is_admin_key(api_key):
            raise AuthenticationError("this endpoint needs an admin API key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model.model):
            raise ModelNotFoundError(model)

    async def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt's ids (text or checked ids), computed off the event loop."""
        return await self._off_loop(self.prompts.tokenize_prompt, prompt)

    async def tokenize_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The chat prompt's ids (content kept literal), computed off the event loop."""
        return await self._off_loop(self.prompts.tokenize_chat, messages)

    async def _off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def check_params(self, params: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: stop token ids within the vocabulary
        (`InvalidRequestError`) and max_tokens within the service limit (`BadRequestError`)."""
        params.check_vocab(self.model_config.vocab_size)
        limit = self.config.limits.max_output_tokens
        if params.max_tokens > limit:
            raise BadRequestError(
                f"max_tokens ({params.max_tokens}) exceeds this service's limit of {limit}",
                param="max_tokens",
            )

    def prepare(
        self,
        api_key: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        prompt_param: str = "prompt",
    ) -> PreparedRequest:
        """Authenticate, check limits and route. Raises an `APIError` (→ 4xx) on bad input;
        `prompt_param` names the prompt's field in errors about its length."""
        tenant = self.policy.tenant_for_key(api_key)
        try:
            route = self.policy.route(len(prompt_token_ids), tenant)
        except BadRequestError as exc:  # empty or too long
            exc.param = exc.param or prompt_param
            raise
        self.check_params(params)
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
        except RayActorError as exc:  # ActorDiedError, ActorUnavailableError: replica gone
            logger.warning("decode replica lost under %s: %r", spec.request_id, exc)
            queue.put_nowait(ReplicaLostError())
        except RequestFailedError as exc:  # isolated to this request; the replica serves on
            logger.warning("request %s failed in the engine: %s", spec.request_id, exc)
            queue.put_nowait(
                InternalServerError("generation failed for this request", code="request_failed")
            )
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
