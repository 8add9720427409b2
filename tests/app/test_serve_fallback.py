"""The fallback model end to end: `small` is the primary model, the built-in `tiny` the
fallback pool's (`app/routing/fallback.py`).

Real overload, no stand-ins:

- shed: the `batch` and `strict` classes have a TTFT SLO no prefill can meet, so once the
  prefill pool has measured its rate both are shed on the primary path; `batch` is
  degradable and is answered by tiny (header `x-pdserve-fallback`, body `model`
  pdserve-tiny, greedy output equal to tiny's in `transformers`), `strict` is not and gets
  503 `overloaded` with Retry-After, as before;
- backpressure: the primary decode pool takes one request at a time and queues one more
  (`max_ongoing_requests` / `max_queued_requests`), so a burst of requests of the
  degradable `bulk` class fills it: Serve refuses the rest (`BackPressureError`) and they
  are answered by tiny;
- breaker: the prefill replica is stopped (SIGSTOP) until its breaker opens on the decode
  replica, which publishes that in its routing stats: a degradable request is then answered
  by tiny rather than prefilled on the primary decode replica (last: it stops a replica).

Interactive requests keep being served by `small` throughout.
"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from bench.serve.faults import replica_pids, signal_pid
from tests.app.conftest import wait_until

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

PRIMARY = "pdserve-small"
FALLBACK = "pdserve-tiny"  # the fallback model's directory is named "tiny"
ACME = "sk-acme-fallback"
ADMIN = "sk-admin-fallback"
REQUEST_TIMEOUT_S = 120.0
WAIT_S = 120.0  # until the ingress sees the prefill pool's measured rate
BURST = 6  # concurrent bulk requests: the primary decode pool holds 2 at a time
MAX_TOKENS = 8
DEADLINE_S = 6.0  # the KV ticket deadline: an attempt on the stopped prefill replica ends soon
FAILURE_THRESHOLD = 2  # timed-out attempts that open the stopped replica's breaker
COOLDOWN_S = 120.0  # outlasts the breaker test (it closes again in a later module's app)


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {
            "model": "small",
            "dtype": "float32",
            "num_threads": 1,
            "kv_cache_bytes": 64 * 1024**2,
        },
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.4},
            {
                "name": "decode",
                "role": "decode",
                "num_cpus": 0.4,
                "max_ongoing_requests": 1,
                "max_queued_requests": 1,
            },
            {
                "name": "degraded",
                "role": "decode",
                "fallback": True,
                "num_cpus": 0.4,
                "model": {
                    "model": str(model_dir),
                    "dtype": "float32",
                    "num_threads": 1,
                    "kv_cache_bytes": 16 * 1024**2,
                },
            },
        ],
        "transfer": {"backend": "shm", "deadline_s": DEADLINE_S},
        "overload": {"breaker": {"failure_threshold": FAILURE_THRESHOLD, "cooldown_s": COOLDOWN_S}},
        # Every prompt goes to the prefill pool, where its class's TTFT decides shedding
        # (adaptive disaggregation could prefill it on the decode replica instead).
        "adaptive_prefill": {"enabled": False},
        "limits": {"max_prompt_tokens": 1024, "max_output_tokens": 64},
        "admission": {
            "classes": [
                {"name": "interactive", "ttft_s": 600.0, "tpot_s": 10.0, "priority": 0},
                {
                    "name": "bulk",
                    "ttft_s": 600.0,
                    "tpot_s": 10.0,
                    "priority": 5,
                    "degradable": True,
                },
                # No prefill takes under a millisecond: shed whenever a rate is measured.
                {
                    "name": "batch",
                    "ttft_s": 0.001,
                    "tpot_s": 10.0,
                    "priority": 10,
                    "degradable": True,
                },
                {"name": "strict", "ttft_s": 0.001, "tpot_s": 10.0, "priority": 10},
            ]
        },
        "tenants": [{"name": "acme", "api_keys": [ACME], "default_class": "interactive"}],
        "admin_api_keys": [ADMIN],
    }


def prompt(i: int) -> str:
    return f"{i:04d} a prompt that the prefill pool of the primary model takes. " * 2


def post(server: Server, text: str, slo_class: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": PRIMARY, "prompt": text, "max_tokens": max_tokens, "temperature": 0},
        headers={"Authorization": f"Bearer {ACME}", "x-pdserve-slo-class": slo_class},
        timeout=REQUEST_TIMEOUT_S,
    )


def assert_served_by_tiny(response: httpx.Response, text: str, hf: HFGreedy) -> None:
    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-fallback"] == "degraded"
    assert response.headers["x-pdserve-model"] == FALLBACK
    body = response.json()
    assert body["model"] == FALLBACK
    assert body["choices"][0]["text"] == hf.complete(text, MAX_TOKENS).text


def assert_served_by_small(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    assert "x-pdserve-fallback" not in response.headers
    assert response.json()["model"] == PRIMARY


def test_shed_degradable_request_is_answered_by_the_fallback_model(
    server: Server, hf: HFGreedy
) -> None:
    assert_served_by_small(post(server, prompt(0), "interactive"))
    # Until the ingress sees the prefill pool's measured rate nothing is shed (and the
    # strict request is served by small); from then on every strict request is.
    attempts = iter(range(1, 10_000))
    wait_until(
        lambda: post(server, prompt(next(attempts)), "strict", max_tokens=1).status_code == 503,
        WAIT_S,
        "the strict class to be shed",
    )

    refused = post(server, prompt(20_000), "strict")
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert float(refused.headers["retry-after"]) >= 1
    assert "x-pdserve-fallback" not in refused.headers

    text = prompt(20_001)
    served = post(server, text, "batch")
    assert_served_by_tiny(served, text, hf)
    route = served.headers["x-pdserve-route"]
    assert ": shed" in route and "shed: degradable class batch -> fallback pool degraded" in route

    recent = server.stats()["routing"]["recent"]
    [record] = [r for r in recent if r.get("fallback")]
    assert record["fallback"] == "shed" and record["decode_pool"] == "degraded"
    assert record["local_prefill"] and record["prefill_pool"] is None

    # The service keeps serving: the interactive class still runs on small.
    assert_served_by_small(post(server, prompt(20_002), "interactive"))


def test_streamed_fallback_says_so_in_headers_and_chunks(server: Server, hf: HFGreedy) -> None:
    text = prompt(30_000)
    body = {"model": PRIMARY, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0}
    headers = {"Authorization": f"Bearer {ACME}", "x-pdserve-slo-class": "batch"}
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=REQUEST_TIMEOUT_S,
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-pdserve-fallback"] == "degraded"
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["model"] for chunk in chunks} == {FALLBACK}
    assert "".join(c["choices"][0]["text"] for c in chunks) == hf.complete(text, MAX_TOKENS).text


def test_full_primary_decode_queue_sends_degradable_requests_to_the_fallback(
    server: Server, hf: HFGreedy
) -> None:
    texts = [prompt(40_000 + i) for i in range(BURST)]
    with ThreadPoolExecutor(max_workers=BURST + 1) as pool:
        bulk = list(pool.map(lambda text: post(server, text, "bulk"), texts))

    degraded = [
        (r, t) for r, t in zip(bulk, texts, strict=True) if "x-pdserve-fallback" in r.headers
    ]
    for response, text in degraded:
        assert_served_by_tiny(response, text, hf)
        assert "backpressure: degradable class bulk" in response.headers["x-pdserve-route"]
    for response in bulk:  # every request is answered, by one model or the other
        if "x-pdserve-fallback" not in response.headers:
            assert_served_by_small(response)
    # The primary decode pool holds one running and one queued request: the rest overflow.
    assert degraded, [r.headers.get("x-pdserve-route") for r in bulk]
    counts = server.stats()["routing"]["counts"]
    assert counts["acme|local|degraded|fallback:backpressure"] == len(degraded), counts


def test_open_prefill_breaker_sends_degradable_requests_to_the_fallback(
    server: Server, hf: HFGreedy
) -> None:
    [pid] = replica_pids("pdserve", "prefill")
    assert_served_by_small(post(server, prompt(50_000), "interactive"))
    texts = iter(prompt(50_001 + i) for i in range(10_000))
    assert signal_pid(pid, signal.SIGSTOP)
    try:
        # Each primary request spends one timed-out attempt on the stopped replica (then
        # is prefilled on the decode replica) until its breaker opens; once the ingress
        # sees the decode replica's `prefill_breakers`, bulk goes to tiny instead.
        answered: list[tuple[httpx.Response, str]] = []

        def degraded() -> bool:
            text = next(texts)
            answered.append((post(server, text, "bulk"), text))
            return "x-pdserve-fallback" in answered[-1][0].headers

        wait_until(degraded, WAIT_S, "a bulk request to be sent around the open breaker")
        for response, _ in answered[:-1]:
            assert_served_by_small(response)
        served, text = answered[-1]
        assert_served_by_tiny(served, text, hf)
        route = served.headers["x-pdserve-route"]
        assert "breaker of prefill pool prefill open on decode pool decode" in route
        assert "breaker: degradable class bulk -> fallback pool degraded" in route
        # Not degradable: still answered by small, prefilled on its decode replica.
        assert_served_by_small(post(server, prompt(60_000), "interactive"))
    finally:
        assert signal_pid(pid, signal.SIGCONT)
    counts = server.stats()["routing"]["counts"]
    assert counts["acme|local|degraded|fallback:breaker"] == 1, counts
