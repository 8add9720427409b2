"""A replica dies: requests still finish correctly, nothing hangs, no KV is stranded.

The prefill replica is killed (as a crashed process would be) while requests are in
flight; decode retries once, then prefills locally, and Serve restarts the replica.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import ray

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
PROMPT = "a prompt of a few hundred bytes, so its prefill and KV hand-off take a while. " * 4


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1, "kv_cache_bytes": 32 * 1024**2},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm", "deadline_s": 5.0},
        "local_prefill_threshold": 0,
    }


def kill_replicas(deployment: str) -> int:
    """Kill every replica actor of `deployment` in the pdserve app; Serve restarts them."""
    killed = 0
    for info in ray.util.list_named_actors(all_namespaces=True):
        if info["name"].startswith(f"SERVE_REPLICA::pdserve#{deployment}#"):
            ray.kill(ray.get_actor(info["name"], namespace=info["namespace"]), no_restart=True)
            killed += 1
    return killed


def test_prefill_replica_killed_mid_request(server: Server, hf: HFGreedy) -> None:
    expected = hf.complete(PROMPT, 16).text
    client = server.openai()

    def complete() -> str:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
        return out.choices[0].text

    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(complete) for _ in range(3)]  # in flight when it dies
        time.sleep(0.2)
        assert kill_replicas("prefill") == 1
        futures += [pool.submit(complete) for _ in range(3)]  # sent to a dead replica
        texts = [f.result(timeout=120) for f in futures]
    assert texts == [expected] * 6
    counters = server.stats()["pools"]["decode"]["counters"]
    finished = counters.get("remote_prefill", 0) + counters.get("local_prefill_fallback", 0)
    assert finished == 6


def test_service_recovers_after_prefill_replica_restarts(server: Server, hf: HFGreedy) -> None:
    expected = hf.complete("after the restart", 12).text
    deadline = time.monotonic() + 120
    while True:  # Serve brings a new prefill replica up; remote prefill works again
        out = server.openai().completions.create(
            model=MODEL, prompt="after the restart", max_tokens=12, temperature=0
        )
        assert out.choices[0].text == expected
        prefill = server.stats()["pools"]["prefill"]  # {"error": ...} while it is not answering
        if prefill.get("counters", {}).get("requests", 0) > 0:
            break
        assert time.monotonic() < deadline, "prefill replica never came back"
        time.sleep(1)
