"""Per-rank KV transfer through Serve: prefill and decode pools both TP=2, every rank in its
own process with its own KV shard (as CUDA ranks hold theirs on their own GPUs), rank i of
the prefill replica sending its shard over tcp to rank i of the decode replica, one
endpoint per rank (`kvtransfer.ranks`). Greedy output token for token `transformers`',
every block free after each request, and a prefill rank killed mid-transfer leaving
nothing held."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.app.conftest import wait_until
from tests.app.tp_drills import kill_prefill_rank_mid_transfer

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

APP = "pdserve"
MODEL = "pdserve-tiny"
MAX_TOKENS = 16
PROMPTS = [
    "a prompt long enough to go to the prefill pool, over a couple of KV blocks",
    "another prompt for the prefill pool, each rank's KV heads on their own connection",
]


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {
            "model": str(model_dir),
            "dtype": "float32",
            "num_threads": 1,
            "kv_cache_bytes": 16 * 1024**2,
            "tensor_parallel_size": 2,
        },
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.25},
            {"name": "decode", "role": "decode", "num_cpus": 0.25},
        ],
        "transfer": {
            "backend": "tcp",
            "bind_host": "127.0.0.1",
            "deadline_s": 30.0,
            "per_rank": True,
        },
        "local_prefill_threshold": 8,  # the prompts above go to the prefill pool
    }


def test_tp2_per_rank_equals_transformers(server: Server, hf: HFGreedy) -> None:
    client = server.openai()
    before = server.stats()["pools"]["decode"]["counters"]
    for prompt in PROMPTS:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.choices[0].text == hf.complete(prompt, MAX_TOKENS).text
        wait_until(lambda: not server.busy_pools(), 30, "every block free after the request")
    counters = server.stats()["pools"]["decode"]["counters"]
    assert counters.get("remote_prefill", 0) - before.get("remote_prefill", 0) == len(PROMPTS)
    assert counters.get("local_prefill_fallback", 0) == before.get("local_prefill_fallback", 0)


def test_streamed_chat_equals_transformers(server: Server, hf: HFGreedy) -> None:
    messages = [{"role": "user", "content": "tell me about the ranks and their shards"}]
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == hf.chat(messages, MAX_TOKENS).text
    wait_until(lambda: not server.busy_pools(), 30, "every block free after the request")


def test_prefill_rank_killed_mid_transfer_leaves_nothing_held(server: Server, hf: HFGreedy) -> None:
    """The prefill replica's rank 1 (its own sender) is stopped, so a prefill step (its
    ticket open on both decode ranks, the decode blocks reserved) cannot finish; then it is
    killed. The request is answered (decode prefills it itself), every block of every pool
    is free, Serve replaces the prefill replica, and per-rank transfers work again."""
    prompt = "a prompt whose prefill is stopped mid-transfer: its rank dies under it"
    kill_prefill_rank_mid_transfer(server, hf, APP, MODEL, MAX_TOKENS, [prompt, PROMPTS[0]])
