"""A replica's local prefill rate (`EngineReplica.local_prefill`, the decode pool's
`prefill_tokens_per_s`) counts a prompt's compute, not its wait for the engine: the ingress
adds the wait itself, from the replica's queued tokens (`app/routing/adaptive.py`); and
prompts computed in the same steps share those steps' time (`PrefillRate`)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.request import SamplingParams
from replica.engine_replica import EngineReplica, PrefillRate

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


def test_prompts_computed_together_share_their_time() -> None:
    rate = PrefillRate(window_s=60.0)
    assert rate.tokens_per_s(now=0.0) == 0.0
    for _ in range(4):  # four prompts of one step: 512 tokens in 1 s, not 128
        rate.add(128, start=10.0, end=11.0)
    assert rate.tokens_per_s(now=11.0) == 512.0
    rate.add(100, start=20.0, end=20.5)  # apart: its own half second
    assert rate.tokens_per_s(now=21.0) == 612.0 / 1.5
    rate.add(50, start=20.25, end=21.0)  # half inside the last one
    assert rate.tokens_per_s(now=21.0) == 662.0 / 2.0
    rate.add(10, start=20.25, end=20.5)  # inside the others: tokens, no time
    assert rate.tokens_per_s(now=21.0) == 672.0 / 2.0
    rate.add(28, start=21.0, end=21.5)  # touching the last: its own half second
    assert rate.tokens_per_s(now=21.5) == 700.0 / 2.5
    rate.add(0, start=30.0, end=31.0)  # no tokens, or no time: no sample
    rate.add(10, start=31.0, end=31.0)
    assert rate.tokens_per_s(now=31.0) == 700.0 / 2.5
