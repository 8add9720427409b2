"""One batch line through the front door, as the same request sent online would run.

The body is validated as the OpenAI route validates it, admitted by `Frontend.admit` (so it
counts against its tenant's quotas, is placed, and may be shed) in the batch SLO class,
run by the front door's `RequestRunner`, and answered with the same JSON body (usage
included) the route would send. Any error becomes its status code and OpenAI error body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic

from app.builders import ChatBuilder, CompletionBuilder, TokenStrings
from app.errors import APIError, BadRequestError, bad_request, error_response
from app.frontend import Frontend
from app.prepared import Entry
from app.protocol import ChatCompletionRequest, CompletionRequest
from app.routing.pool_router import RouteDecision
from engine.request import InvalidRequestError

# Refused for load, not for what it asks: the line is tried again later, not failed.
RETRY_STATUSES = frozenset({429, 503, 504})


@dataclass(frozen=True, slots=True)
class LineOutcome:
    """What one attempt at a line answered."""

    status_code: int
    body: dict[str, Any]
    request_id: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def retry(self) -> bool:
        return self.status_code in RETRY_STATUSES


class LineExecutor:
    """Runs lines of `endpoint` bodies for a tenant through `frontend`."""

    def __init__(
        self,
        frontend: Frontend,
        slo_class: str | None,
        delta_interval_s: float = 0.0,
        local_prefill_max_tokens: int = 0,
        busy_local_prefill_max_tokens: int = 0,
    ) -> None:
        """`slo_class`: the class lines ask for (the batch class), None for the tenant's
        default; a tenant whose default is less important than it keeps its default.
        `delta_interval_s`: how often the decode pool sends a line's tokens (merged).
        `local_prefill_max_tokens`: while `idle()` (the batch service's pacer says so), a
        line with at most this many prompt tokens is prefilled on its decode replica (placed
        so, `Entry.local_prefill_max_tokens`); `busy_local_prefill_max_tokens`: the same
        bound while it is not, never above the first (0 there turns both off)."""
        self.frontend = frontend
        self.slo_class = slo_class
        self.delta_interval_s = delta_interval_s
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.busy_local_prefill_max_tokens = busy_local_prefill_max_tokens
        self.idle: Callable[[], bool] = lambda: False
        self.token_strings = TokenStrings(frontend.tokenizer)
        self._decode_pools = {p.name for p in frontend.config.pools_by_role("decode")}
        self._classes: dict[str, str | None] = {}

    def line_class(self, tenant: str) -> str | None:
        """The class `tenant`'s lines run in."""
        if tenant not in self._classes:
            try:
                self.frontend.classes.resolve(tenant, self.slo_class)
                self._classes[tenant] = self.slo_class
            except APIError:
                self._classes[tenant] = None
        return self._classes[tenant]

    def line_priority(self, tenant: str) -> int:
        """The priority `tenant`'s lines run at (lower is more important)."""
        return self.frontend.classes.resolve(tenant, self.line_class(tenant)).priority

    async def __call__(self, tenant: str, endpoint: str, body: Mapping[str, Any]) -> LineOutcome:
        try:
            return await self._run(tenant, endpoint, body)
        except InvalidRequestError as exc:
            status, error = error_response(bad_request(exc))
        except (APIError, pydantic.ValidationError) as exc:
            status, error = error_response(exc)
        return LineOutcome(status, dict(error))

    async def _run(self, tenant: str, endpoint: str, body: Mapping[str, Any]) -> LineOutcome:
        request: CompletionRequest | ChatCompletionRequest
        builder_class: type[CompletionBuilder] | type[ChatBuilder]
        slo_class = self.line_class(tenant)
        idle = self.idle()
        local_max = self.local_prefill_max_tokens
        if not idle:
            local_max = min(local_max, self.busy_local_prefill_max_tokens)
        if endpoint == "/v1/completions":
            request = CompletionRequest.model_validate(body)
            entry = _entry(
                request, slo_class, local_max, prompt=request.prompt, prompt_param="prompt"
            )
            builder_class = CompletionBuilder
        else:
            request = ChatCompletionRequest.model_validate(body)
            entry = _entry(
                request,
                slo_class,
                local_max,
                messages=request.chat_messages(),
                prompt_param="messages",
            )
            builder_class = ChatBuilder
        if request.stream:
            raise BadRequestError("a batch line cannot stream", param="stream")
        prepared = await self.frontend.admit(tenant, entry)  # may wait for a quota slot
        spare = line_is_spare(prepared.route, self.idle(), self._decode_pools)
        prepared = dataclasses.replace(
            prepared, delta_interval_s=self.delta_interval_s, spare=spare
        )
        builder = builder_class(
            self.frontend.model_name,
            n=request.n,
            num_logprobs=prepared.sampling_params.logprobs,
            tokens=self.token_strings,
        )
        async for index, delta in self.frontend.run(prepared):
            builder.add(index, delta)
        if prepared.served.fallback is not None:
            builder.model = self.frontend.served_model(prepared)
        response = builder.build().model_dump(mode="json")
        usage = response.get("usage") or {}
        return LineOutcome(
            200,
            response,
            prepared.request_id,
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
        )


def line_is_spare(route: RouteDecision, idle: bool, decode_pools: Collection[str]) -> bool:
    """Whether a line on `route` may take the cores idle replicas leave
    (`GenerationSpec.spare`, `model.spare_num_threads`): sent on an idle service and
    computed whole on a decode pool. Not a line whose prompt a prefill replica computes
    meanwhile, nor one moved whole onto a prefill pool (decode overflow: its neighbour
    would widen too)."""
    return idle and route.local_prefill and route.decode_pool in decode_pools


def _entry(
    request: CompletionRequest | ChatCompletionRequest,
    slo_class: str | None,
    local_prefill_max_tokens: int,
    **prompt: Any,
) -> Entry:
    """The front door's view of a line's body, in the batch class; a prompt of at most
    `local_prefill_max_tokens` is placed to prefill where it decodes (`Placement.place`)."""
    return Entry(
        model=request.model,
        sampling_params=request.to_sampling_params,
        n=request.n,
        slo_class=slo_class,
        timeout_s=request.timeout,
        local_prefill_max_tokens=local_prefill_max_tokens,
        **prompt,
    )
