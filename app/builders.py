"""Response builders: engine `RequestOutput` deltas -> the OpenAI response models of `app.protocol`.

A response with `n` choices is built from `n` engine request streams: feed each
`RequestOutput` delta to `builder.add(index, delta)`; streaming sends what `add` returns
(then `usage_chunk()` if asked, then `SSE_DONE`), otherwise `build()` once all choices finished.
`add_event(index, delta)` is `add` already encoded as a server-sent event: without logprobs
(the common stream) it fills a pre-encoded JSON template, byte for byte what the pydantic
chunk would serialize to, so a streamed token costs no model construction or dump.
Engine finish reason "abort" passes through as "abort" (not in OpenAI's enum, as in vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Protocol

from app.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    sse_event,
)
from engine.outputs import RequestOutput

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


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


def _json_str(text: str) -> str:
    """`text` as a JSON string, escaped exactly as pydantic's serializer escapes it."""
    return json.dumps(text, ensure_ascii=False)


_FINISH_JSON: dict[str | None, str] = {None: "null"} | {
    r: _json_str(r) for r in _FINISH_REASONS.values()
}


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
    num_transferred_tokens: int = 0
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
        self._event_prefix: tuple[str, str] = ("", "")  # (model, "data: {...") for it

    def _prefix(self, object_name: str) -> str:
        """A stream event's start up to its choices' list (`model` may change before the
        first event: the fallback pool's model; so it is keyed by the model)."""
        model, prefix = self._event_prefix
        if prefix and model == self.model:
            return prefix
        prefix = (
            f'data: {{"id":{_json_str(self.id)},"object":"{object_name}",'
            f'"created":{self.created},"model":{_json_str(self.model)},"choices":[{{"index":'
        )
        self._event_prefix = (self.model, prefix)
        return prefix

    @property
    def finished(self) -> bool:
        """Whether every choice has finished."""
        return all(c.finish_reason is not None for c in self._choices)

    @property
    def usage(self) -> Usage:
        """Token counts so far; cached tokens are those cached for every choice, KV
        transferred tokens those of every choice together."""
        completion = sum(c.num_output_tokens for c in self._choices)
        cached = min(c.num_cached_tokens for c in self._choices)
        moved = sum(c.num_transferred_tokens for c in self._choices)
        return Usage(
            prompt_tokens=self._num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=self._num_prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=cached, kv_transferred_tokens=moved
            ),
        )

    def _record(self, index: int, delta: RequestOutput) -> _ChoiceState:
        state = self._choices[index]
        if state.finish_reason is not None:
            raise ValueError(f"choice {index} of {self.id} got a delta after it finished")
        state.text += delta.new_text
        state.num_output_tokens = delta.num_output_tokens
        state.num_cached_tokens = delta.num_cached_tokens
        state.num_transferred_tokens = delta.num_transferred_tokens
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

    def add_event(self, index: int, delta: RequestOutput) -> str | None:
        """`add`, as its server-sent event (None: nothing to send)."""
        if self.num_logprobs is not None:
            chunk = self.add(index, delta)
            return None if chunk is None else sse_event(chunk)
        state = self._record(index, delta)
        if not self._has_news(delta):
            return None
        return (
            f'{self._prefix("text_completion")}{index},"text":{_json_str(delta.new_text)},'
            f'"logprobs":null,"finish_reason":{_FINISH_JSON[state.finish_reason]}}}],'
            '"usage":null}\n\n'
        )

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

    def add_event(self, index: int, delta: RequestOutput) -> str | None:
        """`add`, as its server-sent event (None: nothing to send)."""
        if self.num_logprobs is not None:
            chunk = self.add(index, delta)
            return None if chunk is None else sse_event(chunk)
        state = self._record(index, delta)
        first = state.num_deltas == 1
        if not (first or self._has_news(delta)):
            return None
        if first:
            message = f'{{"role":"assistant","content":{_json_str(delta.new_text)}}}'
        elif delta.new_text:
            message = f'{{"content":{_json_str(delta.new_text)}}}'
        else:
            message = "{}"
        return (
            f'{self._prefix("chat.completion.chunk")}{index},"delta":{message},'
            f'"logprobs":null,"finish_reason":{_FINISH_JSON[state.finish_reason]}}}],'
            '"usage":null}\n\n'
        )

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
