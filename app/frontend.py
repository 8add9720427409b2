"""The front door: what every entry point (HTTP and Python handle) does before and around
decode, once per request.

The entry point authenticates the key → tenant (HTTP does it before reading the body) and
hands over an `Entry`; `admit` checks the model and the sampling params, tokenizes (off the
event loop), resolves the SLO class (its priority replaces the route's), places the request
(`app/routing/placement.py`: the prompt's checks run there, before any load is counted) and
sheds it when overloaded. `run` admits it against the tenant's global quotas
(`app/admission/controller.py`), then fans `n` choices out as streaming calls to a decode
pool (`app/choices.py`) and merges their deltas (output tokens charged as they stream).
A decode replica that dies under a request fails it with `ReplicaLostError` (503); a
request the engine failed (and isolated) gets a 500 with code "request_failed".
A degradable request may be moved to the fallback pool (`app/routing/fallback.py`) when
it would be shed, when its prefill pool's breaker is open on its decode pool, or when the
decode pool's queue is full before its first token. What `admit` hands to `run` is a
`PreparedRequest` (`app/prepared.py`); routing decisions are kept by `app/routing/log.py`.
No FastAPI here: `app/ingress.py` adds HTTP on top.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from opentelemetry import trace

from app.admission.classes import ClassResolver
from app.admission.controller import Admission, decode_pool_blocks, tenant_quotas
from app.admission.overload import OverloadGuard
from app.config import PDServeConfig
from app.errors import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    ModelNotFoundError,
    bad_request,
)
from app.observability.request_metrics import (
    RequestMetrics,
    SLOTargets,
)
from app.observability.telemetry import IngressTelemetry, route_span
from app.observability.tracing import carrier_for, child_span
from app.prepared import Entry, PreparedRequest
from app.prompts import PromptTokenizer
from app.routing.adaptive import AdaptivePrefill
from app.routing.fallback import (
    TRIGGER_BREAKER,
    TRIGGER_SHED,
    FallbackPolicy,
    breaker_open,
    fallback_model_config,
)
from app.routing.log import RoutingLog
from app.routing.overflow import DecodeOverflow
from app.routing.placement import Placement
from app.routing.pool_router import RouterPolicy
from app.runner import RequestRunner
from engine.builtin import resolve_model_dir
from engine.loader import load_model_config, load_tokenizer
from engine.outputs import RequestOutput
from engine.request import ContextOverflowError, InvalidRequestError, SamplingParams, check_prompt

logger = logging.getLogger(__name__)
_tracer = trace.get_tracer("pdserve.ingress")
_T = TypeVar("_T")


class Frontend:
    """Checks, routes and runs requests against the decode pools' handles (and those of
    prefill pools that serve whole requests, `app/routing/overflow.py`)."""

    def __init__(
        self,
        config: PDServeConfig,
        decode_handles: Mapping[str, Any],
        quota_service: Any | None = None,
        prefill_handles: Mapping[str, Any] | None = None,
    ) -> None:
        """`quota_service`: handle of the global quota state (None: no tenant has a quota);
        `prefill_handles`: the prefill pools, whose load decides shedding."""
        self.config = config
        self.overload = OverloadGuard(
            config.overload,
            prefill_handles or {},
            [c.priority for c in config.admission.classes],
        )
        self.policy = RouterPolicy(config)
        # Adaptive disaggregation weighs the prefill pools' load against the decode pools'.
        self.adaptive = AdaptivePrefill(
            config.adaptive_prefill,
            self.overload.monitor.snapshot,
            local_prefill_threshold=config.local_prefill_threshold,
        )
        # Prefill pools with `serves_decode` take whole requests while decode is busier.
        self.overflow = DecodeOverflow(config, self.overload.monitor.snapshot)
        self.placement = Placement(self.policy, self.adaptive, self.overflow)
        if config.adaptive_prefill.enabled and prefill_handles:
            self.overload.monitor.watch({**decode_handles, **prefill_handles})
        self.classes = ClassResolver(config.admission, config.tenants)
        model_dir = str(resolve_model_dir(config.model.model))
        self.tokenizer = load_tokenizer(model_dir)
        self.model_config = load_model_config(model_dir, config.model.dtype)
        fallback_config = fallback_model_config(config)
        self.fallback = FallbackPolicy.from_config(config, fallback_config)
        if self.fallback.model is not None or config.overload.shedding.enabled:
            # Their admission waits (shedding) and open breakers (fallback) are read there.
            self.overload.monitor.watch(decode_handles)
        self.admission = Admission(
            config.admission,
            tenant_quotas(config.tenants),
            quota_service,
            block_size=config.model.block_size,
            kv_pool_blocks=decode_pool_blocks(config, self.model_config, fallback_config),
        )
        self.prompts = PromptTokenizer(self.tokenizer)
        # One thread: tokenizing a large prompt takes about a second per megabyte of CPU, and
        # the tokenizer is not used from two threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenize")
        self.model_name = config.model.served_model_name or config.model.model
        serving = {name: (prefill_handles or {})[name] for name in self.overflow.pools}
        self.decode_handles = {
            name: h.options(stream=True) for name, h in {**decode_handles, **serving}.items()
        }
        self.in_flight: Counter[str] = Counter()
        # Requests that reached placement, by priority (shed ones too): batch jobs back off
        # when more important ones arrive (`app/batch/pacing.py`).
        self.arrivals_by_priority: Counter[int] = Counter()
        self.routing = RoutingLog()
        goodput = config.observability.metrics
        self.metrics = RequestMetrics(SLOTargets(goodput.goodput_ttft_s, goodput.goodput_tpot_s))
        self.telemetry = IngressTelemetry(config, self.tokenizer.decode)
        self.runner = RequestRunner(
            admission=self.admission,
            overload=self.overload,
            overflow=self.overflow,
            fallback=self.fallback,
            routing=self.routing,
            metrics=self.metrics,
            telemetry=self.telemetry,
            decode_handles=self.decode_handles,
            in_flight=self.in_flight,
        )

    # ---- checks ----------------------------------------------------------------------

    def authenticate(self, api_key: str | None) -> str:
        """The key's tenant; raises `AuthenticationError` (401). Call before any other work."""
        with child_span(_tracer, "auth") as span:
            tenant = self.policy.tenant_for_key(api_key)
            span.set_attribute("pdserve.tenant", tenant)
            return tenant

    def check_admin(self, api_key: str | None) -> None:
        """Operator endpoints: open without tenants, else an admin key is required."""
        if self.policy.requires_api_key and not self.policy.is_admin_key(api_key):
            raise AuthenticationError("this endpoint needs an admin API key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model.model):
            raise ModelNotFoundError(model)

    async def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt's ids (text or checked ids), computed off the event loop."""
        with child_span(_tracer, "tokenize") as span:
            ids = await self._off_loop(self.prompts.tokenize_prompt, prompt)
            span.set_attribute("pdserve.num_prompt_tokens", len(ids))
            return ids

    async def tokenize_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The chat prompt's ids (content kept literal), computed off the event loop."""
        with child_span(_tracer, "tokenize") as span:
            ids = await self._off_loop(self.prompts.tokenize_chat, messages)
            span.set_attribute("pdserve.num_prompt_tokens", len(ids))
            return ids

    async def _off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    async def admit(self, tenant: str, entry: Entry) -> PreparedRequest:
        """The front door: `entry` of `tenant` (from `authenticate`) checked, tokenized and
        placed, ready to `run`. Raises an `APIError` (→ 4xx) on bad input, or the engine's
        `InvalidRequestError` for out-of-range sampling values (a 400 over HTTP). The cheap
        checks come first: the model (404) and the sampling params (400) before tokenizing."""
        self.check_model(entry.model)
        params = entry.sampling_params()
        self.check_params(params)
        if entry.messages is not None:
            prompt_ids = await self.tokenize_chat(entry.messages)
        else:
            prompt_ids = await self.tokenize_prompt(entry.prompt or [])
        return self.prepare(
            tenant,
            prompt_ids,
            params,
            entry.n,
            entry.prompt_param,
            slo_class=entry.slo_class,
            timeout_s=entry.timeout_s,
            timeout_param=entry.timeout_param,
            local_prefill_max_tokens=entry.local_prefill_max_tokens,
        )

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
        tenant: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        prompt_param: str = "prompt",
        slo_class: str | None = None,
        timeout_s: float | None = None,
        timeout_param: str = "timeout",
        local_prefill_max_tokens: int = 0,
    ) -> PreparedRequest:
        """`admit`'s steps after tokenizing (`params` already checked): resolve the SLO class
        (`slo_class`: the one asked for, if any), check the prompt and place it, set its
        deadline and shed it when overloaded. Raises an `APIError` (→ 4xx) on bad input;
        `prompt_param` names the prompt's field in errors about it;
        `local_prefill_max_tokens`: see `Placement.place`."""
        started_ns = time.time_ns()
        service_class = self.classes.resolve(tenant, slo_class)
        self.arrivals_by_priority[service_class.priority] += 1
        route = self.placement.place(
            len(prompt_token_ids),
            tenant,
            service_class.priority,
            n,
            params.max_tokens,
            checks=lambda: self._check_prompt(prompt_token_ids, params, prompt_param),
            prompt_param=prompt_param,
            prompt_token_ids=prompt_token_ids,
            local_prefill_max_tokens=local_prefill_max_tokens,
        )
        # Deadline and load shedding (`app/admission/overload.py`): `timeout_s` is what the
        # request asked for (`timeout_param` names where), shedding never waits.
        deadline = self.overload.deadline(timeout_s, service_class.name, timeout_param)
        # Shed on the pool computing the prompt, for what it computes: a chat turn whose
        # history the decode replica caches computes its suffix there, on no prefill pool.
        prompt_pool, prompt_tokens = route.computes or (
            None if route.local_prefill else route.prefill_pool,
            len(prompt_token_ids),
        )
        shed = self.overload.check_shed(
            None if prompt_pool == route.decode_pool else prompt_pool,
            prompt_tokens,
            service_class.ttft_s,
            service_class.priority,
            route.decode_pool,
        )
        prepared = PreparedRequest(
            request_id=uuid.uuid4().hex,
            tenant=tenant,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling_params=params,
            priority=service_class.priority,
            n=n,
            route=dataclasses.replace(
                route,
                priority=service_class.priority,
                reason=f"{route.reason}; {shed.reason}" if shed.reason else route.reason,
            ),
            service_class=service_class,
            deadline=deadline,
            trace_context=carrier_for(trace.get_current_span()),
        )
        if shed.shed:
            prepared = self.fallback.move(prepared, TRIGGER_SHED) or prepared
        else:
            prepared = self._around_open_breaker(prepared)
        route_span(started_ns, tenant, service_class.name, prepared.route, len(prompt_token_ids))
        if shed.shed and prepared.served.fallback is None:
            self.routing.record(prepared, shed="overloaded")
            labels = RequestMetrics.labels(
                tenant, service_class.name, route.prefill_pool, route.decode_pool
            )
            self.metrics.shed(labels, "overloaded", 503)
            raise self.overload.shed_error(shed, route.reason)
        return prepared

    def _check_prompt(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt_param: str
    ) -> None:
        """Prompt plus output within the model: ids in the vocabulary, length within its
        context."""
        model = self.model_config
        try:
            check_prompt(prompt_token_ids, params, model.vocab_size, model.max_model_len)
        except ContextOverflowError as exc:
            raise ContextLengthExceededError(str(exc), param="max_tokens") from None
        except InvalidRequestError as exc:
            error = bad_request(exc)
            error.param = error.param or (prompt_param if str(exc).startswith("prompt") else None)
            raise error from None

    def _around_open_breaker(self, prepared: PreparedRequest) -> PreparedRequest:
        """`prepared` moved to the fallback pool when its prefill pool's breaker is open on
        its decode pool and `FallbackPolicy` allows (TRIGGER_BREAKER); else unchanged."""
        route = prepared.route
        if route.local_prefill or route.prefill_pool is None or self.fallback.model is None:
            return prepared
        why = breaker_open(
            self.overload.monitor.snapshot(route.decode_pool),
            route.decode_pool,
            route.prefill_pool,
            self.config.overload.shedding.max_age_s,
            time.monotonic(),
        )
        if why is None:
            return prepared
        noted = dataclasses.replace(route, reason=f"{route.reason}; {why}")
        moved = self.fallback.move(dataclasses.replace(prepared, route=noted), TRIGGER_BREAKER)
        return moved or prepared

    def served_model(self, prepared: PreparedRequest) -> str:
        """The model name the request's response carries (the fallback's, if it served)."""
        return prepared.served.model_name(self.model_name)

    # ---- running ---------------------------------------------------------------------

    def run(self, prepared: PreparedRequest) -> AsyncGenerator[tuple[int, RequestOutput]]:
        """Stream `(choice index, delta)` of every choice until all have finished
        (`RequestRunner.run`)."""
        return self.runner.run(prepared)

    def run_batches(
        self, prepared: PreparedRequest
    ) -> AsyncGenerator[list[tuple[int, RequestOutput]]]:
        """`run`, a list at a time (`RequestRunner.run_batches`)."""
        return self.runner.run_batches(prepared)

    def routing_report(self) -> dict[str, Any]:
        """The routing decisions of this ingress replica (`RoutingLog.report`)."""
        return self.routing.report()
