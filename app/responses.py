"""The OpenAI API subset pdserve serves: response models and server-sent events.

Wire format follows the official `openai` client's types (`openai.types.Completion`,
`openai.types.chat.ChatCompletion`, `ChatCompletionChunk`, `Model`); `app.builders` fills
them from engine output. Request models are in `app.protocol`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = "data: [DONE]\n\n"
FinishReason = Literal["stop", "length", "abort"]


class PromptTokensDetails(BaseModel):
    """Breakdown of the prompt tokens. `kv_transferred_tokens` (pdserve's extension): prompt
    tokens whose KV moved from a prefill replica to the decode replica, over all choices."""

    cached_tokens: int = 0
    kv_transferred_tokens: int = 0


class Usage(BaseModel):
    """Token counts of a whole response (the prompt is counted once for n choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    """One choice of a completion (or its new text, in a streamed chunk)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """A completion response; streamed chunks have the same shape."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    """One alternative token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The sampled token at a position, and the most likely alternatives."""

    top_logprobs: list[TopLogprob] = []


class ChatChoiceLogprobs(BaseModel):
    """Logprobs of a chat choice's content."""

    content: list[ChatTokenLogprob] | None = None


class ChatMessage(BaseModel):
    """The assistant's reply."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletion(BaseModel):
    """A (non-streamed) chat completion response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    """What a chunk adds to a choice's message; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    """One choice's part of a streamed chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse_event(obj: BaseModel | Mapping[str, object]) -> str:
    """One server-sent event: `data: {json}\\n\\n`."""
    if isinstance(obj, BaseModel):
        return f"data: {obj.model_dump_json()}\n\n"
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response whose event generator is closed however the response
    ends. Starlette does not close it: a response cancelled while it waits in `send` (the
    client went away, and Serve cancels the handler) leaves the generator suspended at a
    `yield`, and its `finally`, which frees the request's quota slots and KV blocks, would
    run only when the garbage collector gets to it, seconds or minutes later. `source`, the
    generator `events` reads, is closed after it (closing `events` before its first step
    would not reach it)."""

    def __init__(
        self,
        events: AsyncGenerator[str],
        headers: Mapping[str, str],
        source: AsyncGenerator[object] | None = None,
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._closing = [events] if source is None else [events, source]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generator in self._closing:
                await generator.aclose()
