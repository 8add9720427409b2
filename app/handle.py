"""The Python handle API: typed requests and streamed chunks for other Ray applications.

    from app.handle import GenerateRequest, generate
    async for chunk in generate(GenerateRequest(prompt="hello", max_tokens=16)):
        print(chunk.text, end="")

Calls go to the pdserve ingress deployment through `serve.get_app_handle(...)`, so they
share its authentication, limits, router and quotas with the HTTP API. The application is
found by its ingress (`app.serve.apps.find_app_name`), whatever Serve named it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.protocol import DEFAULT_MAX_TOKENS, sampling_params
from engine.outputs import RequestOutput
from engine.request import (
    MAX_LOGPROBS,
    MAX_NUM_STOP_STRINGS,
    MAX_NUM_STOP_TOKEN_IDS,
    MAX_STOP_STRING_CHARS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)


class GenerateRequest(BaseModel):
    """One completion request. Give `prompt` (text) or `prompt_token_ids`, not both.

    Validated with the same limits as the HTTP API (NaN and infinities are refused; stop
    strings and ids are bounded); the ingress validates it again on arrival, and errors there
    raise the HTTP API's `APIError`s (`BadRequestError`, `AuthenticationError`, ...).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    prompt: str | None = Field(None, description="Prompt text (tokenized by the service).")
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="Pre-tokenized prompt (each id below the vocabulary size)."
    )
    model: str | None = Field(None, description="Served model name; None = the one served.")
    api_key: str | None = Field(None, description="Tenant API key (when tenants are set).")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="Most tokens to generate.")
    min_tokens: int = Field(0, ge=0, description="Fewest tokens to generate (<= max_tokens).")
    temperature: float = Field(1.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="0 disables.")
    min_p: float = Field(0.0, ge=0, le=1, description="Min-p filtering.")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="Reproducible sampling.")
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]] = Field(
        default_factory=list, max_length=MAX_NUM_STOP_STRINGS, description="Stop strings."
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_NUM_STOP_TOKEN_IDS, description="Stop token ids."
    )
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    timeout: float | None = Field(
        None, gt=0, description="Seconds until the request is aborted (DeadlineExceededError)."
    )
    slo_class: str | None = Field(
        None, description="SLO class, no more important than the tenant's default_class."
    )
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Top-N logprobs per token."
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        return self

    def to_sampling_params(self) -> SamplingParams:
        """The engine's params; raises `InvalidRequestError` (e.g. min_tokens > max_tokens)."""
        return sampling_params(self, self.max_tokens, self.logprobs)


class GenerateChunk(BaseModel):
    """New tokens and text of one step; the last chunk has `finished=True`."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] = Field(default_factory=list)
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    num_transferred_tokens: int = Field(
        0, description="Prompt tokens whose KV moved from a prefill replica to decode."
    )
    route: str = Field("", description="The router's decision, human-readable.")

    @classmethod
    def from_delta(cls, delta: RequestOutput, route: str) -> GenerateChunk:
        return cls(
            request_id=delta.request_id,
            token_ids=delta.new_token_ids,
            text=delta.new_text,
            logprobs=delta.new_logprobs,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_output_tokens=delta.num_output_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            num_transferred_tokens=delta.num_transferred_tokens,
            route=route,
        )


async def generate(
    request: GenerateRequest, app_name: str | None = None
) -> AsyncIterator[GenerateChunk]:
    """Stream a completion from a running pdserve application in this Ray cluster.

    `app_name`: the Serve application to call; None finds the one pdserve application
    running (`default` under `serve run app.main:app`, the file's `name` under a config
    file), and raises `AppNotFoundError` when there is none or several. Naming it saves a
    call to the Serve controller per request.
    """
    from ray import serve

    from app.serve.apps import find_app_name

    if app_name is None:
        app_name = await asyncio.to_thread(find_app_name)  # blocks on the Serve controller
    handle: Any = serve.get_app_handle(app_name).options(stream=True)
    response = handle.generate.remote(request)
    finished = False
    try:
        async for chunk in response:
            yield chunk
        finished = True
    finally:
        if not finished:  # the caller stopped early: the request stops and frees its slots
            response.cancel()
