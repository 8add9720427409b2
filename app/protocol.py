"""The OpenAI API subset pdserve serves: request and response models, and response builders.

Wire format follows the official `openai` client's types (`openai.types.Completion`,
`openai.types.chat.ChatCompletion`, `ChatCompletionChunk`, `Model`). Requests are parsed in
strict mode: unknown fields are ignored (clients send some), wrong types fail (422). Features we
do not implement (`echo`, batched prompts, `tools`, JSON mode, ...) raise
`UnsupportedFeatureError` (400) out of validation, and out-of-range sampling values raise
`engine.request.InvalidRequestError` (400) from `to_sampling_params`.

A response with `n` choices is built from `n` engine request streams: feed each
`RequestOutput` delta to `builder.add(index, delta)`; streaming sends what `add` returns
(then `usage_chunk()` if asked, then `SSE_DONE`), otherwise `build()` once all choices finished.
Engine finish reason "abort" passes through as "abort" (not in OpenAI's enum, as in vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.errors import UnsupportedFeatureError
from engine.outputs import RequestOutput
from engine.request import SamplingParams

SSE_DONE = "data: [DONE]\n\n"
FinishReason = Literal["stop", "length", "abort"]
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}

# ---------------------------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    """`stream_options`: what to add to a streamed response."""

    include_usage: bool = Field(False, description="Send a last chunk with usage, no choices.")


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str = Field(description="Served model name.")
    temperature: float = Field(1.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, description="Nucleus sampling mass, in (0, 1].")
    n: int = Field(1, ge=1, le=8, description="Number of choices to generate.")
    stream: bool = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    stop: str | Annotated[list[str], Field(max_length=4)] | None = Field(
        None, description="Up to 4 stop strings, not included in the output."
    )
    seed: int | None = Field(None, description="Seed for reproducible sampling.")
    presence_penalty: float = Field(0.0, description="In [-2, 2].")
    frequency_penalty: float = Field(0.0, description="In [-2, 2].")
    user: str | None = Field(None, description="End-user id (logged, not used).")
    top_k: int | None = Field(None, description="Extension: top-k; 0 or -1 disables.")
    min_p: float = Field(0.0, description="Extension: min-p filtering, in [0, 1].")
    repetition_penalty: float = Field(1.0, description="Extension: > 0; 1 disables.")
    ignore_eos: bool = Field(False, description="Extension: keep going past EOS.")
    min_tokens: int = Field(0, description="Extension: minimum tokens before stopping.")
    stop_token_ids: list[int] | None = Field(None, description="Extension: stop token ids.")
    logit_bias: dict[str, float] | None = Field(None, description="Unsupported if non-empty.")

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k or 0, 0),
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            min_tokens=self.min_tokens,
        )

    def _reject_unsupported(self, fields: Mapping[str, bool]) -> None:
        for name, used in fields.items():
            if used:
                raise UnsupportedFeatureError(f"'{name}' is not supported", param=name)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. One prompt per request: batches of prompts are a 400."""

    prompt: str | TokenIds = Field(description="Text, token ids, or a list of one of either.")
    max_tokens: int | None = Field(16, description="Tokens to generate; null = server default.")
    logprobs: int | None = Field(None, ge=0, le=5, description="Top alternatives per token.")
    echo: bool = Field(False, description="Unsupported if true.")
    suffix: str | None = Field(None, description="Unsupported if set.")
    best_of: int | None = Field(None, description="Unsupported if over 1.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: object) -> object:
        """Unwrap `["text"]` / `[[ids]]`; a batch of several prompts is unsupported."""
        if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
            if len(value) > 1:
                raise UnsupportedFeatureError(
                    f"batched prompts are not supported (got {len(value)}); "
                    "send one prompt per request",
                    param="prompt",
                )
            return value[0]
        return value

    @model_validator(mode="after")
    def _check_supported(self) -> CompletionRequest:
        self._reject_unsupported(
            {
                "echo": self.echo,
                "suffix": bool(self.suffix),
                "best_of": (self.best_of or 1) > 1,
                "logit_bias": bool(self.logit_bias),
            }
        )
        return self

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Engine sampling params; `default_max_tokens` applies when max_tokens is null.

        Raises `InvalidRequestError` for out-of-range values.
        """
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


class ChatTextPart(_Request):
    """One text part of a message's content list."""

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")


class ChatMessageParam(_Request):
    """One message of the conversation."""

    role: Literal["system", "user", "assistant"] = Field(description="Who wrote it.")
    content: str | list[ChatTextPart] = Field(description="Text, or a list of text parts.")
    name: str | None = Field(None, description="Optional participant name (ignored).")

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageParam] = Field(min_length=1, description="The conversation.")
    max_tokens: int | None = Field(None, description="Deprecated alias of the next field.")
    max_completion_tokens: int | None = Field(None, description="Tokens to generate.")
    logprobs: bool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Alternatives per token.")
    tools: list[object] | None = Field(None, description="Unsupported if non-empty.")
    response_format: dict[str, object] | None = Field(None, description="Only type 'text'.")

    @model_validator(mode="after")
    def _check_supported(self) -> ChatCompletionRequest:
        response_type = (self.response_format or {}).get("type", "text")
        self._reject_unsupported(
            {
                "tools": bool(self.tools),
                "logit_bias": bool(self.logit_bias),
                "response_format": response_type != "text",
            }
        )
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("logprobs_required", "requires logprobs to be true")
        return value

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as `{"role", "content"}` dicts, for `tokenizer.apply_chat_template`."""
        return [{"role": m.role, "content": m.text} for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Engine sampling params; max_completion_tokens wins over max_tokens, then the default.

        Raises `InvalidRequestError` for out-of-range values.
        """
        max_tokens = next(
            v
            for v in (self.max_completion_tokens, self.max_tokens, default_max_tokens)
            if v is not None
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


def choice_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params for choice `index` of n: a seeded request gets seed + index, so choices differ."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


# --------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """Breakdown of the prompt tokens."""

    cached_tokens: int = 0


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


# ---------------------------------------------------------------------------------- builders


class TokenizerLike(Protocol):
    """The two tokenizer methods the builders use (a Hugging Face tokenizer has both)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str | list[str]:
        """Text of the ids."""
        ...

    def convert_ids_to_tokens(self, ids: int, skip_special_tokens: bool = False) -> str | list[str]:
        """The vocabulary entry of an id."""
        ...


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's ByteLevel vocabulary characters -> the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in printable)
    chars.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


class TokenStrings:
    """Token id -> display text and UTF-8 bytes for logprobs, cached. Share one per tokenizer."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int] | None] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone (a partial UTF-8 character shows as U+FFFD)."""
        text = self._texts.get(token_id)
        if text is None:
            decoded = self._tokenizer.decode([token_id], False)
            text = self._texts[token_id] = decoded if isinstance(decoded, str) else "".join(decoded)
        return text

    def utf8(self, token_id: int) -> list[int] | None:
        """The token's bytes (right for byte-level and byte-fallback vocabularies), or None."""
        if token_id not in self._bytes:
            self._bytes[token_id] = self._compute_utf8(token_id)
        return self._bytes[token_id]

    def _compute_utf8(self, token_id: int) -> list[int] | None:
        text = self.text(token_id)
        if "\ufffd" not in text:
            return list(text.encode("utf-8"))
        piece = self._tokenizer.convert_ids_to_tokens(token_id, False)
        if not isinstance(piece, str):
            return None
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return [int(match.group(1), 16)]
        if piece and all(c in _BYTE_LEVEL_CHARS for c in piece):
            return [_BYTE_LEVEL_CHARS[c] for c in piece]
        return None


def _top(entry: dict[int, float], num: int | None) -> list[tuple[int, float]]:
    """An engine logprobs entry (sampled token first, then top-N) -> the top `num`, best first."""
    ranked = sorted(entry.items(), key=lambda item: item[1], reverse=True)
    return ranked if num is None else ranked[:num]


@dataclasses.dataclass(slots=True)
class _ChoiceState:
    text: str = ""
    finish_reason: FinishReason | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_deltas: int = 0
    completion_logprobs: CompletionLogprobs = dataclasses.field(default_factory=CompletionLogprobs)
    chat_logprobs: list[ChatTokenLogprob] = dataclasses.field(default_factory=list)


def new_response_id(prefix: str) -> str:
    """A fresh response id such as `cmpl-<32 hex>` or `chatcmpl-<32 hex>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class _Builder:
    """Accumulates the deltas of `n` engine streams (one per choice index)."""

    _id_prefix = "resp"

    def __init__(
        self,
        model: str,
        *,
        n: int = 1,
        num_logprobs: int | None = None,
        tokens: TokenStrings | None = None,
        response_id: str | None = None,
        created: int | None = None,
    ) -> None:
        """`num_logprobs`: the request's logprobs / top_logprobs (None: none asked for)."""
        if num_logprobs is not None and tokens is None:
            raise ValueError("logprobs need a TokenStrings to name the tokens")
        self.id = response_id or new_response_id(self._id_prefix)
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.num_logprobs = num_logprobs
        self._tokens = tokens
        self._choices = [_ChoiceState() for _ in range(n)]
        self._num_prompt_tokens = 0

    @property
    def finished(self) -> bool:
        """Whether every choice has finished."""
        return all(c.finish_reason is not None for c in self._choices)

    @property
    def usage(self) -> Usage:
        """Token counts so far; cached tokens are those cached for every choice."""
        completion = sum(c.num_output_tokens for c in self._choices)
        cached = min(c.num_cached_tokens for c in self._choices)
        return Usage(
            prompt_tokens=self._num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=self._num_prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def _record(self, index: int, delta: RequestOutput) -> _ChoiceState:
        state = self._choices[index]
        if state.finish_reason is not None:
            raise ValueError(f"choice {index} of {self.id} got a delta after it finished")
        state.text += delta.new_text
        state.num_output_tokens = delta.num_output_tokens
        state.num_cached_tokens = delta.num_cached_tokens
        self._num_prompt_tokens = delta.num_prompt_tokens
        if delta.finished:
            if delta.finish_reason not in _FINISH_REASONS:
                raise ValueError(f"unexpected finish_reason {delta.finish_reason!r} from engine")
            state.finish_reason = _FINISH_REASONS[delta.finish_reason]
        state.num_deltas += 1
        return state

    def _has_news(self, delta: RequestOutput) -> bool:
        logprobs = self.num_logprobs is not None and bool(delta.new_token_ids)
        return bool(delta.new_text) or delta.finished or logprobs

    def _check_finished(self) -> None:
        if not self.finished:
            raise RuntimeError(f"{self.id}: build() before every choice finished")


class CompletionBuilder(_Builder):
    """Builds `Completion` responses and stream chunks for POST /v1/completions."""

    _id_prefix = "cmpl"

    def add(self, index: int, delta: RequestOutput) -> Completion | None:
        """Record choice `index`'s delta; return its stream chunk (None: nothing to send)."""
        state = self._record(index, delta)
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = self._logprobs(delta, state.completion_logprobs)
        if not self._has_news(delta):
            return None
        choice = CompletionChoice(
            index=index, text=delta.new_text, logprobs=logprobs, finish_reason=state.finish_reason
        )
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, delta: RequestOutput, total: CompletionLogprobs) -> CompletionLogprobs:
        assert self._tokens is not None
        part = CompletionLogprobs()
        offset = total.text_offset[-1] + len(total.tokens[-1]) if total.tokens else 0
        for token_id, entry in zip(delta.new_token_ids, delta.new_logprobs, strict=True):
            text = self._tokens.text(token_id)
            top: dict[str, float] = {}
            for alt_id, logprob in _top(entry, None):
                top.setdefault(self._tokens.text(alt_id), logprob)
            part.tokens.append(text)
            part.token_logprobs.append(entry[token_id])
            part.top_logprobs.append(top)
            part.text_offset.append(offset)
            offset += len(text)
        total.tokens += part.tokens
        total.token_logprobs += part.token_logprobs
        total.top_logprobs += part.top_logprobs
        total.text_offset += part.text_offset
        return part

    def build(self) -> Completion:
        """The whole response, once every choice finished."""
        self._check_finished()
        choices = [
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=c.completion_logprobs if self.num_logprobs is not None else None,
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(self._choices)
        ]
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage
        )

    def usage_chunk(self) -> Completion:
        """The last streamed chunk when include_usage: no choices, the usage."""
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage
        )


class ChatBuilder(_Builder):
    """Builds `ChatCompletion` responses and `ChatCompletionChunk`s for /v1/chat/completions."""

    _id_prefix = "chatcmpl"

    def add(self, index: int, delta: RequestOutput) -> ChatCompletionChunk | None:
        """Record choice `index`'s delta; return its chunk (the first one carries the role)."""
        state = self._record(index, delta)
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = ChatChoiceLogprobs(content=self._logprobs(delta))
            state.chat_logprobs.extend(logprobs.content or [])
        first = state.num_deltas == 1
        if not (first or self._has_news(delta)):
            return None
        message = (
            ChatDelta(role="assistant", content=delta.new_text)
            if first
            else ChatDelta(content=delta.new_text or None)
        )
        choice = ChatChunkChoice(
            index=index, delta=message, logprobs=logprobs, finish_reason=state.finish_reason
        )
        return self._chunk([choice])

    def _logprobs(self, delta: RequestOutput) -> list[ChatTokenLogprob]:
        tokens = self._tokens
        assert tokens is not None
        return [
            ChatTokenLogprob(
                token=tokens.text(token_id),
                logprob=entry[token_id],
                bytes=tokens.utf8(token_id),
                top_logprobs=[
                    TopLogprob(token=tokens.text(alt), logprob=lp, bytes=tokens.utf8(alt))
                    for alt, lp in _top(entry, self.num_logprobs)
                ],
            )
            for token_id, entry in zip(delta.new_token_ids, delta.new_logprobs, strict=True)
        ]

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def build(self) -> ChatCompletion:
        """The whole response, once every choice finished."""
        self._check_finished()
        choices = [
            ChatChoice(
                index=i,
                message=ChatMessage(content=c.text),
                logprobs=(
                    ChatChoiceLogprobs(content=c.chat_logprobs)
                    if self.num_logprobs is not None
                    else None
                ),
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(self._choices)
        ]
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage
        )

    def usage_chunk(self) -> ChatCompletionChunk:
        """The last streamed chunk when include_usage: no choices, the usage."""
        return self._chunk([], self.usage)
