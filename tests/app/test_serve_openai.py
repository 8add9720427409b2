"""The OpenAI API end to end: real Ray Serve, real HTTP, the official `openai` client.

The default disaggregated app (one prefill pool, one decode pool, KV over shared memory) with
`local_prefill_threshold: 0`, so every prompt is prefilled remotely. Greedy outputs must equal
`transformers` on the same checkpoint; after every test both pools' KV blocks are free again
(conftest's autouse check).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

if TYPE_CHECKING:  # conftest is pytest's to import; its types are only needed for hints
    from tests.app.conftest import HFGreedy, Reference, Server

pytestmark = pytest.mark.slow

SERVED_MODEL = "pdserve-tiny"  # "pdserve-" + the model directory's name (conftest's model_dir)

MAX_PROMPT_TOKENS = 512
MAX_OUTPUT_TOKENS = 4000
MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings
MAX_BODY_BYTES = 64 * 1024
# A disconnected request must be aborted (its blocks freed) well before it could finish:
# within half the time its remaining tokens take at the decode rate measured just before
# (`_abort_bound`; a loaded machine decodes and aborts slower alike), and at least this.
MIN_ABORT_TIMEOUT_S = 4.0

# The last one makes greedy decoding stop on EOS after 13 tokens.
PROMPTS = ["hello there", "The quick brown fox jumps over the lazy dog; " * 4, "prompt number 2"]
MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ],
]
MAX_TOKENS = 24


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1, "kv_cache_bytes": 32 * 1024**2},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": 0,
        "limits": {
            "max_prompt_tokens": MAX_PROMPT_TOKENS,
            "max_output_tokens": MAX_OUTPUT_TOKENS,
            "max_body_bytes": MAX_BODY_BYTES,
        },
    }


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai()


def _finish_reason(ref: Reference, max_tokens: int) -> str:
    return "length" if len(ref.output_ids) == max_tokens else "stop"


# ---- completions -------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_transformers(client: openai.OpenAI, hf: HFGreedy, prompt: str) -> None:
    ref = hf.complete(prompt, MAX_TOKENS)
    raw = client.completions.with_raw_response.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    completion = raw.parse()
    assert "-> pool prefill, decode pool decode" in raw.headers["x-pdserve-route"]
    assert completion.model == SERVED_MODEL
    (choice,) = completion.choices
    assert choice.text == ref.text
    assert choice.finish_reason == _finish_reason(ref, MAX_TOKENS)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(ref.prompt_ids)
    assert completion.usage.completion_tokens == len(ref.output_ids)
    assert completion.usage.total_tokens == len(ref.prompt_ids) + len(ref.output_ids)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_stream_matches_transformers(
    client: openai.OpenAI, hf: HFGreedy, prompt: str
) -> None:
    ref = hf.complete(prompt, MAX_TOKENS)
    chunks = list(
        client.completions.create(
            model=SERVED_MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, usage_chunk = chunks
    assert len(content) > 1, "the completion was not streamed"
    assert all(len(chunk.choices) == 1 and chunk.usage is None for chunk in content)
    assert "".join(chunk.choices[0].text for chunk in content) == ref.text
    assert [c.choices[0].finish_reason for c in content[-1:]] == [_finish_reason(ref, MAX_TOKENS)]
    assert all(chunk.choices[0].finish_reason is None for chunk in content[:-1])
    assert len({chunk.id for chunk in chunks}) == 1
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == len(ref.prompt_ids)
    assert usage_chunk.usage.completion_tokens == len(ref.output_ids)


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=SERVED_MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=True
        )
    )
    assert chunks and all(chunk.choices and chunk.usage is None for chunk in chunks)


def test_n_choices(client: openai.OpenAI, hf: HFGreedy) -> None:
    ref = hf.complete(PROMPTS[0], MAX_TOKENS)
    completion = client.completions.create(
        model=SERVED_MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, n=2
    )
    assert sorted(choice.index for choice in completion.choices) == [0, 1]
    assert [choice.text for choice in completion.choices] == [ref.text, ref.text]
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(ref.prompt_ids)  # the prompt counts once
    assert completion.usage.completion_tokens == 2 * len(ref.output_ids)


def test_n_choices_stream(client: openai.OpenAI, hf: HFGreedy) -> None:
    ref = hf.complete(PROMPTS[2], MAX_TOKENS)  # stops on EOS
    texts = ["", ""]
    finish: list[str | None] = [None, None]
    for chunk in client.completions.create(
        model=SERVED_MODEL,
        prompt=PROMPTS[2],
        max_tokens=MAX_TOKENS,
        temperature=0,
        n=2,
        stream=True,
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [ref.text, ref.text]
    assert finish == [_finish_reason(ref, MAX_TOKENS)] * 2


def test_completion_logprobs(client: openai.OpenAI, hf: HFGreedy) -> None:
    ref = hf.complete(PROMPTS[1], MAX_TOKENS)
    completion = client.completions.create(
        model=SERVED_MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-3)
    assert logprobs.tokens is not None and len(logprobs.tokens) == len(ref.output_ids)
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert logprobs.text_offset[0] == 0
    for token, chosen, top in zip(
        logprobs.tokens, ref.logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 3  # the sampled token plus up to 2 alternatives
        assert max(top.values()) == pytest.approx(chosen, abs=1e-3)  # greedy took the best
        assert top[token] == pytest.approx(chosen, abs=1e-3)


def _stop_string(text: str, length: int) -> str:
    """The first `length` characters of `text`, from its 4th on, with no U+FFFD among them."""
    return next(
        text[i : i + length]
        for i in range(3, len(text) - length)
        if "\ufffd" not in text[i : i + length]
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("prompt", "length"), [(0, 1), (0, 2), (1, 1), (1, 3)])
def test_stop_strings(
    client: openai.OpenAI, hf: HFGreedy, prompt: int, length: int, stream: bool
) -> None:
    ref = hf.complete(PROMPTS[prompt], MAX_TOKENS)
    stop = _stop_string(ref.text, length)
    expected = ref.text[: ref.text.index(stop)]
    kwargs: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": PROMPTS[prompt],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stop": ["never-appears", stop],
    }
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(chunk.choices[0].text for chunk in chunks)
        finish_reason = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, finish_reason = choice.text, choice.finish_reason
    assert text == expected
    assert finish_reason == "stop"


def test_chat_stop_string(client: openai.OpenAI, hf: HFGreedy) -> None:
    ref = hf.chat(MESSAGES[1], MAX_TOKENS)
    stop = _stop_string(ref.text, 2)
    chat = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=MESSAGES[1],  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=stop,
    )
    assert chat.choices[0].message.content == ref.text[: ref.text.index(stop)]
    assert chat.choices[0].finish_reason == "stop"


def test_default_max_tokens_is_16(client: openai.OpenAI, hf: HFGreedy) -> None:
    ref = hf.complete(PROMPTS[0], 16)
    completion = client.completions.create(model=SERVED_MODEL, prompt=PROMPTS[0], temperature=0)
    assert completion.choices[0].text == ref.text
    assert completion.usage is not None and completion.usage.completion_tokens == 16


def test_concurrent_requests_match_transformers(client: openai.OpenAI, hf: HFGreedy) -> None:
    """Requests batched together on both pools each get their own greedy text."""
    prompts = [f"concurrent request {i}: " + "abc" * i for i in range(6)]
    refs = [hf.complete(prompt, MAX_TOKENS) for prompt in prompts]

    def complete(prompt: str) -> str:
        completion = client.completions.create(
            model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return completion.choices[0].text

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        texts = list(pool.map(complete, prompts))
    assert texts == [ref.text for ref in refs]


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        completion = client.completions.create(
            model=SERVED_MODEL,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=1234,
            n=2,
        )
        return [choice.text for choice in completion.choices]

    first = sample()
    assert sample() == first
    assert first[0] != first[1]  # each choice has its own seed


CACHED_PROMPT = "A prompt repeated to hit the prefix cache of the prefill pool. " * 3


def test_repeated_prompt_hits_prefill_cache(
    server: Server, client: openai.OpenAI, hf: HFGreedy
) -> None:
    ref = hf.complete(CACHED_PROMPT, MAX_TOKENS)
    before = server.stats()["pools"]["decode"]["counters"].get("remote_cached_tokens", 0)
    for _ in range(2):
        completion = client.completions.create(
            model=SERVED_MODEL, prompt=CACHED_PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        assert completion.choices[0].text == ref.text  # KV reused from the cache is right
    cached = server.stats()["pools"]["decode"]["counters"]["remote_cached_tokens"] - before
    assert 0 < cached < len(ref.prompt_ids)


def test_usage_reports_remotely_cached_tokens(client: openai.OpenAI, hf: HFGreedy) -> None:
    ref = hf.complete(CACHED_PROMPT, MAX_TOKENS)
    for _ in range(2):
        completion = client.completions.create(
            model=SERVED_MODEL, prompt=CACHED_PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached < len(ref.prompt_ids)


def test_prompt_token_ids(client: openai.OpenAI, hf: HFGreedy) -> None:
    ref = hf.complete(PROMPTS[0], MAX_TOKENS)
    completion = client.completions.create(
        model=SERVED_MODEL, prompt=ref.prompt_ids, max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.choices[0].text == ref.text


# ---- chat --------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_matches_transformers(
    client: openai.OpenAI, hf: HFGreedy, messages: list[dict[str, str]]
) -> None:
    ref = hf.chat(messages, MAX_TOKENS)
    chat = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    (choice,) = chat.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == _finish_reason(ref, MAX_TOKENS)
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(ref.prompt_ids)
    assert chat.usage.completion_tokens == len(ref.output_ids)


@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_stream_matches_transformers(
    client: openai.OpenAI, hf: HFGreedy, messages: list[dict[str, str]]
) -> None:
    ref = hf.chat(messages, MAX_TOKENS)
    chunks = list(
        client.chat.completions.create(
            model=SERVED_MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, usage_chunk = chunks
    assert len(content) > 1
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == ref.text
    assert content[-1].choices[0].finish_reason == _finish_reason(ref, MAX_TOKENS)
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == len(ref.prompt_ids)
    assert usage_chunk.usage.completion_tokens == len(ref.output_ids)


def test_chat_logprobs(client: openai.OpenAI, hf: HFGreedy) -> None:
    ref = hf.chat(MESSAGES[1], MAX_TOKENS)
    chat = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=MESSAGES[1],  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [entry.logprob for entry in logprobs.content] == pytest.approx(ref.logprobs, abs=1e-3)
    for entry in logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-3)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    # Token ids 0..255 of the built-in byte-level vocabulary are the bytes themselves.
    byte_ids = [token for token in ref.output_ids if token < 256]
    assert [b for entry in logprobs.content for b in entry.bytes or []] == byte_ids


def test_chat_n_choices(client: openai.OpenAI, hf: HFGreedy) -> None:
    ref = hf.chat(MESSAGES[0], MAX_TOKENS)
    chat = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=MESSAGES[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        n=2,  # type: ignore[arg-type]
    )
    assert [choice.message.content for choice in chat.choices] == [ref.text, ref.text]
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 2 * len(ref.output_ids)


# ---- bad input ---------------------------------------------------------------------------

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_COMPLETION = {"model": SERVED_MODEL, "prompt": "hi", "max_tokens": 4}
OK_CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (id, path, body: dict = JSON, bytes = sent raw, status, error code or None, words in message)
BAD_REQUESTS: list[tuple[str, str, dict[str, Any] | bytes, int, str | None, tuple[str, ...]]] = [
    ("malformed-json", COMPLETIONS, b'{"model": "pdserve-tiny", "prompt": ', 400, None, ("json",)),
    ("json-not-object", COMPLETIONS, b"[1, 2]", 400, None, ("json",)),
    ("chat-malformed-json", CHAT, b"{'model': 1}", 400, None, ("json",)),
    ("missing-model", COMPLETIONS, {"prompt": "hi"}, 400, None, ("model",)),
    ("missing-prompt", COMPLETIONS, {"model": SERVED_MODEL}, 400, None, ("prompt",)),
    ("missing-messages", CHAT, {"model": SERVED_MODEL}, 400, None, ("messages",)),
    (
        "max-tokens-str",
        COMPLETIONS,
        {**OK_COMPLETION, "max_tokens": "x"},
        400,
        None,
        ("max_tokens",),
    ),
    (
        "temperature-str",
        COMPLETIONS,
        {**OK_COMPLETION, "temperature": "hot"},
        400,
        None,
        ("temperature",),
    ),
    ("messages-str", CHAT, {**OK_CHAT, "messages": "hi"}, 400, None, ("messages",)),
    (
        "bad-role",
        CHAT,
        {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        None,
        ("role",),
    ),
    ("n-zero", COMPLETIONS, {**OK_COMPLETION, "n": 0}, 400, None, ("n",)),
    (
        "prompt-too-long",
        COMPLETIONS,
        {**OK_COMPLETION, "prompt": "a" * (MAX_PROMPT_TOKENS + 50)},
        400,
        "context_length_exceeded",
        (str(MAX_PROMPT_TOKENS),),
    ),
    (
        "chat-prompt-too-long",
        CHAT,
        {**OK_CHAT, "messages": [{"role": "user", "content": "a" * (MAX_PROMPT_TOKENS + 50)}]},
        400,
        "context_length_exceeded",
        (str(MAX_PROMPT_TOKENS),),
    ),
    (
        "body-too-large",
        COMPLETIONS,
        {**OK_COMPLETION, "prompt": "a" * MAX_BODY_BYTES},
        413,
        "payload_too_large",
        ("bytes", str(MAX_BODY_BYTES)),
    ),
    (
        "max-tokens-past-context",
        COMPLETIONS,
        {**OK_COMPLETION, "prompt": "a" * 200, "max_tokens": MAX_MODEL_LEN - 100},
        400,
        None,
        ("max_tokens", str(MAX_MODEL_LEN)),
    ),
    (
        "max-tokens-over-limit",
        COMPLETIONS,
        {**OK_COMPLETION, "max_tokens": MAX_OUTPUT_TOKENS + 1},
        400,
        None,
        ("max_tokens", str(MAX_OUTPUT_TOKENS)),
    ),
    (
        "max-tokens-zero",
        COMPLETIONS,
        {**OK_COMPLETION, "max_tokens": 0},
        400,
        None,
        ("max_tokens",),
    ),
    (
        "unknown-model",
        COMPLETIONS,
        {**OK_COMPLETION, "model": "gpt-nope"},
        404,
        "model_not_found",
        ("gpt-nope",),
    ),
    (
        "chat-unknown-model",
        CHAT,
        {**OK_CHAT, "model": "gpt-nope"},
        404,
        "model_not_found",
        ("gpt-nope",),
    ),
    (
        "negative-temperature",
        COMPLETIONS,
        {**OK_COMPLETION, "temperature": -0.5},
        400,
        None,
        ("temperature",),
    ),
    ("top-p-zero", COMPLETIONS, {**OK_COMPLETION, "top_p": 0.0}, 400, None, ("top_p",)),
    ("chat-top-p-zero", CHAT, {**OK_CHAT, "top_p": 0.0}, 400, None, ("top_p",)),
    (
        "token-id-out-of-vocab",
        COMPLETIONS,
        {**OK_COMPLETION, "prompt": [1, 2, 10**6]},
        400,
        None,
        ("prompt",),
    ),
    (
        "echo-unsupported",
        COMPLETIONS,
        {**OK_COMPLETION, "echo": True},
        400,
        "unsupported_feature",
        ("echo",),
    ),
    (
        "batched-prompts",
        COMPLETIONS,
        {**OK_COMPLETION, "prompt": ["a", "b"]},
        400,
        "unsupported_feature",
        ("batch",),
    ),
]


def _send(http: httpx.Client, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def _assert_error(
    response: httpx.Response, status: int, code: str | None, words: tuple[str, ...]
) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["type"] in {"invalid_request_error", "not_found_error"}
    if code is not None:
        assert error["code"] == code
    for word in words:
        assert word.lower() in error["message"].lower(), error


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_request(
    server: Server,
    path: str,
    body: dict[str, Any] | bytes,
    status: int,
    code: str | None,
    words: tuple[str, ...],
) -> None:
    _assert_error(_send(server.http, path, body), status, code, words)


def test_prompt_over_model_context_is_context_length_exceeded(server: Server) -> None:
    # A prompt longer than the model's whole context is, first of all, too long a prompt.
    body = {**OK_COMPLETION, "prompt": "a" * (MAX_MODEL_LEN + 10)}
    _assert_error(_send(server.http, COMPLETIONS, body), 400, "context_length_exceeded", ())


def test_declared_content_length_over_limit_is_413(server: Server) -> None:
    # Refused from the Content-Length header alone, before the body is read.
    big = b"{" + b" " * MAX_BODY_BYTES + b"}"
    response = server.http.post(
        COMPLETIONS, content=big, headers={"content-type": "application/json"}
    )
    _assert_error(response, 413, "payload_too_large", ("bytes",))


@pytest.mark.parametrize("path", ["/v1/nope", "/nope", "/v1/completions/extra"])
def test_unknown_route_is_json_404(server: Server, path: str) -> None:
    response = server.http.get(path)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "not_found_error" and error["message"]


def test_wrong_method_is_json_405(server: Server) -> None:
    response = server.http.get(COMPLETIONS)
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-nope", prompt="hi", max_tokens=4)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(
            model=SERVED_MODEL, prompt="a" * (MAX_PROMPT_TOKENS + 1), max_tokens=4
        )
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as bad_type:
        client.completions.create(model=SERVED_MODEL, prompt="hi", max_tokens="x")  # type: ignore[arg-type]
    assert bad_type.value.param == "max_tokens"


def test_still_serving_after_bad_requests(client: openai.OpenAI, hf: HFGreedy) -> None:
    """Runs after the whole bad-input matrix (pytest keeps file order)."""
    ref = hf.complete(PROMPTS[0], MAX_TOKENS)
    completion = client.completions.create(
        model=SERVED_MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.choices[0].text == ref.text


# ---- disconnects, health, models ---------------------------------------------------------


def _abort_bound(client: openai.OpenAI, num_tokens: int) -> float:
    """Half the seconds `num_tokens` take at the decode rate a short stream measures now."""
    stream = client.completions.create(
        model=SERVED_MODEL,
        prompt=PROMPTS[0],
        max_tokens=64,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    arrivals = [time.monotonic() for chunk in stream if chunk.choices and chunk.choices[0].text]
    rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    return max(MIN_ABORT_TIMEOUT_S, 0.5 * num_tokens / rate)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_client_disconnect_frees_both_pools(
    server: Server, client: openai.OpenAI, endpoint: str
) -> None:
    # Thousands of tokens would take far longer than the idle check allows: only an abort
    # of the request on disconnect frees the blocks in time.
    common: dict[str, Any] = {
        "model": SERVED_MODEL,
        "max_tokens": MAX_OUTPUT_TOKENS - 100,
        "temperature": 0,
        "stream": True,
        "extra_body": {"ignore_eos": True},
    }
    if endpoint == "completions":
        stream: Any = client.completions.create(prompt=PROMPTS[1], **common)
    else:
        stream = client.chat.completions.create(messages=MESSAGES[1], **common)  # type: ignore[arg-type]
    bound_s = _abort_bound(client, MAX_OUTPUT_TOKENS - 100 - 3)
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            break
    assert server.busy_pools(), "the request should still hold decode KV blocks"
    stream.close()
    server.wait_pools_idle(timeout_s=bound_s)
    decode = server.stats()["pools"]["decode"]
    assert decode["num_running"] == 0 and decode["num_waiting"] == 0


def test_non_streaming_client_disconnect_frees_both_pools(server: Server) -> None:
    body = {
        **OK_COMPLETION,
        "prompt": PROMPTS[1],
        "max_tokens": MAX_OUTPUT_TOKENS - 100,
        "ignore_eos": True,
    }
    bound_s = _abort_bound(server.openai(), MAX_OUTPUT_TOKENS - 100)
    # The client gives up (and drops the connection) long before generation could end.
    with pytest.raises(httpx.ReadTimeout):
        server.http.post(COMPLETIONS, json=body, timeout=httpx.Timeout(30, read=1.0))
    server.wait_pools_idle(timeout_s=bound_s)
    decode = server.stats()["pools"]["decode"]
    assert decode["num_running"] == 0 and decode["num_waiting"] == 0


def test_health_says_only_ready(server: Server) -> None:
    response = server.http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}  # no pool, host or pid details


def test_readiness_reads_what_serve_status_says(server: Server) -> None:
    from ray import serve

    from app.serve.readiness import pool_replicas, replica_states

    pools = ("prefill", "decode", "ingress")
    light = pool_replicas(replica_states(), "pdserve", pools)
    assert light == pool_replicas(serve.status(), "pdserve", pools)
    assert light == {"prefill": 1, "decode": 1, "ingress": 1}


def test_models_lists_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == [SERVED_MODEL]
    assert models.data[0].object == "model"


def test_stats_reports_pools_and_routing(server: Server) -> None:
    stats = server.stats()
    assert set(stats["pools"]) == {"prefill", "decode"}
    assert stats["routing"]["counts"].get("|prefill|decode", 0) > 0
    assert all(not decision["local_prefill"] for decision in stats["routing"]["recent"])
    assert stats["pools"]["prefill"]["counters"]["requests"] > 0
    assert stats["pools"]["decode"]["counters"]["remote_prefill"] > 0
    assert "local_prefill" not in stats["pools"]["decode"]["counters"]


# ---- Python handle API -------------------------------------------------------------------


def test_handle_api_from_another_application(server: Server, hf: HFGreedy) -> None:
    from ray import serve

    from app.handle import GenerateRequest

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Caller:
        """Another Serve application that calls pdserve through its app handle."""

        async def __call__(self, prompt: str, max_tokens: int) -> dict[str, Any]:
            handle = serve.get_app_handle("pdserve").options(stream=True)
            request = GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0)
            chunks = [chunk async for chunk in handle.generate.remote(request)]
            return {
                "text": "".join(chunk.text for chunk in chunks),
                "token_ids": [t for chunk in chunks for t in chunk.token_ids],
                "finished": [chunk.finished for chunk in chunks],
                "num_prompt_tokens": chunks[-1].num_prompt_tokens,
                "route": chunks[-1].route,
            }

    ref = hf.complete(PROMPTS[1], MAX_TOKENS)
    caller = serve.run(Caller.bind(), name="caller", route_prefix="/caller")
    try:
        result = caller.remote(PROMPTS[1], MAX_TOKENS).result(timeout_s=120)
    finally:
        serve.delete("caller")
    assert result["text"] == ref.text
    assert result["token_ids"] == ref.output_ids
    assert result["finished"][-1] and not any(result["finished"][:-1])
    assert result["num_prompt_tokens"] == len(ref.prompt_ids)
    assert "pool prefill" in result["route"]


def test_handle_generate_finds_the_app_by_its_ingress(server: Server, hf: HFGreedy) -> None:
    """`app.handle.generate` without an app name, from this driver: the app is found from the
    controller's details (`find_app_name`) and the stream is `transformers`' greedy answer."""
    import asyncio

    from app.handle import GenerateRequest, generate
    from app.serve.apps import find_app_name

    assert find_app_name() == "pdserve"

    async def stream() -> list[Any]:
        request = GenerateRequest(prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        return [chunk async for chunk in generate(request)]

    chunks = asyncio.run(stream())
    ref = hf.complete(PROMPTS[0], MAX_TOKENS)
    assert [t for chunk in chunks for t in chunk.token_ids] == ref.output_ids
    assert chunks[-1].finished and not any(chunk.finished for chunk in chunks[:-1])


def _serve_process_environs() -> dict[str, list[dict[str, str]]]:
    """The environment of each live Serve process on this machine, by kind (its title)."""
    kinds = ("ray::ServeController", "ray::ProxyActor", "ray::ServeReplica:pdserve:")
    found: dict[str, list[dict[str, str]]] = {kind: [] for kind in kinds}
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            raw = (proc / "environ").read_bytes()
        except OSError:  # not a process, or gone meanwhile
            continue
        kind = next((k for k in kinds if title.startswith(k)), None)
        if kind is not None:
            pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
            found[kind].append({k.decode(): v.decode(errors="replace") for k, v in pairs})
    return found


def test_serve_processes_run_at_the_apps_cadence(server: Server) -> None:
    """Serve's controller, its HTTP proxy and every replica of the app (prefill, decode,
    ingress) wake at `app/serve/cadence.py`'s intervals (or those this environment sets),
    not Serve's 0.1 s defaults: the replicas through the environment `app.main` set before
    Ray started, the controller and proxy also through `controller_options`."""
    from app.serve.cadence import serve_env_vars

    wanted = serve_env_vars()
    environs = _serve_process_environs()
    for kind, processes in environs.items():
        assert processes, f"no {kind} process found"
        for environ in processes:
            assert {k: environ.get(k) for k in wanted} == wanted, kind
    assert len(environs["ray::ServeReplica:pdserve:"]) >= 3  # prefill, decode, ingress
