"""Multi-turn conversations through a decode replica and a prefill replica (one process,
KV over loopback `tcp`, and `shm` for the suffix-only route): every turn is token-identical
to `transformers` greedy on every route, later turns compute and move only what the caches
lack, tenants never share blocks, and a transfer that fails or is cancelled midway leaves
the cached prefix intact and every block free.

Routes: local (no prefill pool), remote with full transfer (the decode replica caches
nothing), remote suffix-only (the ticket skips the prefix decode holds), local suffix (a
short rest after the cached prefix is prefilled on decode), and all of them mixed under KV
pressure (small caches: prefixes are evicted, reservations do not fit, requests are
preempted). Prompts cross block (16 tokens) and chunk (40 tokens) boundaries.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from decode.server import DecodeServer
from engine.builtin import write_builtin_model
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from kvtransfer import Ticket, TransferOptions, TransferState
from prefill.server import PrefillServer
from replica.protocol import GenerationSpec
from tests.decode.conversation import (
    ANSWER_TOKENS,
    Conversation,
    HFGreedyIds,
    blocks_kv,
    cached_block_ids,
)

NUM_TURNS = 6
BLOCK = 16
CHUNKED = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=40)
BYTES_PER_BLOCK = 2 * 2 * BLOCK * 2 * 16 * 4  # tiny: 2 layers x K,V x 16 slots x 2 heads x 16
_ids = itertools.count()


class RecordingHandle:
    """A prefill pool of one in-process replica (`handle.prefill.remote(...)`), keeping
    every ticket it was given; `fail` makes calls fail before reaching the replica."""

    def __init__(self, server: PrefillServer) -> None:
        self.server = server
        self.tickets: list[Ticket] = []
        self.fail = False

    @property
    def prefill(self) -> RecordingHandle:
        return self

    def remote(self, spec: object, ticket: Ticket) -> asyncio.Future:
        self.tickets.append(ticket)
        if self.fail:

            async def dead() -> None:
                raise ConnectionError("prefill replica died")

            return asyncio.ensure_future(dead())
        return asyncio.ensure_future(self.server.prefill(spec, ticket))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> HFGreedyIds:
    return HFGreedyIds(model_dir)


def make_servers(
    model_dir: Path,
    *,
    decode_prefix_cache: bool = True,
    num_blocks: int | None = None,
    local_prefill_threshold: int = 0,
    backend: str = "tcp",
) -> tuple[PrefillServer, DecodeServer, RecordingHandle]:
    cache = CacheConfig()
    if num_blocks is not None:
        cache = replace(cache, kv_cache_bytes=num_blocks * BYTES_PER_BLOCK)
    config = EngineConfig(model_dir=str(model_dir), cache=cache, scheduler=CHUNKED)
    options = TransferOptions(fence_timeout_s=2.0, reap_interval_s=0.02)
    prefill = PrefillServer(config, backend=backend, transfer_options=options)
    handle = RecordingHandle(prefill)
    decode_cache = replace(cache, enable_prefix_caching=decode_prefix_cache)
    decode = DecodeServer(
        replace(config, cache=decode_cache),
        backend=backend,
        transfer_options=options,
        prefill_pools={"p": handle},
        deadline_s=10,
        local_prefill_threshold=local_prefill_threshold,
    )
    return prefill, decode, handle


@pytest.fixture()
def servers(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[tuple]:
    made = make_servers(model_dir, **getattr(request, "param", {}))
    yield made
    made[1].shutdown()
    made[0].shutdown()


async def turn(
    decode: DecodeServer, conversation: Conversation, tenant: str = "t", pool: str | None = "p"
) -> RequestOutput:
    """Send the conversation's next turn; record its answer; return the final delta."""
    spec = GenerationSpec(
        request_id=f"turn-{next(_ids)}",
        prompt_token_ids=tuple(conversation.next_prompt()),
        sampling_params=SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True),
        tenant=tenant,
        prefill_pool=pool,
    )
    tokens: list[int] = []
    last = None
    async for delta in decode.generate(spec):
        assert delta.error is None, delta.error
        tokens.extend(delta.new_token_ids)
        last = delta
    assert last is not None and last.finished
    conversation.answered(tokens)
    return last


def run_turn(decode: DecodeServer, conversation: Conversation, **kwargs: object) -> RequestOutput:
    return asyncio.run(turn(decode, conversation, **kwargs))  # type: ignore[arg-type]


def assert_greedy(hf: HFGreedyIds, conversation: Conversation) -> None:
    turns = zip(conversation.prompts, conversation.answers, strict=True)
    for k, (prompt, answer) in enumerate(turns):
        assert answer == hf.greedy(prompt, ANSWER_TOKENS), f"turn {k} differs"


def assert_all_free(prefill: PrefillServer, decode: DecodeServer) -> None:
    """Every block of both replicas free (cached blocks included), nothing reserved, no
    transfer open or fenced on decode."""

    def free(server: PrefillServer | DecodeServer) -> bool:
        def check() -> bool:
            engine = server.engine
            return engine.kv_manager.pool.num_used_blocks == 0 and not engine.scheduler.requests

        return server.replica.loop.call(check).result(timeout=10)

    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not (
        free(prefill) and free(decode) and not decode.reservations.entries
    ):
        time.sleep(0.02)
    assert free(prefill) and free(decode)
    assert decode.reservations.entries == {}
    assert decode.receiver is not None
    assert decode.receiver.transfer_counts() == {
        "num_open": 0,
        "num_fenced": 0,
        "num_quarantined": 0,
    }


def held_blocks(engine_prompt_tokens: int, answer_tokens: int = ANSWER_TOKENS) -> int:
    """Tokens of the full blocks a replica caches after decoding a turn: the prompt and
    every answer token but the last, which is sampled, never computed."""
    return (engine_prompt_tokens + answer_tokens - 1) // BLOCK * BLOCK


# ---- routes ------------------------------------------------------------------------------


def test_local_route_reuses_decodes_own_prefix(servers, hf: HFGreedyIds) -> None:
    prefill, decode, handle = servers
    conversation = Conversation(seed=1)
    finals = [run_turn(decode, conversation, pool=None) for _ in range(NUM_TURNS)]
    assert_greedy(hf, conversation)
    assert handle.tickets == []
    assert finals[0].num_cached_tokens == 0
    for k in range(1, NUM_TURNS):
        # turn k-1's prompt and its answer (the last token aside) are cached on decode
        assert finals[k].num_cached_tokens == held_blocks(len(conversation.prompts[k - 1]))
        assert finals[k].num_transferred_tokens == 0
    assert_all_free(prefill, decode)


@pytest.mark.parametrize("servers", [{"decode_prefix_cache": False}], indirect=True)
def test_remote_full_transfer_when_decode_holds_nothing(servers, hf: HFGreedyIds) -> None:
    prefill, decode, handle = servers
    conversation = Conversation(seed=2)
    finals = [run_turn(decode, conversation) for _ in range(NUM_TURNS)]
    assert_greedy(hf, conversation)
    for k, final in enumerate(finals):
        prompt = conversation.prompts[k]
        assert final.num_transferred_tokens == len(prompt)
        assert handle.tickets[k].num_cached_blocks == 0
        # the prefill replica reused the previous prompt from its own prefix cache
        prefill_hit = len(conversation.prompts[k - 1]) // BLOCK * BLOCK if k else 0
        assert final.num_cached_tokens == prefill_hit
    counters = decode.stats()["counters"]
    total = sum(len(p) for p in conversation.prompts)
    assert counters["transferred_tokens"] == counters["full_transfer_tokens"] == total
    assert_all_free(prefill, decode)


@pytest.mark.parametrize("servers", [{"backend": "tcp"}, {"backend": "shm"}], indirect=True)
def test_remote_suffix_only_moves_what_decode_lacks(servers, hf: HFGreedyIds) -> None:
    prefill, decode, handle = servers
    conversation = Conversation(seed=3)
    finals = [run_turn(decode, conversation) for _ in range(NUM_TURNS)]
    assert_greedy(hf, conversation)
    assert finals[0].num_transferred_tokens == len(conversation.prompts[0])
    moved = len(conversation.prompts[0])
    for k in range(1, NUM_TURNS):
        prompt, previous = conversation.prompts[k], conversation.prompts[k - 1]
        skipped = held_blocks(len(previous))
        assert handle.tickets[k].num_cached_blocks == skipped // BLOCK
        assert handle.tickets[k].num_blocks == -(-len(prompt) // BLOCK) - skipped // BLOCK
        assert finals[k].num_transferred_tokens == len(prompt) - skipped
        assert finals[k].num_cached_tokens == len(previous) // BLOCK * BLOCK  # prefill's hit
        moved += len(prompt) - skipped
    total = sum(len(p) for p in conversation.prompts)
    decode_counters, prefill_counters = decode.stats()["counters"], prefill.stats()["counters"]
    assert decode_counters["transferred_tokens"] == prefill_counters["transferred_tokens"] == moved
    assert decode_counters["full_transfer_tokens"] == total
    assert decode_counters["cached_tokens"] == total - moved
    assert prefill_counters["computed_tokens"] == total - sum(f.num_cached_tokens for f in finals)
    assert_all_free(prefill, decode)


@pytest.mark.parametrize("servers", [{"local_prefill_threshold": 100}], indirect=True)
def test_short_suffix_is_prefilled_on_decode(servers, hf: HFGreedyIds) -> None:
    prefill, decode, handle = servers
    conversation = Conversation(seed=4)
    finals = [run_turn(decode, conversation) for _ in range(NUM_TURNS)]
    assert_greedy(hf, conversation)
    assert len(handle.tickets) == 1  # only the first turn went to the prefill replica
    assert finals[0].num_transferred_tokens == len(conversation.prompts[0])
    for k in range(1, NUM_TURNS):
        assert finals[k].num_transferred_tokens == 0
        assert finals[k].num_cached_tokens == held_blocks(len(conversation.prompts[k - 1]))
    counters = decode.stats()["counters"]
    assert counters["local_suffix_prefill"] == NUM_TURNS - 1
    later = zip(conversation.prompts[1:], finals[1:], strict=True)
    computed = sum(len(prompt) - final.num_cached_tokens for prompt, final in later)
    assert counters["computed_tokens"] == computed
    assert_all_free(prefill, decode)


def test_every_route_under_kv_pressure(model_dir: Path, hf: HFGreedyIds) -> None:
    """Three conversations at once on 30-block caches (a final prompt needs 18): prefixes
    are evicted between turns, reservations miss room (local prefill), decoding preempts."""
    prefill, decode, handle = make_servers(model_dir, num_blocks=30, local_prefill_threshold=40)
    try:
        conversations = [Conversation(seed=10 + i) for i in range(3)]
        pools = ["p", "p", None]

        async def rounds() -> list[list[RequestOutput]]:
            finals: list[list[RequestOutput]] = []
            for _ in range(NUM_TURNS):
                turns = (turn(decode, c, pool=p) for c, p in zip(conversations, pools, strict=True))
                finals.append(list(await asyncio.gather(*turns)))
            return finals

        finals = asyncio.run(rounds())
        for conversation in conversations:
            assert_greedy(hf, conversation)
        # Some later remote turn found less of its history than an unbounded cache holds.
        evicted = [
            (k, i)
            for k in range(1, NUM_TURNS)
            for i in range(2)
            if finals[k][i].num_transferred_tokens > 0
            and len(conversations[i].prompts[k]) - finals[k][i].num_transferred_tokens
            < held_blocks(len(conversations[i].prompts[k - 1]))
        ]
        occupancy = decode.loop.occupancy
        assert evicted or occupancy["num_preemptions"] > 0
        assert_all_free(prefill, decode)
    finally:
        decode.shutdown()
        prefill.shutdown()


# ---- tenants -----------------------------------------------------------------------------


def test_tenants_never_share_blocks(servers, hf: HFGreedyIds) -> None:
    prefill, decode, handle = servers
    first, second = Conversation(seed=5), Conversation(seed=5)  # the same tokens
    for _ in range(3):
        run_turn(decode, first, tenant="a")
    finals = [run_turn(decode, second, tenant="b") for _ in range(3)]
    assert first.answers == second.answers
    assert_greedy(hf, second)
    # b's first turn found nothing of a's identical prompt: all of it moved
    assert finals[0].num_transferred_tokens == len(second.prompts[0])
    assert finals[0].num_cached_tokens == 0  # on the prefill replica neither
    history = second.prompts[-1] + second.answers[-1]
    blocks_a = cached_block_ids(decode.engine, history, "a")
    blocks_b = cached_block_ids(decode.engine, history, "b")
    assert blocks_a and blocks_b and not set(blocks_a) & set(blocks_b)
    assert_all_free(prefill, decode)


# ---- failures midway ---------------------------------------------------------------------


def test_failed_transfer_midway_leaves_the_cached_prefix_intact(servers, hf: HFGreedyIds) -> None:
    """A transfer aborted after its first layer on every attempt: the request is prefilled
    locally; the pinned prefix's blocks, KV and cache entries are as before."""
    prefill, decode, handle = servers
    conversation = Conversation(seed=6)
    for _ in range(2):
        run_turn(decode, conversation)
    history = conversation.prompts[-1] + conversation.answers[-1]
    pinned = cached_block_ids(decode.engine, history, "t")
    assert pinned
    before = blocks_kv(decode.engine, pinned)
    send_layer = prefill.sender.send_layer
    aborted: list[str] = []

    def abort_after_first_layer(ticket: Ticket, layer: int, *args: object) -> None:
        if layer == 0:
            send_layer(ticket, layer, *args)  # type: ignore[arg-type]
        else:
            aborted.append(ticket.request_id)
            prefill.sender.abort(ticket.request_id)

    prefill.sender.send_layer = abort_after_first_layer  # type: ignore[method-assign]
    final = run_turn(decode, conversation)
    prefill.sender.send_layer = send_layer  # type: ignore[method-assign]
    assert len(aborted) == 2  # the first attempt and its retry
    assert all(t.num_cached_blocks == len(pinned) for t in handle.tickets[-2:])
    assert decode.stats()["counters"]["local_prefill_fallback"] == 1
    assert final.num_transferred_tokens == 0
    assert_all_free(prefill, decode)
    assert cached_block_ids(decode.engine, history, "t") == pinned
    assert blocks_kv(decode.engine, pinned).equal(before)
    for _ in range(NUM_TURNS - 3):
        run_turn(decode, conversation)
    assert_greedy(hf, conversation)
    assert_all_free(prefill, decode)


def test_cancel_mid_transfer_leaves_the_cached_prefix_intact(servers, hf: HFGreedyIds) -> None:
    """The client goes away while the KV of a suffix-only transfer is landing."""
    prefill, decode, handle = servers
    conversation = Conversation(seed=7)
    for _ in range(2):
        run_turn(decode, conversation)
    history = conversation.prompts[-1] + conversation.answers[-1]
    pinned = cached_block_ids(decode.engine, history, "t")
    before = blocks_kv(decode.engine, pinned)
    send_layer = prefill.sender.send_layer
    layer_sent = asyncio.Event()
    loop: asyncio.AbstractEventLoop | None = None

    def signal_after_first_layer(ticket: Ticket, layer: int, *args: object) -> None:
        send_layer(ticket, layer, *args)  # type: ignore[arg-type]
        if layer == 0:
            assert loop is not None
            loop.call_soon_threadsafe(layer_sent.set)
            # The engine thread stays inside the step until the cancel has aborted the
            # transfer where it lands: the later layers meet an aborted transfer.
            assert decode.receiver is not None
            deadline = time.monotonic() + 30
            while decode.receiver.poll(ticket.request_id) is not TransferState.ABORTED:
                assert time.monotonic() < deadline, "the cancel never aborted the transfer"
                time.sleep(0.01)

    async def cancelled_turn() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(turn(decode, conversation))
        await layer_sent.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    prefill.sender.send_layer = signal_after_first_layer  # type: ignore[method-assign]
    asyncio.run(cancelled_turn())
    prefill.sender.send_layer = send_layer  # type: ignore[method-assign]
    tid = handle.tickets[-1].request_id
    assert handle.tickets[-1].num_cached_blocks == len(pinned)
    assert_all_free(prefill, decode)
    assert decode.receiver is not None
    assert decode.receiver.poll(tid) is TransferState.ABORTED
    assert cached_block_ids(decode.engine, history, "t") == pinned
    assert blocks_kv(decode.engine, pinned).equal(before)
    conversation.prompts.pop()  # the cancelled turn never answered: send it again
    conversation.messages.pop()
    for _ in range(NUM_TURNS - 2):
        run_turn(decode, conversation)
    assert_greedy(hf, conversation)
    assert_all_free(prefill, decode)
