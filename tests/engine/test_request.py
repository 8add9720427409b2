"""The request description shared by every stage and the one prompt check
(engine/request.py: `RequestSpec`, `check_prompt`)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.request import (
    ContextOverflowError,
    InvalidRequestError,
    RequestSpec,
    SamplingParams,
    check_prompt,
)
from replica.protocol import GenerationSpec, PrefillRequest

PARAMS = SamplingParams(max_tokens=4, stop_token_ids=(7,))


def test_each_stage_carries_the_shared_fields_and_adds_its_own() -> None:
    core = RequestSpec("r1", (1, 2, 3), PARAMS, tenant="acme", priority=2, trace_context={"a": "b"})
    decode = GenerationSpec.derive(core, request_id="r1-0", prefill_pool="p", timeout_s=3.0)
    prefill = PrefillRequest.derive(decode, request_id="r1-0#1", exclude_replicas=("x",))
    for spec in (decode, prefill):
        assert isinstance(spec, RequestSpec)
        assert (spec.prompt_token_ids, spec.sampling_params) == ((1, 2, 3), PARAMS)
        assert (spec.tenant, spec.priority, spec.trace_context) == ("acme", 2, {"a": "b"})
    assert (decode.request_id, decode.prefill_pool, decode.timeout_s) == ("r1-0", "p", 3.0)
    assert (prefill.request_id, prefill.exclude_replicas) == ("r1-0#1", ("x",))
    assert not hasattr(prefill, "prefill_pool")  # only the fields its own stage adds
    with pytest.raises(dataclasses.FrozenInstanceError):
        prefill.request_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("token_ids", "params", "error", "needle"),
    [
        ([], PARAMS, InvalidRequestError, "prompt is empty"),
        ([1, 100], PARAMS, InvalidRequestError, r"prompt token ids must be integers in \[0, 100\)"),
        ([1, -1], PARAMS, InvalidRequestError, "prompt token ids"),
        ([1, True], PARAMS, InvalidRequestError, "prompt token ids"),
        ([1, 2.0], PARAMS, InvalidRequestError, "prompt token ids"),
        ([1], SamplingParams(stop_token_ids=(100,)), InvalidRequestError, "^stop_token_ids"),
        (list(range(17)), PARAMS, ContextOverflowError, r"= 21 exceeds .* length of 20"),
    ],
)
def test_check_prompt_refuses(
    token_ids: list[object], params: SamplingParams, error: type[Exception], needle: str
) -> None:
    with pytest.raises(error, match=needle):
        check_prompt(token_ids, params, vocab_size=100, max_model_len=20)


def test_check_prompt_accepts_a_prompt_that_just_fits() -> None:
    check_prompt(list(range(16)), PARAMS, vocab_size=100, max_model_len=20)  # 16 + 4 = 20
    assert issubclass(ContextOverflowError, InvalidRequestError)  # a 400 wherever it surfaces
