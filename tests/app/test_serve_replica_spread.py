"""A burst of streams spreads over a pool's replicas, in a real app (`app/serve/replica_router.py`).

Two colocated replicas in one pool. One long stream runs first, long enough for the
replicas' routing reports to show it; then a burst of streams arrives within a fraction of
a stats period. Ranked by those reports alone, every stream of the burst went to the other
replica (it looked freer until its next report); counting what the ingress has in flight,
the router splits them so that the two replicas hold the same number of streams, give or
take one. Each replica's count comes from Serve's replica actor itself
(`get_num_ongoing_requests`), while every stream is still running (EOS ignored); the
outputs equal `transformers` up to its EOS, and every KV block is free afterwards (the
conftest's check).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from bench.serve.faults import REPLICA_PREFIX
from tests.app.conftest import wait_until

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
BURST = 6
MAX_TOKENS = 2000  # many seconds of decoding on `tiny` (EOS ignored): all run when counted
FIRST_MAX_TOKENS = 3000  # the first stream also outlives the wait for the reports
REPORT_WAIT_S = 2.5  # > the stats period (1 s) and Serve's push: reports show the first
STREAMS_TIMEOUT_S = 120.0


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1},
        "pools": [{"name": "decode", "role": "decode", "num_cpus": 0.5, "num_replicas": 2}],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": 4097,  # colocated: every prompt prefilled where it decodes
        "limits": {"max_prompt_tokens": 4096, "max_output_tokens": FIRST_MAX_TOKENS},
    }


def ongoing_by_replica() -> dict[str, int]:
    """Each decode replica's requests in progress, as its Serve replica actor counts them."""
    import ray
    from ray._private import state

    prefix = f"{REPLICA_PREFIX}pdserve#decode#"
    names = [
        str(info["Name"])
        for info in state.actors(actor_state_name="ALIVE").values()
        if str(info.get("Name") or "").startswith(prefix)
    ]
    actors = {name: ray.get_actor(name, namespace="serve") for name in names}
    return {name: ray.get(a.get_num_ongoing_requests.remote()) for name, a in actors.items()}


def test_a_burst_spreads_over_the_replicas(server: Server, hf: HFGreedy) -> None:
    client = server.openai()
    started = threading.Semaphore(0)

    def run(prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},  # `tiny` greedy hits EOS at 533-1298 tokens
        )
        text, first = "", True
        for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if first:
                started.release()
                first = False
        return text

    prompts = [f"burst {i:04d}" for i in range(BURST + 1)]
    with ThreadPoolExecutor(BURST + 1) as pool:
        futures = [pool.submit(run, prompts[0], FIRST_MAX_TOKENS)]
        assert started.acquire(timeout=STREAMS_TIMEOUT_S), "the first stream never started"
        time.sleep(REPORT_WAIT_S)
        futures += [pool.submit(run, p) for p in prompts[1:]]
        for _ in range(BURST):
            assert started.acquire(timeout=STREAMS_TIMEOUT_S), "a burst stream never started"
        counts = ongoing_by_replica()
        assert all(not f.done() for f in futures), "a stream ended before the count"
        texts = [f.result(timeout=STREAMS_TIMEOUT_S) for f in futures]

    assert len(counts) == 2 and sum(counts.values()) == BURST + 1, counts
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    # Batched with the others; past EOS (where `transformers` stops) the stream goes on.
    assert texts[1].startswith(hf.complete(prompts[1], MAX_TOKENS).text)
    wait_until(lambda: sum(ongoing_by_replica().values()) == 0, 30, "the replicas to go idle")
