"""The HTTP ingress: an OpenAI-compatible API (FastAPI inside a Serve deployment).

Also the target of Python `DeploymentHandle` callers (`generate`), with the same checks.
Every error comes back as an OpenAI-style JSON body with a 4xx/5xx status. Each request does
the cheap checks first: authenticate (401) before the body is read, cap the body while it is
read (413), parse (400), validate (400), check the model (404) and the sampling values (400);
only then tokenize, off the event loop. `/health` and `/v1/pdserve/stats` are bounded by
timeouts and never wait on a pool for long. FastAPI's `/docs`, `/redoc` and `/openapi.json`
answer only when `http.enable_docs` is set.
"""

# No `from __future__ import annotations` here: Serve's ingress re-wraps these methods and
# FastAPI must see real `Request` classes, not strings, to inject the request object.

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from ray.serve.exceptions import RayServeException
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.admission.classes import requested_class
from app.admission.deadlines import requested_timeout
from app.batch import routes as batch_routes
from app.batch.fleet import batch_service
from app.batch.service import BatchService
from app.builders import ChatBuilder, CompletionBuilder, TokenStrings
from app.config import PDServeConfig
from app.errors import (
    APIError,
    BadRequestError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    bad_request,
    error_json_response,
    error_response,
    install_error_handlers,
    validation_message,
)
from app.frontend import Frontend, PreparedRequest
from app.handle import GenerateChunk, GenerateRequest
from app.observability.tracing import TracingMiddleware, configure_tracing
from app.prepared import Entry
from app.protocol import ChatCompletionRequest, CompletionRequest, parse_json_object
from app.responses import SSE_DONE, EventStreamResponse, ModelCard, ModelList, sse_event
from app.routing.fallback import FALLBACK_HEADER, MODEL_HEADER
from app.serve.apps import own_app_name
from app.serve.readiness import Readiness
from engine.request import InvalidRequestError

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0  # per pool, for /v1/pdserve/stats
# A response that is not streamed needs only the whole answer: after the first token (TTFT
# is measured on it) the decode pool hands over its tokens merged, at most this often, and
# detokenizes them only then (`Engine._emit`), instead of a message and a tokenizer call
# per token. Often enough that output-token quotas are charged as the request goes.
NON_STREAMED_DELTA_INTERVAL_S = 1.0

# The docs routes are ours (below), so that config can turn them on: this app object is
# frozen into the deployment when the module is imported, before any config is known.
api = FastAPI(
    title="pdserve",
    description="Disaggregated prefill/decode LLM serving",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)
install_error_handlers(api)
api.include_router(batch_routes.router)  # /v1/files, /v1/batches (app/batch/)
api.add_middleware(TracingMiddleware)  # a span per request; x-trace-id on every response


def _replica_name() -> str:
    """This ingress replica's id (response header `x-pdserve-ingress`); "" outside Serve."""
    try:
        return serve.get_replica_context().replica_tag
    except RayServeException:
        return ""


def _since(request: Request) -> float | None:
    """The stats query's `since` (Unix seconds): aggregate only requests finished after."""
    raw = request.query_params.get("since")
    if raw is None:
        return None
    try:
        since = float(raw)
    except ValueError:
        since = math.nan
    if not math.isfinite(since):
        raise BadRequestError("since must be a number of Unix seconds", param="since")
    return since


def _api_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return None


@serve.ingress(api)
class Ingress:
    """One ingress replica: HTTP routes plus the `generate` handle method."""

    def __init__(
        self,
        config: dict[str, Any],
        decode_pools: Mapping[str, Any],
        prefill_pools: Mapping[str, Any],
        quota_service: Any = None,
    ) -> None:
        self.config = PDServeConfig.model_validate(config)
        configure_tracing(self.config.observability.tracing, "ingress")
        self.frontend = Frontend(self.config, decode_pools, quota_service, prefill_pools)
        self.quota_service = quota_service
        self.replica_name = _replica_name()
        self.pools: dict[str, Any] = {**prefill_pools, **decode_pools}
        self.token_strings = TokenStrings(self.frontend.tokenizer)
        self.created = int(time.time())
        # The app Serve deployed us in, by the name Serve gave it: `serve run app.main:app`
        # calls it "default", a config file what its `name` says (not config.app_name).
        self.readiness = Readiness(
            own_app_name(), self.pools, observe=self.frontend.telemetry.cost.observe_replicas
        )
        self.batch: BatchService | None = None
        if self.config.batch.enabled:  # jobs of the store run here while this replica holds them
            self.batch = batch_service(self.config, self.frontend, self.pools)
            limit = self.config.limits.max_body_bytes
            batch_routes.bind(self.batch, self.frontend.authenticate, limit)

    # ---- helpers ---------------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
        """The body's JSON object, read up to the byte limit (413 past it, even chunked)."""
        limit = self.config.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"request body of {declared} bytes exceeds {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        return parse_json_object(b"".join(chunks))

    async def _respond(
        self,
        prepared: PreparedRequest,
        builder: CompletionBuilder | ChatBuilder,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        """Run the routed request. An error before the response starts is its status code
        with the route's headers (where a 503 `replica_lost` was placed, for one)."""
        try:
            if not stream:
                whole = dataclasses.replace(
                    prepared, delta_interval_s=NON_STREAMED_DELTA_INTERVAL_S
                )
                async for index, delta in self.frontend.run(whole):
                    builder.add(index, delta)
                headers = self._headers(prepared, builder)
                return JSONResponse(builder.build().model_dump(mode="json"), headers=headers)
            # Wait for the first delta before answering, so an early error (quota, a pool
            # that is down) is a real 4xx/5xx status rather than an in-band SSE error.
            batches = self.frontend.run_batches(prepared)
            try:
                first = await anext(batches)
            except StopAsyncIteration:
                first = []
        except APIError as exc:
            for name, value in self._headers(prepared, builder).items():
                exc.headers.setdefault(name, value)
            raise
        headers = self._headers(prepared, builder)  # the first delta settled the pool

        async def rest() -> AsyncIterator[list[tuple[int, Any]]]:
            if first:
                yield first
                async for batch in batches:
                    yield batch

        async def sse() -> AsyncGenerator[str]:
            # The deltas that were ready together go out as one write: each write is a
            # message through Serve's proxy, which costs more CPU than the event itself.
            end = SSE_DONE  # written with the usage chunk or the error event, if any
            try:
                async for batch in rest():
                    events = [builder.add_event(index, delta) for index, delta in batch]
                    text = "".join(e for e in events if e is not None)
                    if text:
                        yield text
                if include_usage:
                    end = sse_event(builder.usage_chunk()) + SSE_DONE
            except Exception as exc:  # noqa: BLE001 - reported in-band once streaming
                logger.warning("stream failed: %r", exc)
                end = sse_event(dict(error_response(exc)[1])) + SSE_DONE
            finally:
                await batches.aclose()
            yield end

        return EventStreamResponse(sse(), headers, source=batches)

    def _headers(
        self, prepared: PreparedRequest, builder: CompletionBuilder | ChatBuilder
    ) -> dict[str, str]:
        """The response's headers; a request the fallback pool served says so (and its
        body's `model` names the fallback's model: set on `builder` here)."""
        headers = {
            "x-pdserve-route": prepared.route.reason,
            "x-pdserve-slo-class": prepared.service_class.name,
            "x-pdserve-ingress": self.replica_name,
        }
        served = prepared.served
        if served.fallback is not None and served.route is not None:
            builder.model = self.frontend.served_model(prepared)
            headers[FALLBACK_HEADER] = served.route.decode_pool
            headers[MODEL_HEADER] = builder.model
            headers["x-pdserve-route"] = served.route.reason
        return headers

    # ---- OpenAI routes ---------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        tenant = self.frontend.authenticate(_api_key(request))
        raw = await self._body(request)
        body = CompletionRequest.model_validate(raw)
        entry = self._entry(request, raw, body, prompt=body.prompt, prompt_param="prompt")
        return await self._run(tenant, entry, body, CompletionBuilder)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        tenant = self.frontend.authenticate(_api_key(request))
        raw = await self._body(request)
        body = ChatCompletionRequest.model_validate(raw)
        entry = self._entry(
            request, raw, body, messages=body.chat_messages(), prompt_param="messages"
        )
        return await self._run(tenant, entry, body, ChatBuilder)

    @staticmethod
    def _entry(
        request: Request,
        raw: dict[str, Any],
        body: CompletionRequest | ChatCompletionRequest,
        **prompt: Any,
    ) -> Entry:
        """The front door's view of an OpenAI body: its SLO class and deadline come from
        the headers or the body (`requested_class`, `requested_timeout`)."""
        timeout_s, timeout_param = requested_timeout(request.headers, body.timeout)
        return Entry(
            model=body.model,
            sampling_params=body.to_sampling_params,
            n=body.n,
            slo_class=requested_class(request.headers, raw),
            timeout_s=timeout_s,
            timeout_param=timeout_param,
            **prompt,
        )

    async def _run(
        self,
        tenant: str,
        entry: Entry,
        body: CompletionRequest | ChatCompletionRequest,
        builder_class: type[CompletionBuilder] | type[ChatBuilder],
    ) -> Response:
        """What both OpenAI routes do once the body has its shape: the front door, then the
        answer as JSON or as server-sent events."""
        prepared = await self.frontend.admit(tenant, entry)
        builder = builder_class(
            self.frontend.model_name,
            n=body.n,
            num_logprobs=prepared.sampling_params.logprobs,
            tokens=self.token_strings,
        )
        return await self._respond(prepared, builder, body.stream, body.include_usage)

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self.frontend.authenticate(_api_key(request))
        card = ModelCard(id=self.frontend.model_name, created=self.created)
        return ModelList(data=[card]).model_dump(mode="json")

    @api.get("/health")
    async def health(self) -> Response:
        """`{"status": "ok"}` when every pool has a healthy replica, else 503 (nothing more:
        no host names or pids). Probes are shared and cached (`app/serve/readiness.py`); a
        change of state is logged once, and a 503 here is an answer, not an error to log.
        The first probe also starts the ingress's view of the pools' load (so routing and
        shedding have it from the first request)."""
        self.frontend.overload.monitor.start()
        if not await self.readiness.is_ready():
            return error_json_response(ServiceUnavailableError("not ready", code="not_ready"))
        return JSONResponse({"status": "ok"})

    @api.get("/v1/pdserve/stats")
    async def stats(self, request: Request) -> dict[str, Any]:
        """Extension: routing decisions and each pool's KV occupancy (one replica each; a
        pool that does not answer within `STATS_TIMEOUT_S` shows `{"error": ...}`), this
        ingress's TTFT breakdown (p50/p90 by phase; `?since=<Unix s>` limits it to requests
        finished since), unit cost, and its batch jobs' pacing (`batch`). With tenants
        configured, only admin keys may read it."""
        self.frontend.check_admin(_api_key(request))
        since = _since(request)
        await self.readiness.is_ready()  # refreshes the replica counts behind unit cost
        report = {"routing": self.frontend.routing_report(), "pools": await self._pool_stats()}
        if self.quota_service is not None:
            report["quotas"] = await self._quota_stats()
        if self.batch is not None:
            report["batch"] = self.batch.report()
        report.update(self.frontend.telemetry.report(since))
        return report

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        self._check_docs()
        return JSONResponse(request.app.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> HTMLResponse:
        self._check_docs()
        return get_swagger_ui_html(openapi_url=self._openapi_url(request), title="pdserve")

    @api.get("/redoc", include_in_schema=False)
    async def redoc(self, request: Request) -> HTMLResponse:
        self._check_docs()
        return get_redoc_html(openapi_url=self._openapi_url(request), title="pdserve")

    def _check_docs(self) -> None:
        if not self.config.http.enable_docs:
            raise StarletteHTTPException(status_code=404, detail="Not Found")

    @staticmethod
    def _openapi_url(request: Request) -> str:
        return f"{request.scope.get('root_path', '').rstrip('/')}/openapi.json"

    async def _quota_stats(self) -> dict[str, Any]:
        """The quota ledger's per-tenant state, or `{"error": ...}` (bounded like a pool)."""
        try:
            return await asyncio.wait_for(self.frontend.admission.stats(), STATS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - reported in place of the numbers
            return {"error": f"{type(exc).__name__}: {exc}"}

    async def _pool_stats(self) -> dict[str, Any]:
        async def one(pool: Any) -> dict[str, Any]:
            try:
                result: dict[str, Any] = await asyncio.wait_for(
                    pool.stats.remote(), timeout=STATS_TIMEOUT_S
                )
            except TimeoutError:
                return {"error": f"no answer within {STATS_TIMEOUT_S} s"}
            except Exception as exc:  # noqa: BLE001 - one pool's failure is its own entry
                return {"error": f"{type(exc).__name__}: {exc}"}
            return result

        names = list(self.pools)
        results = await asyncio.gather(*(one(self.pools[n]) for n in names))
        return dict(zip(names, results, strict=True))

    # ---- Python handle API -----------------------------------------------------------

    async def generate(
        self, request: GenerateRequest | dict[str, Any]
    ) -> AsyncIterator[GenerateChunk]:
        """Stream a completion for another Ray application (`handle.options(stream=True)`).

        Same authentication, limits and routing as HTTP; errors raise the same `APIError`s
        (a request that fails validation raises `BadRequestError`, not pydantic's error).
        """
        try:
            if isinstance(request, GenerateRequest):  # validated where it was built; again here
                request = GenerateRequest.model_validate(request.model_dump())
            else:
                request = GenerateRequest.model_validate(request)
        except pydantic.ValidationError as exc:
            message, param = validation_message(exc.errors(include_url=False))
            raise BadRequestError(message, param=param) from None
        tenant = self.frontend.authenticate(request.api_key)
        text = request.prompt is not None
        entry = Entry(
            model=request.model,
            sampling_params=request.to_sampling_params,
            prompt=request.prompt if text else request.prompt_token_ids,
            prompt_param="prompt" if text else "prompt_token_ids",
            slo_class=request.slo_class,
            timeout_s=request.timeout,
        )
        try:
            prepared = await self.frontend.admit(tenant, entry)
        except InvalidRequestError as exc:  # HTTP's error handlers are not in this path
            raise bad_request(exc) from None
        async with contextlib.aclosing(self.frontend.run(prepared)) as deltas:
            async for _, delta in deltas:
                route = prepared.served.route or prepared.route  # the fallback's, if it served
                yield GenerateChunk.from_delta(delta, route.reason)

    async def routing_report(self) -> dict[str, Any]:
        return self.frontend.routing_report()
