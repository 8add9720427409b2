"""Decode overflow end to end: a prefill pool with `serves_decode` takes whole requests
while the decode pool is busier, in a real app, driven by the official `openai` client.

One prefill replica (serves_decode) and one decode replica. Idle, a chat turn is served by
the decode replica as the static rule says; a burst of concurrent chat turns is split
between the two pools, each overflowed request served whole (prefill and decode) by the
prefill replica, which the `x-pdserve-route` header and the routing report say. Greedy
output equals `transformers` wherever a request ran, and every pool's KV blocks are free
afterwards (the conftest's check after each test).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.app.conftest import wait_until

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
THRESHOLD = 32
MAX_TOKENS = 24
BURST = 8
LOADS_TIMEOUT_S = 60.0  # until the ingress has seen both pools' loads


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5, "serves_decode": True},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": THRESHOLD,
        "limits": {"max_prompt_tokens": 1024, "max_output_tokens": 64},
        # Loads stay usable for the whole of a slow test run.
        "adaptive_prefill": {"enabled": True, "max_age_s": 30.0, "decode_overflow_gap": 2},
    }


def complete(server: Server, prompt: str) -> tuple[str, str]:
    """A greedy completion through the official client: (its text, `x-pdserve-route`)."""
    raw = server.openai().completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    return str(raw.parse().choices[0].text), raw.headers["x-pdserve-route"]


def counters(server: Server, pool: str) -> Counter[str]:
    return Counter(server.stats()["pools"][pool]["counters"])


def test_idle_chat_turn_stays_on_the_decode_pool(server: Server, hf: HFGreedy) -> None:
    prompt = "chat 0001"
    text, route = complete(server, prompt)
    assert text == hf.complete(prompt, MAX_TOKENS).text
    assert f"< local_prefill_threshold {THRESHOLD} -> local prefill on decode pool decode" in route
    assert "served whole on prefill" not in route


def test_a_burst_overflows_onto_the_prefill_replica(server: Server, hf: HFGreedy) -> None:
    """Once the ingress sees both pools' loads, a burst of concurrent chat turns goes to
    both pools (the decode pool until it is `decode_overflow_gap` ahead, then alternately),
    and every turn's tokens equal `transformers`' greedy output."""
    seen: list[str] = []

    def loads_seen() -> bool:
        seen.append(complete(server, f"warm {len(seen):04d}")[1])
        return "sequences on decode vs" in seen[-1]

    wait_until(loads_seen, LOADS_TIMEOUT_S, "the ingress to see both pools' loads")
    prefill_before, decode_before = counters(server, "prefill"), counters(server, "decode")
    prompts = [f"chat turn {i:04d} in a burst" for i in range(BURST)]
    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(lambda p: complete(server, p), prompts))

    overflowed = [r for _, r in results if "decode overflow:" in r]
    assert overflowed and len(overflowed) < BURST, [r for _, r in results]
    assert all(r.endswith("-> served whole on prefill") for r in overflowed)
    for prompt, (text, _) in zip(prompts, results, strict=True):
        assert text == hf.complete(prompt, MAX_TOKENS).text, prompt
    whole = counters(server, "prefill")["whole_requests"] - prefill_before["whole_requests"]
    assert whole == len(overflowed)
    local = counters(server, "decode")["local_prefill"] - decode_before["local_prefill"]
    assert local == BURST - len(overflowed)
    recent = server.stats()["routing"]["recent"][-BURST:]
    moved = [d for d in recent if d["decode_pool"] == "prefill"]
    assert len(moved) == len(overflowed)
    assert all(d["local_prefill"] and d["prefill_pool"] is None for d in moved)
