"""Block pool and KV cache manager: ref counts, prefix reuse, tenant isolation, no leaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool, hash_block_tokens
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams


def make_request(rid: str, tokens: list[int], tenant: str = "") -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), tenant=tenant)


def test_allocate_and_free_returns_everything() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5 and pool.num_free_blocks == 3
    assert not pool.can_allocate(4)
    pool.free(blocks)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0


def test_shared_block_survives_until_last_reference() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 3
    pool.free([block])
    assert pool.num_free_blocks == 4


def test_cached_free_block_is_revived_then_evicted_lru() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free([a, b])  # a is freed first, so it is evicted first
    assert pool.lookup(b"ha") == a
    (taken,) = pool.allocate(1)
    assert taken == a and pool.lookup(b"ha") is None and pool.lookup(b"hb") == b
    pool.touch([b])
    assert pool.num_free_blocks == 0 and pool.ref_count(b) == 1


def test_hash_chains_and_salts() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3], "t1")
    assert h1 == hash_block_tokens(None, [1, 2, 3], "t1")
    assert h1 != hash_block_tokens(None, [1, 2, 3], "t2")
    assert hash_block_tokens(h1, [4], "t1") != hash_block_tokens(None, [4], "t1")


def test_prefix_hit_reuses_blocks_within_tenant_only() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # two full blocks + 2 tokens
    first = make_request("a", prompt, tenant="acme")
    assert kv.allocate_slots(first, len(prompt)) is not None
    first.num_computed_tokens = len(prompt)
    kv.cache_blocks(first)
    second = make_request("b", prompt + [99], tenant="acme")
    blocks, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 8 and blocks == kv.block_table("a")[:2]
    other = make_request("c", prompt + [99], tenant="globex")
    assert kv.get_computed_blocks(other) == ([], 0)
    kv.free(first)
    kv.free(second)
    kv.free(other)
    assert kv.num_free_blocks == 16


def test_full_prompt_hit_still_computes_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    first = make_request("a", prompt)
    kv.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    kv.cache_blocks(first)
    _, num_cached = kv.get_computed_blocks(make_request("b", prompt))
    assert num_cached == 4  # the last block is recomputed to get logits


def test_allocate_slots_none_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert kv.allocate_slots(request, 12) is None
    assert kv.num_free_blocks == 2 and not kv.has_blocks("a")


# ---- property-based: random request lifecycles never leak or cross tenants ----------

operation = st.tuples(
    st.sampled_from(["admit", "grow", "finish", "abort"]),
    st.integers(0, 5),  # which request slot
    st.integers(1, 40),  # token count
    st.sampled_from(["t0", "t1"]),
    st.integers(0, 2),  # prompt family (shared prefixes within a family)
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=60), st.integers(4, 40), st.sampled_from([2, 4, 16]))
def test_random_lifecycles_free_every_block(ops, num_blocks, block_size) -> None:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    live: dict[int, Request] = {}
    counter = 0
    for op, slot, n, tenant, family in ops:
        request = live.get(slot)
        if op == "admit" and request is None:
            counter += 1
            tokens = [family * 1000 + i for i in range(n)]
            request = make_request(f"r{counter}", tokens, tenant)
            computed, num_cached = kv.get_computed_blocks(request)
            # Cached blocks only ever come from the same tenant and the same tokens.
            for other in live.values():
                other_table = kv.block_table(other.request_id)
                for j, block in enumerate(computed):
                    if block in other_table:
                        k = other_table.index(block)
                        span = slice(k * block_size, (k + 1) * block_size)
                        assert other.tenant == tenant and k == j
                        assert other.all_token_ids[span] == tokens[span]
            if kv.allocate_slots(request, n - num_cached, computed) is not None:
                request.num_computed_tokens = n
                kv.cache_blocks(request)
                live[slot] = request
            else:
                kv.free(request)
        elif op == "grow" and request is not None:
            request.output_token_ids.extend([7] * n)
            if kv.allocate_slots(request, n) is not None:
                request.num_computed_tokens += n
                kv.cache_blocks(request)
            else:
                request.output_token_ids[-n:] = []
        elif op in ("finish", "abort") and request is not None:
            kv.free(request)
            del live[slot]
        held = {b for r in live.values() for b in kv.block_table(r.request_id)}
        assert kv.pool.num_used_blocks == len(held)
        for r in live.values():
            assert len(kv.block_table(r.request_id)) == kv.num_blocks_for(r.num_computed_tokens)
    for request in live.values():
        kv.free(request)
    assert kv.num_free_blocks == num_blocks
    assert all(kv.pool.ref_count(b) == 0 for b in range(num_blocks))
