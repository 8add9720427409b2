"""The HTTP ingress: an OpenAI-compatible API (FastAPI inside a Serve deployment).

Also the target of Python `DeploymentHandle` callers (`generate`), with the same checks.
Every error comes back as an OpenAI-style JSON body with a 4xx/5xx status; the body size
limit is enforced before parsing.
"""

# No `from __future__ import annotations` here: Serve's ingress re-wraps these methods and
# FastAPI must see real `Request` classes, not strings, to inject the request object.

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve

from app.builders import ChatBuilder, CompletionBuilder, TokenStrings
from app.config import PDServeConfig
from app.errors import (
    PayloadTooLargeError,
    ServiceUnavailableError,
    error_response,
    install_error_handlers,
)
from app.frontend import Frontend, PreparedRequest
from app.handle import GenerateChunk, GenerateRequest
from app.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    sse_event,
)

logger = logging.getLogger(__name__)

api = FastAPI(title="pdserve", description="Disaggregated prefill/decode LLM serving")
install_error_handlers(api)


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
    ) -> None:
        self.config = PDServeConfig.model_validate(config)
        self.frontend = Frontend(self.config, decode_pools)
        self.pools: dict[str, Any] = {**prefill_pools, **decode_pools}
        self.token_strings = TokenStrings(self.frontend.tokenizer)
        self.created = int(time.time())

    # ---- helpers ---------------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
        limit = self.config.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"request body of {declared} bytes exceeds {limit} bytes")
        raw = await request.body()
        if len(raw) > limit:
            raise PayloadTooLargeError(f"request body of {len(raw)} bytes exceeds {limit} bytes")
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise json.JSONDecodeError("expected a JSON object", raw.decode(errors="replace"), 0)
        return body

    async def _respond(
        self,
        prepared: PreparedRequest,
        builder: CompletionBuilder | ChatBuilder,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        headers = {"x-pdserve-route": prepared.route.reason}
        if not stream:
            async for index, delta in self.frontend.run(prepared):
                builder.add(index, delta)
            return JSONResponse(builder.build().model_dump(mode="json"), headers=headers)
        # Wait for the first delta before answering, so an early error (quota, a pool
        # that is down) is a real 4xx/5xx status rather than an in-band SSE error.
        events = self.frontend.run(prepared)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None

        async def rest() -> AsyncIterator[tuple[int, Any]]:
            if first is not None:
                yield first
                async for item in events:
                    yield item

        async def sse() -> AsyncIterator[str]:
            try:
                async for index, delta in rest():
                    chunk = builder.add(index, delta)
                    if chunk is not None:
                        yield sse_event(chunk)
                if include_usage:
                    yield sse_event(builder.usage_chunk())
            except Exception as exc:  # noqa: BLE001 - reported in-band once streaming
                logger.warning("stream failed: %r", exc)
                yield sse_event(dict(error_response(exc)[1]))
            finally:
                await events.aclose()
            yield SSE_DONE

        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    # ---- OpenAI routes ---------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        body = CompletionRequest.model_validate(await self._body(request))
        self.frontend.check_model(body.model)
        params = body.to_sampling_params(default_max_tokens=16)
        prompt_ids = self.frontend.tokenize_prompt(body.prompt)
        prepared = self.frontend.prepare(_api_key(request), prompt_ids, params, body.n)
        builder = CompletionBuilder(
            self.frontend.model_name,
            n=body.n,
            num_logprobs=params.logprobs,
            tokens=self.token_strings,
        )
        return await self._respond(prepared, builder, body.stream, body.include_usage)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        body = ChatCompletionRequest.model_validate(await self._body(request))
        self.frontend.check_model(body.model)
        prompt_ids = self.frontend.tokenize_chat(body.chat_messages())
        params = body.to_sampling_params(self.frontend.default_max_tokens(len(prompt_ids)))
        prepared = self.frontend.prepare(_api_key(request), prompt_ids, params, body.n)
        builder = ChatBuilder(
            self.frontend.model_name,
            n=body.n,
            num_logprobs=params.logprobs,
            tokens=self.token_strings,
        )
        return await self._respond(prepared, builder, body.stream, body.include_usage)

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self.frontend.policy.tenant_for_key(_api_key(request))  # 401 for unknown keys
        card = ModelCard(id=self.frontend.model_name, created=self.created)
        return ModelList(data=[card]).model_dump(mode="json")

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        """Ready only when a replica of every pool answers (its model is loaded)."""
        try:
            stats = await asyncio.wait_for(self._pool_stats(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - any pool not answering means not ready
            raise ServiceUnavailableError(f"pools not ready: {exc!r}", code="not_ready") from exc
        return {"status": "ok", "pools": {name: s["replica"] for name, s in stats.items()}}

    @api.get("/v1/pdserve/stats")
    async def stats(self, request: Request) -> dict[str, Any]:
        """Extension: routing decisions and each pool's KV occupancy (one replica each).
        With tenants configured, only admin keys may read it."""
        self.frontend.check_admin(_api_key(request))
        return {"routing": self.frontend.routing_report(), "pools": await self._pool_stats()}

    async def _pool_stats(self) -> dict[str, Any]:
        names = list(self.pools)
        results = await asyncio.gather(*(self.pools[n].stats.remote() for n in names))
        return dict(zip(names, results, strict=True))

    # ---- Python handle API -----------------------------------------------------------

    async def generate(
        self, request: GenerateRequest | dict[str, Any]
    ) -> AsyncIterator[GenerateChunk]:
        """Stream a completion for another Ray application (`handle.options(stream=True)`).

        Same authentication, limits and routing as HTTP; errors raise the same `APIError`s.
        """
        if not isinstance(request, BaseModel):
            request = GenerateRequest.model_validate(request)
        self.frontend.check_model(request.model)
        params = request.to_sampling_params()
        prompt = request.prompt if request.prompt is not None else request.prompt_token_ids
        prompt_ids = self.frontend.tokenize_prompt(prompt or [])
        prepared = self.frontend.prepare(request.api_key, prompt_ids, params, 1)
        async for _, delta in self.frontend.run(prepared):
            yield GenerateChunk.from_delta(delta, prepared.route.reason)

    async def routing_report(self) -> dict[str, Any]:
        return self.frontend.routing_report()
