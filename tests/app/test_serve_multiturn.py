"""A six-turn chat end to end: real Ray Serve, real HTTP, the official `openai` client.

One prefill pool and one decode pool, KV over shared memory, every prompt routed to the
prefill pool (`local_prefill_threshold: 0`). Each turn sends the whole history back (the
previous answers as the assistant's messages); every answer must equal `transformers`
greedy on the same messages, and from the second turn on the usage shows prompt tokens
served from a cache (`prompt_tokens_details.cached_tokens`) and fewer prompt tokens' KV
moved than the prompt holds (`prompt_tokens_details.kv_transferred_tokens`, pdserve's
extension): the decode replica kept the history.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest

if TYPE_CHECKING:  # conftest is pytest's to import; its types are only needed for hints
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

SERVED_MODEL = "pdserve-tiny"
MAX_TOKENS = 20
NUM_TURNS = 6
# User messages of varied lengths: prompts cross block (16 tokens) and chunk boundaries.
MESSAGES = [
    "Tell me a story about a lighthouse keeper.",
    "Shorter.",
    "Now tell it again, but from the point of view of the seagulls who watch him. " * 2,
    "Why?",
    "List three things the keeper fears, one per line, and explain each in a sentence.",
    "Thanks, and goodbye.",
]


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {
            "model": str(model_dir),
            "num_threads": 1,
            "kv_cache_bytes": 32 * 1024**2,
            "long_prefill_token_threshold": 64,  # longer prompts prefill in chunks
        },
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": 0,
        "adaptive_prefill": {"enabled": False},
        "limits": {"max_prompt_tokens": 2048, "max_output_tokens": 64},
    }


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai()


def test_six_turn_chat_matches_transformers_and_reuses_the_history(
    server: Server, client: openai.OpenAI, hf: HFGreedy
) -> None:
    before = server.stats()["pools"]["decode"]["counters"]
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a storyteller."}]
    for turn, message in enumerate(MESSAGES[:NUM_TURNS]):
        history.append({"role": "user", "content": message})
        ref = hf.chat(history, MAX_TOKENS)
        completion = client.chat.completions.create(
            model=SERVED_MODEL,
            messages=history,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        answer = completion.choices[0].message.content
        assert answer == ref.text, f"turn {turn} differs from transformers"
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens == len(ref.prompt_ids)
        details = usage.prompt_tokens_details
        assert details is not None
        moved = (details.model_extra or {})["kv_transferred_tokens"]
        if turn == 0:
            assert moved == usage.prompt_tokens
        else:
            assert details.cached_tokens is not None and details.cached_tokens > 0
            assert 0 < moved < usage.prompt_tokens
        history.append({"role": "assistant", "content": answer or ""})
    counters = server.stats()["pools"]["decode"]["counters"]
    moved_total = counters["transferred_tokens"] - before.get("transferred_tokens", 0)
    full_total = counters["full_transfer_tokens"] - before.get("full_transfer_tokens", 0)
    assert 0 < moved_total < full_total
