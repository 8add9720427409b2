"""A decode call's TTFT breakdown: which timestamps make which phase, remote and local."""

from __future__ import annotations

import pytest

from engine.outputs import RequestOutput
from engine.request import Request, SamplingParams
from replica.generation_trace import GenerationTrace
from replica.protocol import GenerationSpec, PrefillResult


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _spec() -> GenerationSpec:
    return GenerationSpec("r1", (1, 2, 3), SamplingParams(max_tokens=4), prefill_pool="p")


def _delta(tokens: list[int], num_output: int) -> RequestOutput:
    return RequestOutput("r1", tokens, "", [], False, None, 3, num_output)


def test_remote_breakdown_adds_up_to_the_first_token() -> None:
    clock = Clock()
    timeline = GenerationTrace(_spec(), "decode@h:1", "decode", clock)
    timeline.local_request = Request("r1", [1, 2, 3], SamplingParams())  # never scheduled
    clock.now += 0.004
    timeline.reserve_started()
    clock.now += 0.006
    timeline.reserved("r1#0", got_room=True)  # 10 ms in
    timeline.prefill_call_started("r1#0", "p")
    clock.now += 0.060
    result = PrefillResult("r1#0", 7, None, 0, "prefill@h:2", 50.0, 5.0, 40.0, 5.0)
    timeline.prefill_call_ended(result, "prefill@h:2")  # 70 ms in
    clock.now += 0.002
    timeline.published()  # 72 ms in
    clock.now += 0.003
    empty = timeline.on_delta(_delta([], 0))
    assert empty.ttft is None
    first = timeline.on_delta(_delta([7], 1))
    ttft = first.ttft
    assert ttft is not None and ttft.remote
    assert ttft.queue_ms == pytest.approx(10 + 5)  # reserve wait + prefill queue
    assert ttft.prefill_ms == pytest.approx(40)
    assert ttft.transfer_ms == pytest.approx(5)
    assert ttft.handover_ms == pytest.approx(60 - 50)  # the call's time off the prefill replica
    assert ttft.first_step_ms == pytest.approx(2)
    assert ttft.total_ms == pytest.approx(72)
    assert timeline.on_delta(_delta([8], 2)).ttft is None  # only the first token carries it
    timeline.finish("length", None)


def test_local_breakdown_splits_at_first_scheduling() -> None:
    clock = Clock()
    timeline = GenerationTrace(_spec(), "decode@h:1", "decode", clock)
    request = Request("r1", [1, 2, 3], SamplingParams())
    timeline.local_request = request
    request.first_scheduled_time = clock.now + 0.020
    clock.now += 0.050
    ttft = timeline.on_delta(_delta([7], 1)).ttft
    assert ttft is not None and not ttft.remote
    assert ttft.queue_ms == pytest.approx(20)
    assert ttft.prefill_ms == pytest.approx(30)
    assert ttft.transfer_ms == ttft.handover_ms == ttft.first_step_ms == 0.0
    timeline.finish("stop", None)
