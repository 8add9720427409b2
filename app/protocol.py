"""The OpenAI API subset pdserve serves: request models (responses: `app.responses`).

Wire format follows the official `openai` client's types (`openai.types.Completion`,
`openai.types.chat.ChatCompletion`, `ChatCompletionChunk`, `Model`). A body is parsed by
`parse_json_object` (any malformed JSON is a 400, with bounded work), then validated in strict
mode: unknown fields are ignored (clients send some), wrong types, NaN/infinite numbers, and
counts or lengths over the limits fail (pydantic errors, a 400 naming the field). Features we
do not implement (`echo`, batched prompts, `tools`, JSON mode, ...) raise
`UnsupportedFeatureError` (400) out of validation, and out-of-range sampling values raise
`engine.request.InvalidRequestError` (400) from `to_sampling_params` (both APIs map their
sampling fields through `sampling_params`).

Responses (`app.responses`) are built from engine output by `app.builders`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.errors import BadRequestError, UnsupportedFeatureError
from engine.request import (
    MAX_NUM_STOP_STRINGS,
    MAX_NUM_STOP_TOKEN_IDS,
    MAX_STOP_STRING_CHARS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)

if TYPE_CHECKING:
    from app.handle import GenerateRequest

# Output tokens when a request names none (max_tokens omitted or null), on every entry point:
# the OpenAI completions API's default. Ask for more explicitly (up to limits.max_output_tokens).
DEFAULT_MAX_TOKENS = 16
MAX_USER_CHARS = 256  # the `user` and message `name` strings (logged, never used)

# ---------------------------------------------------------------------------------- requests


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body -> its top-level JSON object. Raises `BadRequestError` (400) otherwise.

    Malformed input of any shape is a 400: bad syntax, invalid UTF-8, nesting deeper than the
    interpreter's recursion limit, integers over Python's digit limit, a top level other than
    an object. The work is bounded by the body size (the caller caps it) and the recursion
    limit.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"malformed JSON: body is not valid UTF-8 ({exc.reason})") from exc
    try:
        body = json.loads(text)
    except RecursionError as exc:
        raise BadRequestError("malformed JSON: nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, or an integer with too many digits
        raise BadRequestError(f"malformed JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequestError(
            f"malformed JSON: the body must be a JSON object, got {type(body).__name__}"
        )
    return body


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


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
    stop: (
        StopString | Annotated[list[StopString], Field(max_length=MAX_NUM_STOP_STRINGS)] | None
    ) = Field(None, description="Up to 4 stop strings, not included in the output.")
    seed: int | None = Field(
        None, ge=SEED_MIN, le=SEED_MAX, description="Seed for reproducible sampling (int64)."
    )
    presence_penalty: float = Field(0.0, description="In [-2, 2].")
    frequency_penalty: float = Field(0.0, description="In [-2, 2].")
    user: str | None = Field(
        None, max_length=MAX_USER_CHARS, description="End-user id (logged, not used)."
    )
    top_k: int | None = Field(None, ge=-1, description="Extension: top-k; 0 or -1 disables.")
    min_p: float = Field(0.0, description="Extension: min-p filtering, in [0, 1].")
    repetition_penalty: float = Field(1.0, description="Extension: > 0; 1 disables.")
    ignore_eos: bool = Field(False, description="Extension: keep going past EOS.")
    min_tokens: int = Field(
        0, ge=0, description="Extension: minimum tokens before stopping (<= max_tokens)."
    )
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_NUM_STOP_TOKEN_IDS)]
        | None
    ) = Field(None, description="Extension: stop token ids (each below the vocabulary size).")
    logit_bias: dict[str, float] | None = Field(None, description="Unsupported if non-empty.")
    timeout: float | None = Field(
        None,
        gt=0,
        description="Extension: seconds until the request is aborted (504 deadline_exceeded); "
        "the header x-pdserve-timeout wins over it.",
    )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _reject_unsupported(self, fields: Mapping[str, bool]) -> None:
        for name, used in fields.items():
            if used:
                raise UnsupportedFeatureError(f"'{name}' is not supported", param=name)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. One prompt per request: batches of prompts are a 400."""

    prompt: str | TokenIds = Field(description="Text, token ids, or a list of one of either.")
    max_tokens: int | None = Field(
        DEFAULT_MAX_TOKENS, description="Tokens to generate; null = the default (16)."
    )
    logprobs: int | None = Field(None, ge=0, le=5, description="Top alternatives per token.")
    echo: bool = Field(False, description="Unsupported if true.")
    suffix: str | None = Field(None, description="Unsupported if set.")
    best_of: int | None = Field(None, ge=1, description="Unsupported if over 1.")

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

    def to_sampling_params(self) -> SamplingParams:
        """Engine sampling params; `DEFAULT_MAX_TOKENS` when max_tokens is null.

        Raises `InvalidRequestError` for out-of-range values.
        """
        max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return sampling_params(self, max_tokens, self.logprobs)


class ChatTextPart(_Request):
    """One text part of a message's content list."""

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: object) -> object:
        if isinstance(value, dict) and value.get("type", "text") != "text":
            raise PydanticCustomError(
                "unsupported_content_part",
                "content parts of type '{part_type}' are not supported; only 'text'",
                {"part_type": str(value.get("type"))},
            )
        return value


class ChatMessageParam(_Request):
    """One message of the conversation."""

    role: Literal["system", "user", "assistant"] = Field(description="Who wrote it.")
    content: str | list[ChatTextPart] = Field(description="Text, or a list of text parts.")
    name: str | None = Field(
        None, max_length=MAX_USER_CHARS, description="Optional participant name (ignored)."
    )

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
    max_completion_tokens: int | None = Field(
        None, description="Tokens to generate; null (with max_tokens null) = the default (16)."
    )
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

    def to_sampling_params(self) -> SamplingParams:
        """Engine sampling params; max_completion_tokens wins over max_tokens, then
        `DEFAULT_MAX_TOKENS`.

        Raises `InvalidRequestError` for out-of-range values.
        """
        max_tokens = next(
            v
            for v in (self.max_completion_tokens, self.max_tokens, DEFAULT_MAX_TOKENS)
            if v is not None
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return sampling_params(self, max_tokens, logprobs)


def sampling_params(
    body: _SamplingRequest | GenerateRequest, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """The one mapping of API sampling fields to the engine's `SamplingParams`, for the
    OpenAI bodies and the handle API's `GenerateRequest` (`max_tokens` and `logprobs` are
    resolved by the caller, as each API names them differently). A single stop string is a
    list of one; `top_k` null or -1 disables it, as 0 does. Raises `InvalidRequestError`
    for out-of-range values."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=body.temperature,
        top_k=max(body.top_k or 0, 0),
        top_p=body.top_p,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        stop=tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def choice_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params for choice `index` of n: a seeded request gets seed + index, so choices differ."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)
