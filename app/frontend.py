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
import contextlib
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
from app.choices import cancel_choices, pump_choice, ready_items
from app.config import PDServeConfig
from app.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    ModelNotFoundError,
    bad_request,
)
from app.observability.request_metrics import (
    STATUS_CLIENT_GONE,
    STATUS_OK,
    RequestMetrics,
    RequestRecorder,
    SLOTargets,
)
from app.observability.telemetry import IngressTelemetry, route_span
from app.observability.tracing import carrier_for, child_span
from app.prepared import Entry, PreparedRequest
from app.prompts import PromptTokenizer
from app.routing.adaptive import AdaptivePrefill
from app.routing.fallback import (
    TRIGGER_BACKPRESSURE,
    TRIGGER_BREAKER,
    TRIGGER_SHED,
    FallbackPolicy,
    breaker_open,
    fallback_model_config,
    is_backpressure,
)
from app.routing.log import RoutingLog
from app.routing.overflow import DecodeOverflow
from app.routing.placement import Placement
from app.routing.pool_router import RouterPolicy
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
        self.adaptive = AdaptivePrefill(config.adaptive_prefill, self.overload.monitor.snapshot)
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
        self.routing = RoutingLog()
        goodput = config.observability.metrics
        self.metrics = RequestMetrics(SLOTargets(goodput.goodput_ttft_s, goodput.goodput_tpot_s))
        self.telemetry = IngressTelemetry(config, self.tokenizer.decode)

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
    ) -> PreparedRequest:
        """`admit`'s steps after tokenizing (`params` already checked): resolve the SLO class
        (`slo_class`: the one asked for, if any), check the prompt and place it, set its
        deadline and shed it when overloaded. Raises an `APIError` (→ 4xx) on bad input;
        `prompt_param` names the prompt's field in errors about it."""
        started_ns = time.time_ns()
        service_class = self.classes.resolve(tenant, slo_class)
        route = self.placement.place(
            len(prompt_token_ids),
            tenant,
            service_class.priority,
            n,
            params.max_tokens,
            checks=lambda: self._check_prompt(prompt_token_ids, params, prompt_param),
            prompt_param=prompt_param,
        )
        # Deadline and load shedding (`app/admission/overload.py`): `timeout_s` is what the
        # request asked for (`timeout_param` names where), shedding never waits.
        deadline = self.overload.deadline(timeout_s, service_class.name, timeout_param)
        shed = self.overload.check_shed(
            None if route.local_prefill else route.prefill_pool,
            len(prompt_token_ids),
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
        self.in_flight[prepared.tenant] += 1
        self.routing.record(prepared)
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        # `computing`: where the prompt computes and its length, until its first output
        # (decode overflow's figure; None once reported computed).
        computing: tuple[str, int] | None
        tasks, timer, computing = self._start(prepared, queue)
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
            recorder.finish(status)
            telemetry.finish(status)
            cancel_choices(
                tasks, timer
            )  # a client that went away cancels every choice on both pools
            self.overflow.ended(prepared.route.decode_pool, prepared.n)
            self._prompt_computed(computing)
            self.in_flight[prepared.tenant] -= 1
            admitted.release()

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
        computing = (pool or route.decode_pool, len(prepared.prompt_token_ids))
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

    def routing_report(self) -> dict[str, Any]:
        """The routing decisions of this ingress replica (`RoutingLog.report`)."""
        return self.routing.report()
