"""The front door's cheap paths: pre-encoded stream events, and ready deltas written together.

`add_event` must be byte for byte the pydantic chunk `add` returns, serialized as before
(`sse_event`), for both APIs, every kind of delta and text that needs escaping; and
`Frontend.run_batches` must hand over every delta once, in order, grouping those that were
ready together (a decode stream stand-in that never waits makes them all ready at once).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import openai.types.chat
import pytest

from app.builders import ChatBuilder, CompletionBuilder
from app.config import load_config
from app.frontend import Frontend
from app.responses import sse_event
from engine.builtin import write_builtin_model
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from replica.protocol import GenerationSpec

TEXTS = ["", "Hello", ' "quoted" \\ back\\slash', "tab\tnew\nline\x01\x7f", "é ü 中文 \u2028 🙂"]


def deltas() -> list[RequestOutput]:
    """A stream's deltas: text of every kind, one without text, then the finish."""
    out = [
        RequestOutput("r", [i + 1], text, [], False, None, 7, i + 1, num_cached_tokens=2)
        for i, text in enumerate(TEXTS)
    ]
    out.append(RequestOutput("r", [], "", [], False, None, 7, len(TEXTS)))
    out.append(RequestOutput("r", [9], "end", [], True, "length", 7, len(TEXTS) + 1))
    return out


@pytest.mark.parametrize("builder_class", [CompletionBuilder, ChatBuilder])
@pytest.mark.parametrize("model", ["pdserve-tiny", 'a "model" é'])
def test_add_event_is_the_pydantic_chunk_serialized(
    builder_class: type[CompletionBuilder] | type[ChatBuilder], model: str
) -> None:
    fast = builder_class(model, n=2, response_id="cmpl-x", created=1700000000)
    slow = builder_class(model, n=2, response_id="cmpl-x", created=1700000000)
    sent = 0
    for index in (1, 0):  # choices in any order
        for delta in deltas():
            chunk = slow.add(index, delta)
            event = fast.add_event(index, delta)
            assert event == (None if chunk is None else sse_event(chunk))
            if event is not None:
                sent += 1
                data = json.loads(event.removeprefix("data: "))
                if builder_class is ChatBuilder:  # (a streamed Completion chunk's null
                    # finish_reason is outside openai's non-stream type; the client accepts it)
                    openai.types.chat.ChatCompletionChunk.model_validate(data)
    assert sent >= 2 * len(TEXTS)
    assert fast.usage == slow.usage and fast.finished


@pytest.mark.parametrize("builder_class", [CompletionBuilder, ChatBuilder])
def test_add_event_names_a_model_set_after_the_builder_was_made(
    builder_class: type[CompletionBuilder] | type[ChatBuilder],
) -> None:
    builder = builder_class("primary", n=1)
    first = builder.add_event(0, deltas()[1])
    builder.model = "fallback"  # as the ingress does when the fallback pool served it
    second = builder.add_event(0, deltas()[2])
    assert first is not None and second is not None
    assert json.loads(first[6:])["model"] == "primary"
    assert json.loads(second[6:])["model"] == "fallback"


def test_add_event_with_logprobs_falls_back_to_the_model() -> None:
    class Tokens:
        def text(self, token_id: int) -> str:
            return chr(token_id)

    builder = CompletionBuilder("m", n=1, num_logprobs=1, tokens=Tokens())  # type: ignore[arg-type]
    delta = RequestOutput("r", [72], "H", [{72: -0.5, 73: -1.0}], False, None, 3, 1)
    event = builder.add_event(0, delta)
    assert event is not None
    assert json.loads(event[6:])["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]


# ------------------------------------------------------------------- deltas ready together


class _InstantStream:
    """A decode stream whose deltas are all there at once (it never waits)."""

    def __init__(self, spec: GenerationSpec) -> None:
        self.spec = spec

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[RequestOutput]:
        for i in range(5):
            done = i == 4
            yield RequestOutput(
                self.spec.request_id,
                [i + 1],
                f"t{i}",
                [],
                done,
                "length" if done else None,
                3,
                i + 1,
            )

    def cancel(self) -> None:
        pass


class _InstantDecodePool:
    """Stands in for a decode pool's streaming DeploymentHandle."""

    def __init__(self) -> None:
        self.generate = self

    def options(self, stream: bool) -> _InstantDecodePool:
        return self

    def remote(self, spec: GenerationSpec) -> _InstantStream:
        return _InstantStream(spec)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Frontend:
    model_dir: Path = write_builtin_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")
    config = load_config(
        {
            "model": {"model": str(model_dir)},
            "pools": [
                {"name": "prefill", "role": "prefill"},
                {"name": "decode", "role": "decode"},
            ],
        }
    )
    return Frontend(config, {"decode": _InstantDecodePool()})


def test_ready_deltas_come_as_one_batch_in_order(front: Frontend) -> None:
    async def collect() -> tuple[list[list[tuple[int, str]]], list[tuple[int, str]]]:
        ids = await front.tokenize_prompt("hello")
        params = SamplingParams(max_tokens=5)
        batches = [
            [(i, d.new_text) for i, d in batch]
            async for batch in front.run_batches(
                front.prepare(front.authenticate(None), ids, params, n=2)
            )
        ]
        items = [
            (i, d.new_text)
            async for i, d in front.run(front.prepare(front.authenticate(None), ids, params, n=2))
        ]
        return batches, items

    batches, items = asyncio.run(collect())
    assert len(batches) == 1  # everything was ready before the first hand-over
    flat = [item for batch in batches for item in batch]
    assert sorted(flat) == sorted(items)
    for index in (0, 1):  # each choice's deltas once, in its order
        assert [t for i, t in flat if i == index] == [f"t{k}" for k in range(5)]
    assert sum(front.in_flight.values()) == 0
