"""Held output (`Request.output_interval_s`): a whole-answer caller gets its first token at
once, then merged deltas, with exactly the tokens, text, logprobs and finish of a request
streamed token by token; stop strings still end it on the same token; an abort hands over
what was held and frees every block."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.request import SamplingParams

PROMPTS = [
    "hello",
    "a longer prompt that spans a few KV cache blocks of sixteen tokens each, so paging matters",
    "short",
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    model_dir: Path = write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")
    return Engine(EngineConfig(model_dir=str(model_dir)))


def run(
    engine: Engine, params: SamplingParams, interval_s: float, prompts: list[str] = PROMPTS
) -> dict[int, list[RequestOutput]]:
    """Every delta of each prompt's request, in order (by prompt index)."""
    ids = {}
    for i, prompt in enumerate(prompts):
        request = engine.make_request(prompt, params, output_interval_s=interval_s)
        ids[request.request_id] = i
        engine.add_request(request)
    deltas: dict[int, list[RequestOutput]] = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for delta in engine.step():
            deltas[ids[delta.request_id]].append(delta)
    return deltas


def whole(deltas: list[RequestOutput]) -> tuple[list[int], str, list[dict[int, float]], str]:
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    return (
        [t for d in deltas for t in d.new_token_ids],
        "".join(d.new_text for d in deltas),
        [p for d in deltas for p in d.new_logprobs],
        str(deltas[-1].finish_reason),
    )


def test_held_requests_get_the_first_token_then_one_delta_with_the_rest(engine: Engine) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True)
    streamed = run(engine, params, interval_s=0.0)
    held = run(engine, params, interval_s=math.inf)
    for i in range(len(PROMPTS)):
        assert len(streamed[i]) == 20
        assert [len(d.new_token_ids) for d in held[i]] == [1, 19]
        assert whole(held[i]) == whole(streamed[i])
        assert held[i][-1].num_output_tokens == 20
    assert engine.occupancy()["num_free_blocks"] == engine.occupancy()["num_blocks"]


def test_stop_strings_end_a_held_request_on_the_same_token(engine: Engine) -> None:
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = whole(run(engine, free, 0.0, PROMPTS[:1])[0])[1]
    # Two characters from the middle of the answer (whole characters, not whitespace only).
    start = next(
        k
        for k in range(len(text) // 3, len(text) - 1)
        if "\ufffd" not in text[k : k + 2] and text[k : k + 2].strip()
    )
    stop = text[start : start + 2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    streamed = whole(run(engine, params, 0.0, PROMPTS[:1])[0])
    held = whole(run(engine, params, math.inf, PROMPTS[:1])[0])
    assert held == streamed
    assert held[3] == "stop" and len(held[0]) < 24


def test_an_aborted_held_request_hands_over_its_held_tokens(engine: Engine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    request = engine.make_request(PROMPTS[1], params, output_interval_s=math.inf)
    engine.add_request(request)
    deltas = []
    while request.num_output_tokens < 10:
        deltas.extend(engine.step())
    generated = list(request.output_token_ids)
    final = engine.abort_request(request.request_id)
    assert final is not None and final.finished and final.finish_reason == "abort"
    deltas.append(final)
    assert [t for d in deltas for t in d.new_token_ids] == generated
    assert len(deltas) == 2  # the first token, then the held ones with the abort
    assert final.new_text  # the held tokens' text came with them
    assert not engine.has_unfinished
    assert engine.occupancy()["num_free_blocks"] == engine.occupancy()["num_blocks"]


def test_a_held_request_failing_midway_hands_over_its_tokens_and_text(engine: Engine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    streamed = whole(run(engine, params, 0.0, PROMPTS[1:2])[0])
    request = engine.make_request(PROMPTS[1], params, output_interval_s=math.inf)
    engine.add_request(request)
    deltas = []
    while request.num_output_tokens < 10:
        deltas.extend(engine.step())
    execute = engine.runner.execute

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    engine.runner.execute = broken  # type: ignore[method-assign]
    try:
        deltas.extend(engine.step())
    finally:
        engine.runner.execute = execute  # type: ignore[method-assign]
    final = deltas[-1]
    assert final.finished and final.error is not None
    tokens = [t for d in deltas for t in d.new_token_ids]
    assert tokens == streamed[0][:10]
    assert "".join(d.new_text for d in deltas) == engine.tokenizer.decode(tokens)
    assert engine.occupancy()["num_free_blocks"] == engine.occupancy()["num_blocks"]
