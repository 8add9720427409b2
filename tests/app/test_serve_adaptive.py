"""Adaptive disaggregation end to end: a real app decides from its pools' real loads.

One prefill and one decode replica; prompts of 32 tokens or more go to the prefill pool by
the static rule, and the adaptive rule (`app/routing/adaptive.py`) may prefill them on
the decode replica instead. With the prefill pool idle a long prompt is prefilled
remotely; while a flood of long prompts keeps the prefill pool's queue full, the same kind
of prompt is prefilled locally, and the decision with its figures is in the
`x-pdserve-route` header and the routing report of `GET /v1/pdserve/stats`. Once the flood
is over prompts go remote again. Greedy output equals `transformers` either way.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
THRESHOLD = 32
MAX_TOKENS = 16
FLOOD_CLIENTS = 8
REQUEST_TIMEOUT_S = 120.0
DECISION_TIMEOUT_S = 120.0  # bound of each loop waiting for a decision below


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": THRESHOLD,
        "limits": {"max_prompt_tokens": 1024, "max_output_tokens": 64},
        # Any predicted saving counts; loads stay usable for the whole of a slow test run.
        "adaptive_prefill": {"enabled": True, "min_gain_s": 0.0, "max_age_s": 30.0},
    }


def probe_prompt(i: int) -> str:
    """A distinct ~330-token prompt: at or above the threshold, so the adaptive rule weighs it."""
    return f"{i:04d} a probe for the router, remote or local as the pools' loads say. " * 5


def flood_prompt(i: int) -> str:
    """A distinct ~950-token prompt (no prefix shared with another) for the prefill pool."""
    return f"{i:06d} flood of long prompts keeping the prefill queue full today. " * 15


def complete(server: Server, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    """A greedy completion: (its text, the route's reason from `x-pdserve-route`)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"]), response.headers["x-pdserve-route"]


def routing(server: Server) -> dict[str, Any]:
    return dict(server.stats()["routing"])


def decode_counters(server: Server) -> Counter[str]:
    return Counter(server.stats()["pools"]["decode"]["counters"])


def first_probe(
    server: Server, start: int, decided: str, between: float = 0.0
) -> tuple[str, str, str]:
    """Send distinct probes until the adaptive rule decides `decided` ("local prefill" or
    "remote prefill") for one: (its prompt, text, reason)."""
    deadline = time.monotonic() + DECISION_TIMEOUT_S
    i = start
    while True:
        prompt = probe_prompt(i)
        text, reason = complete(server, prompt)
        if "adaptive (prefill vs decode)" in reason and f"-> {decided}" in reason:
            return prompt, text, reason
        if time.monotonic() > deadline:
            pytest.fail(f"no probe was sent to {decided} in {DECISION_TIMEOUT_S}s: {reason}")
        i += 1
        time.sleep(between)


def test_short_prompts_stay_local_by_the_static_rule(server: Server, hf: HFGreedy) -> None:
    """The threshold still decides below it (and the decode replica measures its rate)."""
    prompt = "control 001"
    text, reason = complete(server, prompt)
    assert text == hf.complete(prompt, MAX_TOKENS).text
    assert f"< local_prefill_threshold {THRESHOLD} -> local prefill" in reason
    assert "adaptive" not in reason


def test_idle_prefill_pool_prefills_remotely(server: Server, hf: HFGreedy) -> None:
    complete(server, "control 002")  # a local prefill: the decode replica's rate is measured
    prompt, text, reason = first_probe(server, 0, "remote prefill")
    assert text == hf.complete(prompt, MAX_TOKENS).text
    decision = routing(server)["recent"][-1]
    assert decision["prefill_pool"] == "prefill" and not decision["local_prefill"]
    assert decision["reason"] == reason


def test_saturated_prefill_pool_prefills_locally(server: Server, hf: HFGreedy) -> None:
    """While a flood keeps the prefill pool's queue full, a long prompt is prefilled on the
    decode replica; after it, prompts go remote again; the output is the same both ways."""
    complete(server, "control 003")
    before, counters_before = routing(server)["counts"], decode_counters(server)
    stop = threading.Event()
    statuses: Counter[int] = Counter()
    lock = threading.Lock()

    def flood(client: int) -> None:
        n = 0
        body = {"model": MODEL, "max_tokens": 1, "temperature": 0}
        while not stop.is_set():
            prompt = flood_prompt(client * 100_000 + n)
            response = httpx.post(
                f"{server.base_url}/v1/completions",
                json={**body, "prompt": prompt},
                timeout=REQUEST_TIMEOUT_S,
            )
            with lock:
                statuses[response.status_code] += 1
            n += 1

    with ThreadPoolExecutor(FLOOD_CLIENTS) as pool:
        floods = [pool.submit(flood, client) for client in range(FLOOD_CLIENTS)]
        try:
            prompt, local_text, local_reason = first_probe(server, 1000, "local prefill", 0.2)
        finally:
            stop.set()
        for future in floods:
            future.result()
    assert set(statuses) == {200}, statuses  # nothing was refused or failed meanwhile

    expected = hf.complete(prompt, MAX_TOKENS).text
    assert local_text == expected
    report = routing(server)
    adaptive_local = [
        d
        for d in report["recent"]
        if d["local_prefill"] and "adaptive (prefill vs decode)" in d["reason"]
    ]
    assert any(d["reason"] == local_reason for d in adaptive_local)
    assert all(d["prefill_pool"] is None for d in adaptive_local)
    assert report["counts"].get("|local|decode", 0) > before.get("|local|decode", 0)
    assert decode_counters(server)["local_prefill"] > counters_before["local_prefill"]

    # The same prompt again: once the ingress's prefix index has the decode replica's
    # report of it, that replica computes the rest (its last partial block) itself, with
    # no choice to weigh; same tokens every time.
    deadline = time.monotonic() + DECISION_TIMEOUT_S
    while True:
        text, reason = complete(server, prompt)
        assert text == expected
        if reason.endswith("-token suffix itself"):
            break
        if time.monotonic() > deadline:
            pytest.fail(f"the cached prompt still weighed {DECISION_TIMEOUT_S}s on: {reason}")
        time.sleep(0.5)
    # The flood is over: new prompts go to the prefill pool again, same tokens as HF.
    prompt, text, reason = first_probe(server, 2000, "remote prefill", 0.5)
    assert text == hf.complete(prompt, MAX_TOKENS).text
