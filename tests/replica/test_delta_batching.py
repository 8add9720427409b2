"""A stream's deltas merged for a caller that reads only the whole answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.outputs import RequestOutput
from replica.delta_batching import batched


def delta(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        new_token_ids=[i],
        new_text=f"<{i}>",
        new_logprobs=[{i: -0.5}],
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=5,
        num_output_tokens=i + 1,
        num_cached_tokens=3 if i == 0 else 0,
    )


async def source(n: int) -> AsyncIterator[RequestOutput]:
    for i in range(n):
        yield delta(i, finished=i == n - 1)


def collect(n: int, interval_s: float) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [d async for d in batched(source(n), interval_s)]

    return asyncio.run(run())


def test_merged_deltas_carry_every_token_in_order() -> None:
    (only,) = collect(6, interval_s=3600)  # nothing sent before the end
    assert only.new_token_ids == list(range(6))
    assert only.new_text == "".join(f"<{i}>" for i in range(6))
    assert only.new_logprobs == [{i: -0.5} for i in range(6)]
    assert only.finished and only.finish_reason == "length"
    assert (only.num_output_tokens, only.num_cached_tokens) == (6, 3)


def test_no_interval_passes_every_delta() -> None:
    out = collect(4, interval_s=0)
    assert [d.new_token_ids for d in out] == [[0], [1], [2], [3]]
    assert [d.finished for d in out] == [False, False, False, True]
