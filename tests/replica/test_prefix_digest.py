"""The digest a replica publishes of its prefix cache, and a prompt's keys to look it up
(`replica/prefix_digest.py`): a router that hashes a prompt finds exactly the blocks the
engine cached for it, for its tenant only."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams
from replica.prefix_digest import (
    KEY_BYTES,
    PrefixDigest,
    decode_digest,
    encode_digest,
    matched_blocks,
    prompt_block_keys,
)

BLOCK_SIZE = 4


def cached_manager(prompt: list[int], tenant: str) -> KVCacheManager:
    """A cache whose blocks hold `prompt` (computed, registered) for `tenant`."""
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    request = Request("r", prompt, SamplingParams(max_tokens=1), tenant=tenant)
    assert manager.allocate_slots(request, len(prompt)) is not None
    request.num_computed_tokens = len(prompt)
    manager.cache_blocks(request)
    return manager


def test_a_prompt_finds_the_blocks_the_engine_cached_for_its_tenant() -> None:
    history = list(range(100, 114))  # 3 full blocks and 2 tokens
    manager = cached_manager(history, tenant="acme")
    held = decode_digest(encode_digest(manager.pool.recent_block_hashes(100)))
    assert len(held) == 3
    next_turn = history + [7, 8, 9, 10, 11, 12]
    keys = prompt_block_keys(next_turn, BLOCK_SIZE, "acme")
    assert len(keys) == 5
    assert matched_blocks(keys, held.__contains__) == 3
    # Another tenant's identical prompt shares nothing; neither does a changed first token.
    other_tenant = prompt_block_keys(next_turn, BLOCK_SIZE, "other")
    assert matched_blocks(other_tenant, held.__contains__) == 0
    changed = prompt_block_keys([0] + next_turn[1:], BLOCK_SIZE, "acme")
    assert matched_blocks(changed, held.__contains__) == 0
    assert len(prompt_block_keys(next_turn, BLOCK_SIZE, "acme", max_blocks=2)) == 2


def test_the_wire_form_round_trips_and_ignores_a_partial_key() -> None:
    hashes = [bytes([i]) * 16 for i in range(5)]
    blob = encode_digest(hashes)
    assert len(blob) == 5 * KEY_BYTES
    assert decode_digest(blob) == decode_digest(blob + b"\x01\x02")
    assert len(decode_digest(blob)) == 5
    assert decode_digest(b"") == frozenset()


def test_matched_blocks_stops_at_the_first_gap() -> None:
    assert matched_blocks([1, 2, 3, 4], {1, 2, 4}.__contains__) == 2
    assert matched_blocks([], {1}.__contains__) == 0


class ManualEngine:
    """Runs the digest's builds when the test says so (the engine thread between steps)."""

    def __init__(self) -> None:
        self.queued: list[tuple[Callable[[], bytes], concurrent.futures.Future[bytes]]] = []
        self.stopped = False

    def call(self, fn: Callable[[], bytes]) -> concurrent.futures.Future[bytes]:
        if self.stopped:
            raise RuntimeError("engine loop is stopped")
        future: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        self.queued.append((fn, future))
        return future

    def run(self) -> None:
        for fn, future in self.queued:
            future.set_result(fn())
        self.queued.clear()


def test_the_digest_is_rebuilt_on_the_engine_at_most_once_per_period() -> None:
    pool = BlockPool(8)
    [block] = pool.allocate(1)
    pool.cache_block(block, b"a" * 16)
    now = [0.0]
    engine = ManualEngine()
    digest = PrefixDigest(pool, engine.call, max_blocks=4, refresh_s=1.0, clock=lambda: now[0])
    assert digest.current() == b""  # nothing built yet; a build is asked for
    assert len(engine.queued) == 1
    assert digest.current() == b"" and len(engine.queued) == 1  # one build at a time
    engine.run()
    assert decode_digest(digest.current()) == decode_digest(encode_digest([b"a" * 16]))
    pool.cache_block(pool.allocate(1)[0], b"b" * 16)
    now[0] = 0.5
    digest.current()
    assert not engine.queued  # within the period: the latest is handed out
    now[0] = 1.0
    digest.current()
    engine.run()
    assert len(decode_digest(digest.current())) == 2
    engine.stopped = True
    now[0] = 5.0
    assert len(decode_digest(digest.current())) == 2  # a stopped engine keeps the last
