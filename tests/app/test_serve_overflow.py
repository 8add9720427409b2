"""Decode overflow end to end: a prefill pool with `serves_decode` takes whole requests
while the decode pool is busier, in a real app, driven by the official `openai` client.

One prefill replica (serves_decode) and one decode replica. Idle, a chat turn is served by
the decode replica as the static rule says; a burst of concurrent chat turns is split
between the two pools, each overflowed request served whole (prefill and decode) by the
prefill replica, which the `x-pdserve-route` header and the routing report say. Greedy
output equals `transformers` wherever a request ran, and every pool's KV blocks are free
afterwards (the conftest's check after each test).

Last, a drill: the prefill replica is SIGKILLed while it streams overflowed whole requests.
Those streams end with an error event that says the replica was lost (a stream not started
yet gets a 503 `replica_lost` naming its route; no hang; one that had not reached the
replica may be served in full by its successor), the requests on the decode replica finish
with the tokens they get alone, Serve restarts the replica, and nothing stays queued or
holds KV blocks.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from bench.serve.faults import replica_pids, signal_pid, wait_for_new_replica
from tests.app.conftest import wait_until

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
THRESHOLD = 32
MAX_TOKENS = 24
BURST = 8
SHORT_OUTPUT = 8  # serve_whole_max_output_tokens: fewer than MAX_TOKENS
LOADS_TIMEOUT_S = 60.0  # until the ingress has seen both pools' loads
LONG_TOKENS = 600  # the drill's streams: still running when the replica is killed
RESTART_TIMEOUT_S = 180.0  # Serve notices the dead replica and starts another within this


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5, "serves_decode": True},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": THRESHOLD,
        "limits": {"max_prompt_tokens": 1024, "max_output_tokens": LONG_TOKENS},
        # Loads stay usable for the whole of a slow test run.
        "adaptive_prefill": {
            "enabled": True,
            "max_age_s": 30.0,
            "decode_overflow_gap": 2,
            "serve_whole_max_output_tokens": SHORT_OUTPUT,
        },
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
        return "on decode vs" in seen[-1]

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


def test_short_outputs_are_served_whole_where_less_is_in_flight(
    server: Server, hf: HFGreedy
) -> None:
    """A long prompt asking for at most `serve_whole_max_output_tokens` is served whole (no
    KV moves) on the pool with less in flight (prompt tokens, then requests), as the
    route's figures say: on the prefill replica, or prefilled locally on the decode
    replica. Sent one at a time until the ingress has both pools' loads, then as a burst
    that spreads over both; each answer's tokens equal `transformers`' greedy output, and
    the replicas' counters show the branches the routes name."""
    prompt = "a document of some length to be summed up in a few words: "
    short = rf"short output: max_tokens {SHORT_OUTPUT} <= {SHORT_OUTPUT}"
    one = r"(\d+) tokens, ([\d.]+) requests on"
    placed = rf"{short}, per replica {one} prefill, {one} decode -> served whole on (\w+)$"

    def ask(i: int) -> tuple[str, str, str]:
        """(the prompt, the answer's text, its route)."""
        text = f"{prompt}{i:04d} " * 4
        raw = server.openai().completions.with_raw_response.create(
            model=MODEL, prompt=text, max_tokens=SHORT_OUTPUT, temperature=0
        )
        route = raw.headers["x-pdserve-route"]
        assert "-> pool prefill" in route, route
        return text, str(raw.parse().choices[0].text), route

    def check(answers: list[tuple[str, str, str]]) -> list[str]:
        for text, answer, _ in answers:
            assert answer == hf.complete(text, SHORT_OUTPUT).text, text
        return [route for _, _, route in answers]

    def branches(routes: list[str]) -> Counter[str]:
        found: Counter[str] = Counter()
        for route in routes:
            match = re.search(placed, route)
            assert match, route
            prefill = (float(match[1]), float(match[2]))
            decode = (float(match[3]), float(match[4]))
            if prefill != decode:  # ties take turns
                assert match[5] == ("decode" if decode < prefill else "prefill"), route
            found[match[5]] += 1
        return found

    def counted(before: tuple[Counter[str], Counter[str]]) -> Counter[str]:
        prefill, decode = counters(server, "prefill"), counters(server, "decode")
        assert decode["remote_prefill"] == before[1]["remote_prefill"]  # no KV moved
        whole = prefill["whole_requests"] - before[0]["whole_requests"]
        local = decode["local_prefill"] - before[1]["local_prefill"]
        return Counter({"prefill": whole, "decode": local}) - Counter()

    sent: list[int] = []

    def one() -> bool:
        before = counters(server, "prefill"), counters(server, "decode")
        sent.append(len(sent))
        [route] = check([ask(sent[-1])])
        if short not in route:  # no loads yet: placed as any prompt
            return False
        assert counted(before) == branches([route])
        return True

    wait_until(one, LOADS_TIMEOUT_S, "the ingress to see both pools' loads")
    before = counters(server, "prefill"), counters(server, "decode")
    with ThreadPoolExecutor(BURST) as pool:
        routes = check(list(pool.map(ask, range(1000, 1000 + BURST))))
    found = branches(routes)
    assert counted(before) == found
    assert found["decode"] and found["prefill"], routes


# ---- drill: the prefill replica dies while it serves whole requests --------------------


def stream(server: Server, prompt: str, out: dict[str, Any], whole: threading.Event) -> None:
    """A greedy streamed completion of `LONG_TOKENS` tokens (EOS ignored); fills `out` with
    its `route`, `text` and `events` as they come, so a killed stream's part is kept. Sets
    `whole` once it is served whole on the prefill replica and has had its first tokens.
    A stream whose replica died before its first token is a 503 `replica_lost` naming its
    route; its error body is kept as its last event."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    timeout = httpx.Timeout(120.0, read=30.0)  # a silent stream is a hung one
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=timeout
    ) as response:
        out["route"] = response.headers["x-pdserve-route"]
        if response.status_code == 503:
            out["events"].append(json.loads(response.read()))
            return
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line.removeprefix("data: "))
                out["events"].append(event)
                out["text"] += "".join(c.get("text") or "" for c in event.get("choices") or [])
                if out["text"] and "served whole on prefill" in out["route"]:
                    whole.set()


def test_prefill_killed_while_serving_whole_requests(server: Server) -> None:
    def prefill_seen_idle() -> bool:
        """The ingress's latest load of the prefill replica is an idle one's: a report
        from the last test's burst (up to BURST + 2) could still stand a stats period or
        two after it, and the burst below never overflows onto a replica seen that busy."""
        seen = re.search(r"vs ([\d.]+) on prefill", complete(server, "warm before the drill")[1])
        return seen is not None and float(seen[1]) < 2.0

    wait_until(prefill_seen_idle, LOADS_TIMEOUT_S, "the ingress to see the prefill replica idle")
    [pid] = replica_pids("pdserve", "prefill")
    prompts = [f"drill stream {i:04d}" for i in range(BURST)]
    outs: list[dict[str, Any]] = [{"route": "", "text": "", "events": []} for _ in prompts]
    # Killed as soon as the client sees an overflowed stream's first tokens, which is
    # certain to be mid-stream: the replica's load report may lag a stream that decodes fast.
    whole = threading.Event()
    with ThreadPoolExecutor(BURST) as pool:
        futures = [
            pool.submit(stream, server, p, o, whole) for p, o in zip(prompts, outs, strict=True)
        ]
        deadline = time.monotonic() + LOADS_TIMEOUT_S
        while not whole.wait(0.1):
            if all(f.done() for f in futures) or time.monotonic() > deadline:
                [f.result() for f in futures if f.done()]  # a stream's own error first
                pytest.fail(f"no stream served whole on prefill: {[o['route'] for o in outs]}")
        assert signal_pid(pid, signal.SIGKILL)
        for future in futures:
            future.result(timeout=120)  # every stream ends: none hangs

    # Streams on the killed replica end with `replica_lost`: mid-stream (an error event) or
    # before their first token (a 503). One that had not reached it yet may be served whole
    # by the restarted replica, in full; a stream on the decode replica is untouched.
    on_prefill = [o for o in outs if "served whole on prefill" in o["route"]]
    killed = [o for o in on_prefill if "error" in o["events"][-1]]
    assert killed and len(on_prefill) < BURST, [o["route"] for o in outs]
    for out in killed:
        assert out["events"][-1]["error"]["code"] == "replica_lost", out["events"][-1]
    assert any(out["text"] for out in killed)  # the one whose tokens set off the kill
    new_pid = wait_for_new_replica("pdserve", "prefill", {pid}, RESTART_TIMEOUT_S)
    assert new_pid is not None, "Serve did not restart the prefill replica"
    # Every other request got the tokens it gets alone (greedy, EOS ignored).
    survived = [(p, o) for p, o in zip(prompts, outs, strict=True) if o not in killed]
    for prompt, out in survived:
        assert "error" not in out["events"][-1], out["events"][-1]
        again = server.openai().completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=LONG_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out["text"] == again.choices[0].text, prompt
