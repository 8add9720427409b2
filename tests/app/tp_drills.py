"""A fault drill shared by the tensor-parallel Serve tests: a prefill replica's rank 1 killed
mid-transfer, whatever carries its KV (rank 0's one endpoint, or its own)."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from bench.serve.faults import replica_pids, signal_pid, wait_for_new_replica
from tests.app.conftest import wait_until
from tests.app.test_serve_tp import _tp_workers

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

RESTART_TIMEOUT_S = 180.0


def _used_blocks(server: Server) -> dict[str, int]:
    pools = server.stats()["pools"]
    return {
        name: pool["num_blocks"] - pool["num_free_blocks"]
        for name, pool in pools.items()
        if "error" not in pool
    }


def kill_prefill_rank_mid_transfer(
    server: Server, hf: HFGreedy, app: str, model: str, max_tokens: int, prompts: list[str]
) -> None:
    """The prefill replica's rank 1 is stopped, so a prefill step (its ticket open, the
    decode blocks reserved) cannot finish; then it is killed. The request is answered
    (decode prefills it itself), every block of every pool is free, Serve replaces the
    prefill replica with a worker of its own, and the new one moves KV again.
    `prompts`: the one sent under the kill, then one for the new replica."""
    (prefill_pid,) = replica_pids(app, "prefill")
    (worker,) = _tp_workers()[prefill_pid]
    prompt, again = prompts
    expected = hf.complete(prompt, max_tokens).text
    decode_before = server.stats()["pools"]["decode"]["counters"]
    started = server.stats()["pools"]["prefill"]["counters"].get("requests", 0)
    assert signal_pid(worker, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(
                server.openai().completions.create,
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
            )
            # The prefill call arrived and decode holds the ticket's blocks: mid-transfer.
            wait_until(
                lambda: (
                    server.stats()["pools"]["prefill"]["counters"].get("requests", 0) > started
                    and _used_blocks(server).get("decode", 0) > 0
                ),
                60,
                "the prefill call under way with decode blocks reserved",
            )
            assert signal_pid(worker, signal.SIGKILL)
            assert answer.result(timeout=120).choices[0].text == expected
    finally:
        signal_pid(worker, signal.SIGCONT)  # harmless once it is gone
    counters = server.stats()["pools"]["decode"]["counters"]
    assert counters.get("local_prefill_fallback", 0) > decode_before.get(
        "local_prefill_fallback", 0
    ), counters
    wait_until(lambda: not server.busy_pools(), 60, "decode's reserved blocks back in its pool")
    new_pid = wait_for_new_replica(app, "prefill", {prefill_pid}, RESTART_TIMEOUT_S)
    assert new_pid is not None, "Serve did not replace the prefill replica"
    wait_until(
        lambda: prefill_pid not in _tp_workers() and len(_tp_workers().get(new_pid, [])) == 1,
        60,
        "the old replica's worker gone, the new replica's one worker up",
    )
    # The new replica moves KV again (decode may first prefill locally while its breaker
    # on the old replica cools down).
    done = threading.Event()

    def remote_again() -> bool:
        before = server.stats()["pools"]["decode"]["counters"].get("remote_prefill", 0)
        out = server.openai().completions.create(
            model=model, prompt=again, max_tokens=max_tokens, temperature=0
        )
        assert out.choices[0].text == hf.complete(again, max_tokens).text
        if server.stats()["pools"]["decode"]["counters"].get("remote_prefill", 0) > before:
            done.set()
        return done.is_set()

    wait_until(remote_again, RESTART_TIMEOUT_S, "a remote prefill through the new replica")
    wait_until(lambda: not server.busy_pools(), 30, "every block free at the end")
