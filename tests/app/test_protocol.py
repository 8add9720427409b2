"""OpenAI protocol models, response builders and error bodies (app/protocol.py, app/errors.py)."""

from __future__ import annotations

import json
from typing import Any

import openai.types
import openai.types.chat
import pydantic
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from app import errors
from app.protocol import (
    SSE_DONE,
    ChatBuilder,
    ChatCompletionRequest,
    CompletionBuilder,
    CompletionRequest,
    ModelCard,
    ModelList,
    TokenStrings,
    _byte_level_chars,
    choice_sampling_params,
    sse_event,
)
from engine.outputs import RequestOutput
from engine.request import InvalidRequestError, SamplingParams


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


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


def validation_error(make: Any, **fields: Any) -> tuple[int, dict[str, Any]]:
    with pytest.raises(pydantic.ValidationError) as info:
        make(**fields)
    status, body = errors.error_response(info.value)
    return status, dict(body["error"])


# ---------------------------------------------------------------------------------- requests


def test_completion_defaults_and_unknown_fields_ignored() -> None:
    req = completion(some_new_openai_field={"x": 1})
    assert (req.prompt, req.max_tokens, req.temperature, req.n, req.stream) == (
        "hi",
        16,
        1.0,
        1,
        False,
    )
    assert not req.include_usage
    params = req.to_sampling_params(default_max_tokens=100)
    assert params == SamplingParams(max_tokens=16)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", "hi"), (["hi"], "hi"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    assert completion(prompt=prompt).prompt == expected


def test_batched_prompts_are_a_400() -> None:
    with pytest.raises(errors.UnsupportedFeatureError) as info:
        completion(prompt=["a", "b"])
    status, body = errors.error_response(info.value)
    assert status == 400
    assert body["error"]["param"] == "prompt"
    assert "batched prompts" in body["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"logit_bias": {"1": 5.0}}, "logit_bias"),
    ],
)
def test_unsupported_completion_features_are_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(errors.UnsupportedFeatureError) as info:
        completion(**fields)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert info.value.code == "unsupported_feature"


def test_unsupported_chat_features_are_400() -> None:
    with pytest.raises(errors.UnsupportedFeatureError):
        chat(tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(errors.UnsupportedFeatureError) as info:
        chat(response_format={"type": "json_object"})
    assert info.value.param == "response_format"
    assert chat(tools=[], response_format={"type": "text"}).tools == []


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 9}, "n"),
        ({"n": 0}, "n"),
        ({"logprobs": 6}, "logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ],
)
def test_bad_completion_fields_are_422_naming_the_field(fields: dict[str, Any], param: str) -> None:
    status, error = validation_error(completion, **fields)
    assert status == 422
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param)
    assert error["message"].startswith(param)


def test_missing_fields_are_named() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate({})
    _, body = errors.error_response(info.value)
    assert "model: Field required" in body["error"]["message"]
    assert "messages: Field required" in body["error"]["message"]


def test_bad_chat_role_message() -> None:
    status, error = validation_error(chat, messages=[{"role": "robot", "content": "x"}])
    assert status == 422
    assert error["message"] == "messages.0.role: Input should be 'system', 'user' or 'assistant'"
    assert error["param"] == "messages.0.role"
    _, error = validation_error(chat, messages=[{"role": "user", "content": 3}])
    assert error["param"] == "messages.0.content"  # union member tags are not part of param


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs: requires logprobs to be true"),
        ({"logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0"),
    ],
)
def test_bad_chat_fields_are_422(fields: dict[str, Any], needle: str) -> None:
    status, error = validation_error(chat, **fields)
    assert status == 422
    assert needle in error["message"]


def test_json_parsing_is_strict_too() -> None:
    body = '{"model": "m", "prompt": [1, 2], "temperature": 0, "extra": null}'
    assert CompletionRequest.model_validate_json(body).prompt == [1, 2]
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "n": "2"}')


def test_completion_to_sampling_params_maps_every_field() -> None:
    req = completion(
        max_tokens=None,
        temperature=0.5,
        top_p=0.9,
        stop="\n",
        seed=7,
        logprobs=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        top_k=-1,
        min_p=0.1,
        repetition_penalty=1.2,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[5, 6],
    )
    assert req.to_sampling_params(default_max_tokens=50) == SamplingParams(
        max_tokens=50,
        temperature=0.5,
        top_k=0,
        top_p=0.9,
        min_p=0.1,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        stop=("\n",),
        stop_token_ids=(5, 6),
        ignore_eos=True,
        logprobs=3,
        min_tokens=2,
    )


def test_chat_to_sampling_params() -> None:
    assert chat().to_sampling_params(default_max_tokens=77).max_tokens == 77
    assert chat(max_tokens=5).to_sampling_params(77).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params(77).max_tokens == 9
    assert chat().to_sampling_params(77).logprobs is None
    assert chat(logprobs=True).to_sampling_params(77).logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).to_sampling_params(77).logprobs == 4
    assert chat(stop=["a", "b"], top_k=5).to_sampling_params(77).stop == ("a", "b")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 20}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_out_of_range_values_are_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        completion(**fields).to_sampling_params(default_max_tokens=16)
    status, body = errors.error_response(info.value)
    assert status == 400
    assert body["error"]["param"] == param
    assert param in body["error"]["message"]


def test_chat_messages_for_the_template() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}],
        stream=True,
        stream_options={"include_usage": True},
    )
    assert req.chat_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]
    assert req.include_usage


def test_choice_sampling_params_gives_seeded_choices_distinct_seeds() -> None:
    params = SamplingParams(seed=10)
    assert [choice_sampling_params(params, i).seed for i in range(3)] == [10, 11, 12]
    assert choice_sampling_params(SamplingParams(), 2).seed is None


# ---------------------------------------------------------------------------------- builders


def delta(
    text: str,
    token_ids: list[int],
    num_output_tokens: int,
    *,
    logprobs: list[dict[int, float]] | None = None,
    finish_reason: str | None = None,
    num_prompt_tokens: int = 5,
    num_cached_tokens: int = 0,
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


def test_model_list() -> None:
    models_ = ModelList(data=[ModelCard(id="tiny", created=1)]).model_dump()
    assert models_["object"] == "list"
    card = openai.types.Model.model_validate(models_["data"][0])
    assert (card.id, card.object, card.owned_by) == ("tiny", "model", "pdserve")


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("exc", "status", "error_type", "code"),
    [
        (errors.BadRequestError("bad", param="x"), 400, "invalid_request_error", None),
        (errors.UnsupportedFeatureError("no"), 400, "invalid_request_error", "unsupported_feature"),
        (
            errors.ContextLengthExceededError("long", param="messages"),
            400,
            "invalid_request_error",
            "context_length_exceeded",
        ),
        (errors.AuthenticationError(), 401, "authentication_error", "invalid_api_key"),
        (errors.PermissionDeniedError("pool"), 403, "permission_error", "permission_denied"),
        (errors.ModelNotFoundError("gpt-9"), 404, "invalid_request_error", "model_not_found"),
        (errors.PayloadTooLargeError("big"), 413, "invalid_request_error", "payload_too_large"),
        (errors.RateLimitError("slow down"), 429, "rate_limit_error", "rate_limit_exceeded"),
        (
            errors.ServiceUnavailableError("warming up", code="not_ready"),
            503,
            "service_unavailable_error",
            "not_ready",
        ),
        (errors.InternalServerError("oops"), 500, "server_error", "internal_error"),
        (json.JSONDecodeError("Expecting value", "{", 1), 400, "invalid_request_error", None),
        (InvalidRequestError("top_p must be in (0, 1]"), 400, "invalid_request_error", None),
        (KeyError("secret internals"), 500, "server_error", "internal_error"),
    ],
)
def test_error_bodies(exc: BaseException, status: int, error_type: str, code: str | None) -> None:
    got_status, body = errors.error_response(exc)
    assert got_status == status
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == (error_type, code)
    assert body["error"]["message"]
    assert "secret" not in body["error"]["message"]


def test_error_details() -> None:
    _, body = errors.error_response(errors.ModelNotFoundError("gpt-9"))
    assert body["error"]["param"] == "model" and "`gpt-9`" in body["error"]["message"]
    _, body = errors.error_response(json.JSONDecodeError("Expecting value", "{", 1))
    assert body["error"]["message"].startswith("malformed JSON: Expecting value")
    assert errors.RateLimitError("x", retry_after_s=1.2).headers == {"Retry-After": "2"}
    assert errors.ServiceUnavailableError("x").headers == {}


def test_installed_handlers_shape_every_error() -> None:
    app = FastAPI()
    errors.install_error_handlers(app)

    @app.post("/v1/completions")
    def complete(request: CompletionRequest) -> dict[str, str]:
        return {"prompt": str(request.prompt)}

    @app.get("/quota")
    def quota() -> None:
        raise errors.RateLimitError("over quota", retry_after_s=3)

    @app.get("/crash")
    def crash() -> None:
        raise RuntimeError("secret internals")

    client = TestClient(app, raise_server_exceptions=False)
    cases = [
        (client.post("/v1/completions", json={"model": "m", "prompt": "x"}), 200, None),
        (client.post("/v1/completions", json={"model": "m", "prompt": 3}), 422, None),
        (
            client.post("/v1/completions", json={"model": "m", "prompt": "x", "echo": True}),
            400,
            None,
        ),
        (client.post("/v1/completions", content=b"{oops", headers=JSON), 400, "malformed JSON"),
        (client.get("/v1/nope"), 404, "Not Found"),
        (client.get("/v1/completions"), 405, "Method Not Allowed"),
        (client.get("/quota"), 429, "over quota"),
        (client.get("/crash"), 500, "internal server error"),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        if status == 200:
            continue
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert message is None or error["message"].startswith(message)
    assert cases[1][0].json()["error"]["param"].startswith("prompt")
    assert cases[6][0].headers["retry-after"] == "3"


JSON = {"content-type": "application/json"}
