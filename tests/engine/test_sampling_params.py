"""SamplingParams' own validation (engine/request.py): what any caller gets, HTTP or not."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine.request import (
    MAX_NUM_STOP_STRINGS,
    MAX_NUM_STOP_TOKEN_IDS,
    MAX_STOP_STRING_CHARS,
    SEED_MAX,
    SEED_MIN,
    InvalidRequestError,
    SamplingParams,
)

FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "0.5", None, True])
def test_float_fields_must_be_finite_numbers(name: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{name} must be a finite number"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"seed": SEED_MAX + 1}, "seed"),
        ({"seed": SEED_MIN - 1}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ("a",) * (MAX_NUM_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ("x" * (MAX_STOP_STRING_CHARS + 1),)}, "stop"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ["a"]}, "stop"),
        ({"stop": (1,)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": (0,) * (MAX_NUM_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"stop_token_ids": (1.0,)}, "stop_token_ids"),
        ({"stop_token_ids": [1]}, "stop_token_ids"),
    ],
)
def test_out_of_bounds_values_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields)
    assert str(info.value).split(" ", 1)[0] == field


def test_values_at_the_bounds_are_accepted() -> None:
    params = SamplingParams(
        max_tokens=5,
        min_tokens=5,
        temperature=0,
        top_p=1,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        seed=SEED_MIN,
        logprobs=20,
        stop=("x" * MAX_STOP_STRING_CHARS,) * MAX_NUM_STOP_STRINGS,
        stop_token_ids=tuple(range(MAX_NUM_STOP_TOKEN_IDS)),
    )
    assert params.is_greedy
    assert SamplingParams(seed=SEED_MAX).seed == SEED_MAX


def test_check_vocab() -> None:
    SamplingParams(stop_token_ids=(0, 319)).check_vocab(320)
    with pytest.raises(InvalidRequestError, match="^stop_token_ids must be < the vocabulary"):
        SamplingParams(stop_token_ids=(5, 320)).check_vocab(320)
    with pytest.raises(InvalidRequestError, match="^stop_token_ids"):
        SamplingParams(stop_token_ids=(10**9,)).check_vocab(320)
