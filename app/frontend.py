"""What every entry point (HTTP and Python handle) does before and around decode.

Authenticate the key → tenant, validate and tokenize (off the event loop), route (pool choice
recorded) and resolve the SLO class (its priority replaces the route's), admit against the
tenant's global quotas (`app/admission/controller.py`), then fan `n` choices out as streaming
calls to a decode pool and merge their deltas (output tokens charged as they stream). A
decode replica that dies under a request fails it with `ReplicaLostError` (503); a request
the engine failed (and isolated) gets a 500 with code "request_failed". No FastAPI here:
`app/ingress.py` adds HTTP on top.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from opentelemetry import trace
from ray.exceptions import RayActorError

from app.admission.adaptive import AdaptivePrefill
from app.admission.classes import ClassResolver, ServiceClass
from app.admission.controller import Admission, decode_pool_blocks, tenant_quotas
from app.admission.deadlines import Deadline
from app.admission.fallback import (
    TRIGGER_BACKPRESSURE,
    TRIGGER_SHED,
    FallbackPolicy,
    Served,
    fallback_model_config,
    is_backpressure,
)
from app.admission.overload import OverloadGuard
from app.config import PDServeConfig
from app.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    InternalServerError,
    ModelNotFoundError,
    ReplicaLostError,
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
from app.prompts import PromptTokenizer
from app.protocol import choice_sampling_params
from app.router import RouteDecision, RouterPolicy
from decode.protocol import GenerationSpec
from decode.serve_calls import new_call_id
from engine.builtin import resolve_model_dir
from engine.loader import load_model_config, load_tokenizer
from engine.outputs import RequestFailedError, RequestOutput
from engine.request import SamplingParams, context_overflow

logger = logging.getLogger(__name__)
_tracer = trace.get_tracer("pdserve.ingress")
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request that passed every check, ready to run."""

    request_id: str
    tenant: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    n: int
    route: RouteDecision  # its priority is the service class's
    service_class: ServiceClass = ServiceClass("default", 0)
    deadline: Deadline | None = None  # None: no deadline (callers that never set one)
    trace_context: dict[str, str] = dataclasses.field(default_factory=dict)  # W3C carrier
    # Set when the fallback pool serves it (`app/admission/fallback.py`); shared by copies.
    served: Served = dataclasses.field(default_factory=Served)


class Frontend:
    """Checks, routes and runs requests against the decode pools' handles."""

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
        if config.adaptive_prefill.enabled and prefill_handles:
            self.overload.monitor.watch({**decode_handles, **prefill_handles})
        self.classes = ClassResolver(config.admission, config.tenants)
        model_dir = str(resolve_model_dir(config.model.model))
        self.tokenizer = load_tokenizer(model_dir)
        self.model_config = load_model_config(model_dir, config.model.dtype)
        fallback_config = fallback_model_config(config)
        self.fallback = FallbackPolicy.from_config(config, fallback_config)
        self.admission = Admission(
            config.admission,
            tenant_quotas(config.tenants),
            quota_service,
            block_size=config.model.block_size,
            kv_pool_blocks=decode_pool_blocks(config, self.model_config, fallback_config),
        )
        self.prompts = PromptTokenizer(self.tokenizer, self.model_config.vocab_size)
        # One thread: tokenizing a large prompt takes about a second per megabyte of CPU, and
        # the tokenizer is not used from two threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenize")
        self.model_name = config.model.served_model_name or config.model.model
        self.decode_handles = {name: h.options(stream=True) for name, h in decode_handles.items()}
        self.in_flight: Counter[str] = Counter()
        self.route_counts: Counter[str] = Counter()
        self.recent_routes: deque[dict[str, Any]] = deque(maxlen=1000)
        goodput = config.observability.metrics
        self.metrics = RequestMetrics(SLOTargets(goodput.goodput_ttft_s, goodput.goodput_tpot_s))
        self.telemetry = IngressTelemetry(config, self.tokenizer.decode)

    # ---- checks ----------------------------------------------------------------------

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """Output budget when the client names none: the service limit, within the context."""
        room = self.model_config.max_model_len - num_prompt_tokens
        return max(1, min(self.config.limits.max_output_tokens, room))

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
        slo_class: str | None = None,
        timeout_s: float | None = None,
        timeout_param: str = "timeout",
    ) -> PreparedRequest:
        """Authenticate, check limits, resolve the SLO class (`slo_class`: the one asked for,
        if any) and route. Raises an `APIError` (→ 4xx) on bad input; `prompt_param` names
        the prompt's field in errors about its length."""
        started_ns = time.time_ns()
        tenant = self.policy.tenant_for_key(api_key)
        service_class = self.classes.resolve(tenant, slo_class)
        try:
            route = self.policy.route(len(prompt_token_ids), tenant)
        except BadRequestError as exc:  # empty or too long
            exc.param = exc.param or prompt_param
            raise
        # Adaptive disaggregation (`app/admission/adaptive.py`): before shedding, so a prompt
        # the prefill pool would be late for is prefilled locally rather than refused.
        route = self.adaptive.apply(route, len(prompt_token_ids), service_class.priority)
        self.check_params(params)
        overflow = context_overflow(
            len(prompt_token_ids), params.max_tokens, self.model_config.max_model_len
        )
        if overflow is not None:
            raise ContextLengthExceededError(overflow, param="max_tokens")
        # Deadline and load shedding (`app/admission/overload.py`): `timeout_s` is what the
        # request asked for (`timeout_param` names where), shedding never waits.
        deadline = self.overload.deadline(timeout_s, service_class.name, timeout_param)
        shed = self.overload.check_shed(
            route.prefill_pool,
            len(prompt_token_ids),
            service_class.ttft_s,
            service_class.priority,
        )
        prepared = PreparedRequest(
            request_id=uuid.uuid4().hex,
            tenant=tenant,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
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
        route_span(started_ns, tenant, service_class.name, prepared.route, len(prompt_token_ids))
        if shed.shed and prepared.served.fallback is None:
            self._record(prepared, shed="overloaded")
            labels = RequestMetrics.labels(
                tenant, service_class.name, route.prefill_pool, route.decode_pool
            )
            self.metrics.shed(labels, "overloaded", 503)
            raise self.overload.shed_error(shed, route.reason)
        return prepared

    def served_model(self, prepared: PreparedRequest) -> str:
        """The model name the request's response carries (the fallback's, if it served)."""
        return prepared.served.model_name(self.model_name)

    # ---- running ---------------------------------------------------------------------

    async def run(self, prepared: PreparedRequest) -> AsyncGenerator[tuple[int, RequestOutput]]:
        """Stream `(choice index, delta)` of every choice until all have finished."""
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
                prepared.params.max_tokens,
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
        self._record(prepared)
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        tasks, timer = self._start(prepared, queue)
        started = False  # a delta was passed on: too late to move to the fallback pool
        try:
            remaining = prepared.n
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    fallback = None
                    if not started and is_backpressure(item):
                        fallback = self.fallback.move(prepared, TRIGGER_BACKPRESSURE)
                    if fallback is None:
                        raise item
                    # The decode pool's queue is full: every choice starts over on the
                    # fallback pool, on a fresh queue (the old one may get late items).
                    _cancel(tasks, timer)
                    prepared = fallback
                    recorder.labels.update(
                        prefill_pool="local", decode_pool=fallback.route.decode_pool
                    )
                    self._record(prepared)
                    queue = asyncio.Queue()
                    tasks, timer = self._start(prepared, queue)
                    remaining = prepared.n
                else:
                    started = True
                    admitted.on_output(len(item[1].new_token_ids))
                    recorder.on_delta(*item)
                    telemetry.on_delta(*item)
                    yield item
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
            _cancel(tasks, timer)  # a client that went away cancels every choice on both pools
            self.in_flight[prepared.tenant] -= 1
            admitted.release()

    def _start(
        self, prepared: PreparedRequest, queue: asyncio.Queue
    ) -> tuple[list[asyncio.Task[None]], asyncio.TimerHandle | None]:
        """Start every choice's stream into `queue`; at the deadline a 504 error joins it
        (the caller then cancels every choice)."""
        tasks = [asyncio.create_task(self._pump(prepared, i, queue)) for i in range(prepared.n)]
        return tasks, self.overload.deadline_timer(prepared.deadline, queue)

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

    async def _pump(self, prepared: PreparedRequest, index: int, queue: asyncio.Queue) -> None:
        route = prepared.route
        spec = GenerationSpec(
            request_id=f"{prepared.request_id}-{index}",
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=choice_sampling_params(prepared.params, index),
            tenant=prepared.tenant,
            priority=route.priority,
            prefill_pool=None if route.local_prefill else route.prefill_pool,
            timeout_s=prepared.deadline.remaining_s() if prepared.deadline else None,
            trace_context=prepared.trace_context,
        )
        new_call_id()  # this choice's call must not share a routing id with its siblings
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
            # Serve's BackPressureError (the decode pool's max_queued_requests): a clean 503,
            # caused by it (`run` may then move the request to the fallback pool).
            error = self.overload.backpressure(exc)
            if error is not None:
                error.__cause__ = exc
            queue.put_nowait(error or exc)

    def _record(self, prepared: PreparedRequest, shed: str | None = None) -> None:
        """Count and keep the routing decision (`shed`: why it was refused, if it was)."""
        route = prepared.route
        pool = "local" if route.local_prefill else route.prefill_pool
        key = f"{prepared.tenant}|{pool}|{route.decode_pool}"
        fallback = prepared.served.fallback
        if fallback is not None:
            key += f"|fallback:{fallback.trigger}"
        self.route_counts[f"{key}|shed:{shed}" if shed else key] += 1
        self.recent_routes.append(
            {
                "request_id": prepared.request_id,
                "tenant": prepared.tenant,
                "num_prompt_tokens": len(prepared.prompt_token_ids),
                "time": time.time(),
                **asdict(route),
                **({"shed": shed} if shed else {}),
                **({"fallback": fallback.trigger} if fallback is not None else {}),
            }
        )

    def routing_report(self) -> dict[str, Any]:
        return {"counts": dict(self.route_counts), "recent": list(self.recent_routes)}


def _cancel(tasks: list[asyncio.Task[None]], timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()
    for task in tasks:
        task.cancel()
