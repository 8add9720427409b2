"""Prefix-aware routing in a real app: conversations stick to the decode replica that holds
their history, and spread over the pool (`app/serve/replica_router.py`).

`configs/cpu-multiturn-2decode.yaml` (one prefill and two decode replicas), with every
prompt prefilled where it decodes: a turn's `cached_tokens` are then the decode replica's own
prefix-cache hits, so a turn that reached the replica holding its conversation shows its
whole previous prompt as cached, and one sent to the other replica shows none. Each turn's
prompt is the previous prompt, the previous answer and a new user message, as token ids
(the next prompt extends the cached tokens exactly). Every answer equals `transformers`
greedy.

The eight conversations open at once (their first turns spread by load); their later turns
then go one at a time, so both replicas are equally idle when each is routed and the
guarantee is exact: every later turn returns to the replica holding its history. How
conversations spread while they all run at once depends on timing, so `pdserve bench
multiturn` measures it (BENCHMARKS.md), not this test.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from bench.serve.deploy import app_args

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
NUM_CONVERSATIONS = 8
NUM_TURNS = 5
MAX_TOKENS = 16
BLOCK_SIZE = 16


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    args = app_args("cpu-multiturn-2decode", model=str(model_dir))
    args["local_prefill_threshold"] = 4096  # every prompt here prefilled where it decodes
    args["adaptive_prefill"] = {"enabled": False}
    return args


def user_message(conversation: int, turn: int) -> list[int]:
    """A new user message: 37 tokens, different for every conversation and turn."""
    return [32 + (conversation * 31 + turn * 17 + i * 7) % 90 for i in range(37)]


def conversations(hf: HFGreedy) -> list[list[tuple[list[int], str]]]:
    """Each conversation's turns: (prompt ids, expected text), from `transformers`."""
    result = []
    for c in range(NUM_CONVERSATIONS):
        opener = list(hf.prompt_ids(f"conversation {c:02d} opens here:")) + user_message(c, 0)
        prompt, turns = opener, []
        for t in range(NUM_TURNS):
            reference = hf.generate(prompt, MAX_TOKENS)
            turns.append((prompt, reference.text))
            prompt = prompt + reference.output_ids + user_message(c, t + 1)
        result.append(turns)
    return result


def test_later_turns_return_to_the_replica_holding_their_history(
    server: Server, hf: HFGreedy
) -> None:
    plan = conversations(hf)
    client = server.openai()

    def turn(prompt: list[int]) -> tuple[str, int]:
        completion = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return completion.choices[0].text, usage.prompt_tokens_details.cached_tokens

    with ThreadPoolExecutor(NUM_CONVERSATIONS) as pool:
        results = [[first] for first in pool.map(turn, [turns[0][0] for turns in plan])]
    for t in range(1, NUM_TURNS):
        for turns, served in zip(plan, results, strict=True):
            served.append(turn(turns[t][0]))

    for turns, served in zip(plan, results, strict=True):
        assert [text for text, _ in served] == [expected for _, expected in turns]
        for t in range(1, NUM_TURNS):
            previous_prompt = turns[t - 1][0]
            held = len(previous_prompt) // BLOCK_SIZE * BLOCK_SIZE
            assert served[t][1] >= held, (t, served[t][1], held)  # its replica's own cache
    report = server.stats()["routing"]["prefix"]["decode"]
    assert report["routed"] >= NUM_CONVERSATIONS * NUM_TURNS
    assert report["prefix_cached"] >= NUM_CONVERSATIONS * (NUM_TURNS - 1)
    assert report["hit_rate"] == 1.0, report
    per_replica = {name: r["conversations"] for name, r in report["replicas"].items()}
    assert sum(per_replica.values()) == NUM_CONVERSATIONS, per_replica
