"""`BlockPool.recent_block_hashes`: the bounded digest a replica publishes for routing."""

from __future__ import annotations

from engine.block_pool import BlockPool, hash_block_tokens


def _cached_pool() -> tuple[BlockPool, list[bytes]]:
    pool = BlockPool(8)
    blocks = pool.allocate(4)
    hashes: list[bytes] = []
    parent = None
    for i, block_id in enumerate(blocks):
        parent = hash_block_tokens(parent, [i] * 4, "t")
        pool.cache_block(block_id, parent)
        hashes.append(parent)
    return pool, hashes


def test_in_use_blocks_first_then_most_recently_freed() -> None:
    pool, hashes = _cached_pool()
    block_ids = [pool.lookup(h) for h in hashes]
    pool.free([block_ids[3], block_ids[2]])  # tail first: block 2 is the most recently freed
    recent = pool.recent_block_hashes(8)
    assert set(recent[:2]) == set(hashes[:2])  # still in use
    assert recent[2:] == [hashes[2], hashes[3]]
    assert pool.recent_block_hashes(3) == recent[:3]
    assert pool.recent_block_hashes(0) == []


def test_evicted_blocks_leave_the_digest() -> None:
    pool, hashes = _cached_pool()
    pool.free(reversed([pool.lookup(h) for h in hashes]))
    pool.allocate(pool.num_free_blocks)  # takes every block, evicting every cached hash
    assert pool.recent_block_hashes(8) == []
    assert pool.num_cached_blocks == 0
