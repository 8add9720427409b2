"""OpenAI protocol models and error bodies (app/protocol.py, app/errors.py)."""

from __future__ import annotations

import json
import pickle
from typing import Any

import openai.types
import openai.types.chat
import pydantic
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app import errors
from app.handle import GenerateRequest
from app.protocol import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    choice_sampling_params,
    parse_json_object,
)
from app.responses import ModelCard, ModelList
from engine.request import InvalidRequestError, SamplingParams


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
    params = req.to_sampling_params()
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
        ({"prompt": [1, -2]}, "prompt.1"),
        ({"prompt": [1, "a"]}, "prompt.1"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"logit_bias": {"1": float("nan")}}, "logit_bias.1"),
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, "stop.0"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": ["a", "x" * 257]}, "stop.1"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"best_of": 0}, "best_of"),
        ({"user": "u" * 257}, "user"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    status, error = validation_error(completion, **fields)
    assert status == 400
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")


def test_limits_at_the_bounds_are_accepted() -> None:
    req = completion(
        stop=["a", "b", "c", "x" * 256],
        stop_token_ids=list(range(64)),
        seed=2**63 - 1,
        top_k=-1,
        user="u" * 256,
        best_of=1,
    )
    params = req.to_sampling_params()
    assert len(params.stop) == 4 and len(params.stop_token_ids) == 64
    assert completion(seed=-(2**63)).to_sampling_params().seed == -(2**63)


def test_missing_fields_are_named() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate({})
    _, body = errors.error_response(info.value)
    assert "model: Field required" in body["error"]["message"]
    assert "messages: Field required" in body["error"]["message"]


def test_bad_chat_role_message() -> None:
    status, error = validation_error(chat, messages=[{"role": "robot", "content": "x"}])
    assert status == 400
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
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content.0: content parts of type 'image_url' are not supported",
        ),
        ({"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        ({"messages": "hi"}, "messages: Input should be a valid list"),
    ],
)
def test_bad_chat_fields_are_400(fields: dict[str, Any], needle: str) -> None:
    status, error = validation_error(chat, **fields)
    assert status == 400
    assert needle in error["message"]
    assert error["param"] is not None and needle.startswith(error["param"])


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
    assert req.to_sampling_params() == SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS,
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
    assert chat().to_sampling_params().max_tokens == DEFAULT_MAX_TOKENS
    assert chat(max_tokens=5).to_sampling_params().max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params().max_tokens == 9
    assert chat().to_sampling_params().logprobs is None
    assert chat(logprobs=True).to_sampling_params().logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).to_sampling_params().logprobs == 4
    assert chat(stop=["a", "b"], top_k=5).to_sampling_params().stop == ("a", "b")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 20}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ],
)
def test_out_of_range_values_are_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        completion(**fields).to_sampling_params()
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
        (client.post("/v1/completions", json={"model": "m", "prompt": 3}), 400, None),
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


# ------------------------------------------------------------------------------ body parsing

DEEP = 100_000


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"", "Expecting value"),
        (b"hello", "Expecting value"),
        (b'{"model": "m", "prompt": ', "Expecting value"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'"hi"', "must be a JSON object, got str"),
        (b"null", "must be a JSON object, got NoneType"),
        (b"[" * DEEP + b"]" * DEEP, "nested too deeply"),
        (b'{"a":' * DEEP + b"1" + b"}" * DEEP, "nested too deeply"),
        (b'{"seed": 1' + b"0" * 5000 + b"}", "integer string conversion"),
        (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    ],
    ids=[
        "empty",
        "not-json",
        "truncated",
        "array",
        "string",
        "null",
        "deep-arrays",
        "deep-objects",
        "huge-int",
        "bad-utf8",
    ],
)
def test_malformed_bodies_are_400(raw: bytes, needle: str) -> None:
    with pytest.raises(errors.BadRequestError) as info:
        parse_json_object(raw)
    status, body = errors.error_response(info.value)
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("malformed JSON: ")
    assert needle in body["error"]["message"]


def test_well_formed_body_parses() -> None:
    assert parse_json_object(b'{"model": "m", "n": 2, "stop": ["\\u00e9"]}') == {
        "model": "m",
        "n": 2,
        "stop": ["é"],
    }


# ----------------------------------------------------------------------------- handle API


def test_generate_request_maps_min_tokens_and_validates() -> None:
    req = GenerateRequest(prompt="hi", max_tokens=8, min_tokens=3, stop_token_ids=[5])
    assert req.to_sampling_params() == SamplingParams(
        max_tokens=8, min_tokens=3, stop_token_ids=(5,)
    )
    for fields in (
        {"temperature": float("nan")},
        {"repetition_penalty": float("inf")},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": list(range(65))},
        {"stop": ["a"] * 5},
        {"stop": ["x" * 257]},
        {"min_tokens": -1},
        {"seed": 2**64},
        {"prompt_token_ids": [1, -1], "prompt": None},
    ):
        with pytest.raises(pydantic.ValidationError):
            GenerateRequest.model_validate({"prompt": "hi", **fields})
    with pytest.raises(InvalidRequestError, match="^min_tokens"):
        GenerateRequest(prompt="hi", max_tokens=2, min_tokens=3).to_sampling_params()


def test_handle_and_openai_map_the_same_fields_to_the_same_params() -> None:
    """One mapping: every sampling field the handle API shares with the OpenAI body reaches
    the engine's params the same way."""
    shared: dict[str, Any] = {
        "max_tokens": 9,
        "min_tokens": 2,
        "temperature": 0.3,
        "top_p": 0.8,
        "top_k": 5,
        "min_p": 0.05,
        "seed": 11,
        "stop": ["END"],
        "stop_token_ids": [4],
        "presence_penalty": 0.25,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "logprobs": 2,
    }
    from_handle = GenerateRequest.model_validate({"prompt": "hi", **shared}).to_sampling_params()
    from_openai = completion(**shared).to_sampling_params()
    assert from_handle == from_openai
    assert from_handle.min_tokens == 2 and from_handle.top_k == 5 and from_handle.logprobs == 2


# ------------------------------------------------------------------------ errors over Ray


@pytest.mark.parametrize(
    "exc",
    [
        errors.BadRequestError("bad", param="stop_token_ids"),
        errors.ModelNotFoundError("gpt-9"),
        errors.AuthenticationError(),
        errors.RateLimitError("slow", retry_after_s=2),
        errors.ReplicaLostError(),
    ],
)
def test_api_errors_survive_pickling(exc: errors.APIError) -> None:
    """Handle-API callers get the error through Ray: class, message, param, code intact."""
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is type(exc)
    assert copy.to_body() == exc.to_body()
    assert copy.headers == exc.headers
    assert str(copy) == str(exc)


def test_replica_lost_is_a_clear_503() -> None:
    status, body = errors.error_response(errors.ReplicaLostError())
    assert status == 503
    assert body["error"] == {
        "message": "the replica serving this request was lost; retry the request",
        "type": "service_unavailable_error",
        "param": None,
        "code": "replica_lost",
    }


def test_invalid_request_error_names_its_field() -> None:
    exc = errors.bad_request(InvalidRequestError("stop_token_ids must be >= 0"))
    assert (exc.status_code, exc.param) == (400, "stop_token_ids")
    assert errors.bad_request(InvalidRequestError("something else")).param is None
