"""Overload protection end to end: circuit breakers, retry elsewhere, deadlines, shedding.

One app: two prefill replicas (so a retry has somewhere else to go), one decode replica.
Faults are real signals to real replica processes (`bench/serve/faults.py`): a SIGSTOPped prefill
replica must cost each request one timed-out attempt at most, its retry must go to the
other replica (never back to the stopped one), its breaker must open after
`FAILURE_THRESHOLD` timeouts, and after SIGCONT and the cool-down a probe must close it
again. A SIGSTOPped decode replica holds requests past their deadline: 504 (or an SSE error
event once a stream has started), with every block free afterwards (the autouse check of
conftest). The `batch` class has a TTFT SLO no prefill can meet, so once the prefill pool
has measured its rate every batch request is shed (503 overloaded, Retry-After) while an
`interactive` request in the same flood is served.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from bench.serve.faults import replica_pids, signal_pid

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

APP = "pdserve"
MODEL = "pdserve-tiny"
ACME = "sk-acme-overload"
ADMIN = "sk-admin-overload"
DEADLINE_S = 3.0  # the KV ticket deadline: an attempt on a stopped replica times out soon
FAILURE_THRESHOLD = 2
COOLDOWN_S = 30.0  # outlasts the checks below (a stats call may wait 5 s on the stopped replica)
REQUEST_TIMEOUT_S = 120.0
WAIT_S = 90.0  # bound of every polling loop below
STREAM_TIMEOUT_S = 10.0  # deadline of the streamed request: its first token comes long before


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_replicas": 2, "num_cpus": 0.4},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm", "deadline_s": DEADLINE_S},
        "local_prefill_threshold": 32,
        "limits": {"max_prompt_tokens": 1024, "max_output_tokens": 1024},
        "admission": {
            "classes": [
                {"name": "interactive", "ttft_s": 600.0, "tpot_s": 10.0, "priority": 0},
                # No prefill takes under a millisecond: shed whenever a rate is measured.
                {"name": "batch", "ttft_s": 0.001, "tpot_s": 10.0, "priority": 10},
            ]
        },
        "tenants": [{"name": "acme", "api_keys": [ACME], "default_class": "interactive"}],
        "admin_api_keys": [ADMIN],
        "overload": {"breaker": {"failure_threshold": FAILURE_THRESHOLD, "cooldown_s": COOLDOWN_S}},
    }


def long_prompt(i: int) -> str:
    """A distinct ~330-token prompt, prefilled remotely."""
    return f"{i:04d} a prompt long enough for the prefill pool, with its KV over shm. " * 5


def post(server: Server, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL, "temperature": 0, **body},
        headers={"Authorization": f"Bearer {ACME}", **(headers or {})},
        timeout=REQUEST_TIMEOUT_S,
    )


def complete(server: Server, prompt: str, max_tokens: int = 6) -> str:
    response = post(server, {"prompt": prompt, "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def decode_stats(server: Server) -> dict[str, Any]:
    stats = dict(server.stats()["pools"]["decode"])
    assert "error" not in stats, stats
    return stats


def counter(stats: dict[str, Any], name: str) -> int:
    return int(stats["counters"].get(name, 0))


def replica_name(pid: int) -> str:
    return f"prefill:prefill@{socket.gethostname()}:{pid}"


def breaker_state(stats: dict[str, Any], replica: str) -> str | None:
    replicas = stats.get("breakers", {}).get("prefill", {}).get("replicas", {})
    return replicas.get(replica, {}).get("state")


def reasons(stats: dict[str, Any]) -> list[str]:
    return [d["reason"] for d in stats["prefill_decisions"]]


def wait_for(predicate: Any, what: str, step: Any = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAIT_S}s waiting for {what}")
        if step is not None:
            step()
        time.sleep(0.2)


# ------------------------------------------------------------------ breaker and retries


def test_stopped_prefill_replica_retry_elsewhere_and_breaker(server: Server, hf: HFGreedy) -> None:
    pids = replica_pids(APP, "prefill")
    assert len(pids) == 2, pids
    stopped, healthy = (replica_name(pid) for pid in pids)
    prompts = iter(range(10_000))

    def serve_one() -> None:
        prompt = long_prompt(next(prompts))
        assert complete(server, prompt) == hf.complete(prompt, 6).text

    # Both replicas serve (the router breaks ties at random): both are known by name.
    wait_for(
        lambda: all(counter(decode_stats(server), f"prefill_ok:{r}") for r in (stopped, healthy)),
        "both prefill replicas to serve",
        step=serve_one,
    )
    assert signal_pid(pids[0], signal.SIGSTOP)
    try:
        before = decode_stats(server)
        # Rounds of 6 at once: about half first go to the stopped replica; the retries of
        # a round share the healthy one, and each must finish within the ticket deadline.
        with ThreadPoolExecutor(max_workers=6) as pool:
            for _ in range(4):
                list(pool.map(lambda _: serve_one(), range(6)))
                if breaker_state(decode_stats(server), stopped) == "open":
                    break
        after = decode_stats(server)

        def delta(name: str) -> int:
            return counter(after, name) - counter(before, name)

        failed = delta(f"prefill_failed:{stopped}")
        assert failed >= FAILURE_THRESHOLD, after["counters"]
        # Each failed attempt was retried once, on the other replica, and none had to fall
        # back to local prefill: no retry went back to the stopped replica.
        assert delta("prefill_retries") == failed
        assert delta("local_prefill_fallback") == 0
        assert delta(f"prefill_ok:{stopped}") == 0
        assert delta(f"prefill_ok:{healthy}") >= failed
        assert breaker_state(after, stopped) == "open"
        assert any(f"retry excluding failed {stopped}" in r for r in reasons(after))
        assert any(f"timed out on {stopped}" in r for r in reasons(after))

        # With the breaker open, the stopped replica is not even tried.
        serve_one()
        later = decode_stats(server)
        assert counter(later, f"prefill_failed:{stopped}") == counter(
            after, f"prefill_failed:{stopped}"
        )
        assert f"breaker open for {stopped}" in reasons(later)[-1]
    finally:
        assert signal_pid(pids[0], signal.SIGCONT)

    # After the cool-down one request probes the thawed replica, and its success closes it.
    wait_for(
        lambda: breaker_state(decode_stats(server), stopped) == "closed",
        "the breaker to close after SIGCONT",
        step=serve_one,
    )
    final = decode_stats(server)
    assert counter(final, f"prefill_ok:{stopped}") > counter(after, f"prefill_ok:{stopped}")
    assert any(f"probing half-open {stopped}" in r for r in reasons(final))
    assert final["breakers"]["prefill"]["replicas"][stopped]["num_opened"] >= 1


# ------------------------------------------------------------------------------ deadlines


def test_deadline_non_streaming_504(server: Server) -> None:
    (decode_pid,) = replica_pids(APP, "decode")
    bad = post(server, {"prompt": "x", "max_tokens": 2}, {"x-pdserve-timeout": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-pdserve-timeout"
    too_long = post(server, {"prompt": "x", "max_tokens": 2, "timeout": 10**6})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "timeout"
    assert signal_pid(decode_pid, signal.SIGSTOP)
    try:
        by_body = post(server, {"prompt": long_prompt(1), "max_tokens": 4, "timeout": 1})
        by_header = post(
            server,
            {"prompt": "short", "max_tokens": 4, "timeout": 500},
            {"x-pdserve-timeout": "1.5"},
        )
    finally:
        assert signal_pid(decode_pid, signal.SIGCONT)
    for response, timeout in ((by_body, "1"), (by_header, "1.5")):
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert error["code"] == "deadline_exceeded" and error["type"] == "timeout_error"
        assert f"within its timeout of {timeout} s" in error["message"]


def test_deadline_mid_stream_is_an_sse_error_event(server: Server) -> None:
    (decode_pid,) = replica_pids(APP, "decode")
    body = {
        "model": MODEL,
        "prompt": "stream until the deadline",
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "timeout": STREAM_TIMEOUT_S,
    }
    events: list[dict[str, Any]] = []
    stopped = False
    try:
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {ACME}"},
            timeout=REQUEST_TIMEOUT_S,
        ) as response:
            assert response.status_code == 200, response.read().decode()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line.removeprefix("data: ")))
                if not stopped:  # the stream has started: freeze decode until the deadline
                    stopped = signal_pid(decode_pid, signal.SIGSTOP)
    finally:
        if stopped:
            assert signal_pid(decode_pid, signal.SIGCONT)
    assert stopped and "choices" in events[0]
    error = events[-1].get("error")
    assert error is not None and error["code"] == "deadline_exceeded", events[-3:]
    assert sum(len(e.get("choices", [{}])[0].get("text", "")) for e in events[:-1]) < 1000


# ------------------------------------------------------------------------------ shedding


def test_batch_flood_is_shed_while_interactive_is_served(server: Server, hf: HFGreedy) -> None:
    batch = {"x-pdserve-slo-class": "batch"}
    prompts = iter(range(20_000, 30_000))
    shed: list[Any] = []

    def try_batch() -> None:
        response = post(server, {"prompt": long_prompt(next(prompts)), "max_tokens": 2}, batch)
        assert response.status_code in (200, 503), response.text
        if response.status_code == 503:
            shed.append(response)

    # Until the prefill pool has measured its rate (and the ingress has seen it), batch
    # requests are admitted: nothing is shed on missing data.
    wait_for(lambda: bool(shed), "a batch request to be shed", step=try_batch)
    first = shed[0]
    error = first.json()["error"]
    assert error["code"] == "overloaded" and error["type"] == "service_unavailable_error"
    assert int(first.headers["retry-after"]) >= 1
    assert "predicted TTFT" in first.headers["x-pdserve-route"]
    assert first.headers["x-pdserve-route"].endswith(": shed")

    prompt = long_prompt(31_000)
    with ThreadPoolExecutor(max_workers=9) as pool:
        flood = [
            pool.submit(post, server, {"prompt": long_prompt(i), "max_tokens": 2}, batch)
            for i in range(32_000, 32_008)
        ]
        interactive = pool.submit(post, server, {"prompt": prompt, "max_tokens": 6})
        results = [f.result() for f in flood]
        served = interactive.result()
    assert [r.status_code for r in results] == [503] * 8
    assert all(r.json()["error"]["code"] == "overloaded" for r in results)
    assert all(int(r.headers["retry-after"]) >= 1 for r in results)
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["text"] == hf.complete(prompt, 6).text
    assert served.headers["x-pdserve-route"].endswith(": admitted")
    recent = server.stats()["routing"]["recent"]
    assert sum(1 for r in recent if r.get("shed") == "overloaded") >= 9
