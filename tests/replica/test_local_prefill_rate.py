"""A replica's local prefill rate (`EngineReplica.local_prefill`, the decode pool's
`prefill_tokens_per_s`) counts a prompt's compute, not its wait for the engine: the ingress
adds the wait itself, from the replica's queued tokens (`app/routing/adaptive.py`)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.request import SamplingParams
from replica.engine_replica import EngineReplica

PROMPT = list(range(3, 67))  # 64 tokens
HOLD_S = 2.0  # the engine thread held this long before it can schedule the prompt
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def replica():
    config = replace(EngineConfig(model_dir="tiny"), num_threads=1)
    replica = EngineReplica("decode:test", config)
    yield replica
    replica.shutdown()


async def _generate_behind_a_held_engine(replica: EngineReplica, spare: bool) -> float:
    """Generate one token of `PROMPT` while the engine thread is held for `HOLD_S` first;
    returns the seconds from the release to the end of the generation."""
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        held.set()
        release.wait(DEADLINE_S)

    blocker = replica.loop.call(hold)
    assert await asyncio.to_thread(held.wait, DEADLINE_S)
    request = replica.engine.make_request(
        PROMPT, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), spare=spare
    )

    async def run() -> list[int]:
        tokens: list[int] = []
        async for delta in replica.generate_whole(request):
            tokens.extend(delta.new_token_ids)
        return tokens

    task = asyncio.create_task(run())
    await asyncio.sleep(HOLD_S)  # the request waits behind the held engine meanwhile
    released = time.monotonic()
    release.set()
    tokens = await asyncio.wait_for(task, DEADLINE_S)
    assert blocker.result(DEADLINE_S) is None and len(tokens) == 1
    return time.monotonic() - released


def test_the_rate_leaves_out_the_wait_before_the_first_step(replica) -> None:
    assert replica.local_prefill.tokens_per_s() == 0.0
    compute_s = asyncio.run(_generate_behind_a_held_engine(replica, spare=False))
    rate = replica.local_prefill.tokens_per_s()
    # Tokens over at most the time after the release: the held second is not in it (counted
    # from submit, the rate would be below len(PROMPT) / HOLD_S = 32 tokens/s).
    assert rate >= len(PROMPT) / compute_s
    assert rate > len(PROMPT) / HOLD_S


def test_a_spare_request_is_not_timed(replica) -> None:
    before = replica.local_prefill.tokens_per_s()
    asyncio.run(_generate_behind_a_held_engine(replica, spare=True))
    assert replica.local_prefill.tokens_per_s() == before
