"""Response builders and SSE framing (app/builders.py, app/protocol.py)."""

from __future__ import annotations

import json

import openai.types
import openai.types.chat
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from app.builders import ChatBuilder, CompletionBuilder, TokenStrings, _byte_level_chars
from app.responses import SSE_DONE, sse_event
from engine.outputs import RequestOutput


class ByteLevelTokenizer:
    """GPT-2 style byte-level tokenizer, id b = byte b (like the built-in model's), no torch."""

    def __init__(self) -> None:
        self._tok = Tokenizer(models.BPE(vocab=dict(_byte_level_chars()), merges=[]))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int, skip_special_tokens: bool = False) -> str:
        return self._tok.id_to_token(ids)


TOKENS = TokenStrings(ByteLevelTokenizer())


def delta(
    text: str,
    token_ids: list[int],
    num_output_tokens: int,
    *,
    logprobs: list[dict[int, float]] | None = None,
    finish_reason: str | None = None,
    num_prompt_tokens: int = 5,
    num_cached_tokens: int = 0,
    num_transferred_tokens: int = 0,
) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        new_token_ids=token_ids,
        new_text=text,
        new_logprobs=logprobs or [],
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        num_cached_tokens=num_cached_tokens,
        num_transferred_tokens=num_transferred_tokens,
    )


# "Hé" = bytes 0x48, 0xC3 0xA9: the second token alone is half a character.
H, E1, E2 = 0x48, 0xC3, 0xA9
LOGPROBS = [{H: -0.1, 0x49: -2.5, 0x4A: -3.0}, {E1: -1.5, H: -0.5, 0x49: -2.0}, {E2: -0.01}]


def he_deltas(finish_reason: str = "stop") -> list[RequestOutput]:
    return [
        delta("H", [H], 1, logprobs=LOGPROBS[:1]),
        delta("", [E1], 2, logprobs=LOGPROBS[1:2]),  # held back: half a character
        delta("é", [E2], 3, logprobs=LOGPROBS[2:], finish_reason=finish_reason),
    ]


def test_completion_builder_whole_response_with_n_2() -> None:
    builder = CompletionBuilder("m", n=2)
    for d in he_deltas("stop"):
        builder.add(0, d)
    builder.add(1, delta("Hi", [H, 0x69], 2, num_cached_tokens=4))
    builder.add(1, delta("!", [0x21], 3, finish_reason="length", num_cached_tokens=4))
    assert builder.finished
    built = builder.build()
    parsed = openai.types.Completion.model_validate(built.model_dump())
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [
        (0, "Hé", "stop"),
        (1, "Hi!", "length"),
    ]
    assert parsed.choices[0].logprobs is None
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (5, 6)
    assert parsed.usage.total_tokens == 11
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0  # cached for every choice


def test_usage_counts_the_kv_moved_for_every_choice() -> None:
    builder = CompletionBuilder("m", n=2)
    for index, (cached, moved) in enumerate([(16, 4), (0, 20)]):
        builder.add(
            index,
            delta(
                "x",
                [0x78],
                1,
                finish_reason="length",
                num_prompt_tokens=20,
                num_cached_tokens=cached,
                num_transferred_tokens=moved,
            ),
        )
    parsed = openai.types.Completion.model_validate(builder.build().model_dump())
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    details = parsed.usage.prompt_tokens_details
    assert details.cached_tokens == 0
    assert (details.model_extra or {})["kv_transferred_tokens"] == 24


def test_completion_builder_logprobs() -> None:
    builder = CompletionBuilder("m", num_logprobs=1, tokens=TOKENS)
    for d in he_deltas():
        builder.add(0, d)
    logprobs = openai.types.Completion.model_validate(builder.build().model_dump()).choices[0]
    assert logprobs.logprobs is not None
    lp = logprobs.logprobs
    assert lp.tokens == ["H", "\ufffd", "\ufffd"]
    assert lp.token_logprobs == [-0.1, -1.5, -0.01]
    assert lp.text_offset == [0, 1, 2]
    # the sampled token plus the top-1, best first (OpenAI: up to logprobs + 1 entries)
    assert lp.top_logprobs is not None
    assert list(lp.top_logprobs[0].items()) == [("H", -0.1), ("I", -2.5), ("J", -3.0)]
    assert list(lp.top_logprobs[1].items()) == [("H", -0.5), ("\ufffd", -1.5), ("I", -2.0)]


def test_completion_stream_chunks_and_usage_chunk() -> None:
    builder = CompletionBuilder("m")
    chunks = [builder.add(0, d) for d in he_deltas()]
    assert chunks[1] is None  # nothing to send while half a character is held back
    sent = [c for c in chunks if c is not None]
    assert "".join(c.choices[0].text for c in sent) == "Hé"
    assert [c.choices[0].finish_reason for c in sent] == [None, "stop"]
    assert all(c.id == builder.id and c.usage is None for c in sent)
    openai.types.Completion.model_validate(sent[-1].model_dump())
    usage = openai.types.Completion.model_validate(builder.usage_chunk().model_dump())
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 3


def test_chat_builder_stream() -> None:
    builder = ChatBuilder("m", num_logprobs=2, tokens=TOKENS)
    chunks = [builder.add(0, d) for d in he_deltas("length")]
    assert all(c is not None for c in chunks)  # each token carries logprobs
    parsed = [
        openai.types.chat.ChatCompletionChunk.model_validate(c.model_dump()) for c in chunks if c
    ]
    assert parsed[0].id.startswith("chatcmpl-") and parsed[0].object == "chat.completion.chunk"
    assert parsed[0].choices[0].delta.role == "assistant"
    assert [p.choices[0].delta.role for p in parsed[1:]] == [None, None]
    assert "".join(p.choices[0].delta.content or "" for p in parsed) == "Hé"
    assert [p.choices[0].finish_reason for p in parsed] == [None, None, "length"]
    second = parsed[1].choices[0].logprobs
    assert second is not None and second.content is not None
    token = second.content[0]
    assert (token.token, token.logprob, token.bytes) == ("\ufffd", -1.5, [0xC3])
    assert [(t.token, t.logprob) for t in token.top_logprobs] == [("H", -0.5), ("\ufffd", -1.5)]
    usage = builder.usage_chunk()
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 8


def test_chat_builder_whole_response() -> None:
    builder = ChatBuilder("m", n=2, num_logprobs=0, tokens=TOKENS)
    for d in he_deltas():
        builder.add(0, d)
    builder.add(
        1, delta("Hi", [H, 0x69], 2, logprobs=[{H: -1.0}, {0x69: -2.0}], finish_reason="stop")
    )
    parsed = openai.types.chat.ChatCompletion.model_validate(builder.build().model_dump())
    assert parsed.object == "chat.completion"
    assert [(c.message.role, c.message.content) for c in parsed.choices] == [
        ("assistant", "Hé"),
        ("assistant", "Hi"),
    ]
    assert parsed.choices[0].logprobs is not None
    content = parsed.choices[0].logprobs.content
    assert content is not None
    assert [t.bytes for t in content] == [[H], [E1], [E2]]
    assert bytes(b for t in content for b in t.bytes or []).decode() == "Hé"
    assert all(t.top_logprobs == [] for t in content)
    assert parsed.usage is not None and parsed.usage.completion_tokens == 5


def test_chat_builder_without_logprobs_skips_empty_deltas() -> None:
    builder = ChatBuilder("m")
    chunks = [builder.add(0, d) for d in he_deltas()]
    assert chunks[1] is None
    assert chunks[0] is not None and chunks[0].choices[0].logprobs is None
    assert builder.build().choices[0].logprobs is None


def test_builder_misuse_is_an_internal_error() -> None:
    builder = ChatBuilder("m")
    builder.add(0, delta("a", [1], 1))
    with pytest.raises(RuntimeError):
        builder.build()
    builder.add(0, delta("", [2], 2, finish_reason="stop"))
    with pytest.raises(ValueError):
        builder.add(0, delta("", [3], 3))
    with pytest.raises(ValueError):
        ChatBuilder("m", num_logprobs=1)
    with pytest.raises(ValueError):
        ChatBuilder("m").add(0, delta("", [1], 1, finish_reason="prefilled"))


def test_sse_framing() -> None:
    builder = ChatBuilder("m", response_id="chatcmpl-1", created=123)
    first = builder.add(0, delta("Hi", [H, 0x69], 2))
    last = builder.add(0, delta("", [3], 3, finish_reason="stop"))
    assert first is not None and last is not None
    event = sse_event(first)
    assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n") == 2
    payload = json.loads(event.removeprefix("data: "))
    assert payload["id"] == "chatcmpl-1" and payload["created"] == 123
    assert payload["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert payload["choices"][0]["finish_reason"] is None
    final = json.loads(sse_event(last).removeprefix("data: "))
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "stop"
    assert sse_event({"error": {"message": "x"}}) == 'data: {"error":{"message":"x"}}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
