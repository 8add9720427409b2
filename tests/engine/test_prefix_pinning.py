"""A decode pool's cached prefix under a KV reservation, without a model: what
`reserve_for_kv` pins, who holds it, and that every way out gives it back, cached."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler

BLOCK = 4


def make_scheduler(num_blocks: int = 32) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=64)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK))


def make_request(rid: str, tokens: list[int], tenant: str = "t", max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(tokens), params, tenant=tenant)


def run_to_end(scheduler: Scheduler, token: int = 7) -> list[Request]:
    """Steps with a fake model sampling `token`, until nothing runs."""
    finished: list[Request] = []
    while scheduler.has_work:
        out = scheduler.schedule()
        sampled = {s.request.request_id: (token, None) for s in out.scheduled if s.samples}
        finished += scheduler.update_from_output(out, sampled)
    return finished


def pool_of(scheduler: Scheduler):  # noqa: ANN201 - the BlockPool
    return scheduler.kv.pool


def answer_turn(scheduler: Scheduler, rid: str, tokens: list[int], tenant: str = "t") -> Request:
    """A whole request (prompt and decode here); returns it finished."""
    request = make_request(rid, tokens, tenant)
    scheduler.add_request(request)
    (done,) = run_to_end(scheduler)
    assert done is request and request.status is RequestStatus.FINISHED_LENGTH
    return request


PROMPT = list(range(1, 11))  # 10 tokens: 2 full blocks and a half


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    scheduler = make_scheduler()
    first = answer_turn(scheduler, "turn0", PROMPT)
    history = first.all_token_ids  # 10 prompt + 3 answer tokens; the last never computed
    next_prompt = history + [41, 42, 43]
    # every full block of prompt + answer but the last token: 12 tokens
    assert scheduler.kv.cached_prefix_tokens(next_prompt, "t") == 12
    assert pool_of(scheduler).num_used_blocks == 0


def test_reservation_pins_the_tenants_cached_prefix() -> None:
    scheduler = make_scheduler()
    history = answer_turn(scheduler, "turn0", PROMPT).all_token_ids
    pool = pool_of(scheduler)
    request = make_request("turn1#0", history + [41, 42, 43, 44, 45])  # 18 tokens
    table = scheduler.reserve_for_kv(request)
    assert table is not None and len(table) == 5
    assert request.num_computed_tokens == 12  # 3 pinned blocks; the rest awaits the KV
    pinned = table[:3]
    assert all(pool.ref_count(b) == 1 for b in table)
    assert scheduler.kv.cached_prefix_tokens(request.prompt_token_ids, "t") == 12
    # KV lands: decoding starts; the moved tokens are the ones after the pinned prefix
    running = scheduler.kv_received("turn1#0", 9)
    assert running.num_transferred_tokens == 18 - 12
    assert scheduler.kv.block_table("turn1#0")[:3] == pinned
    run_to_end(scheduler)
    assert pool.num_used_blocks == 0
    assert scheduler.kv.cached_prefix_tokens(running.all_token_ids + [1], "t") == 20


def test_a_failed_or_aborted_reservation_unpins_and_keeps_the_prefix_cached() -> None:
    scheduler = make_scheduler()
    history = answer_turn(scheduler, "turn0", PROMPT).all_token_ids
    pool = pool_of(scheduler)
    prompt = history + [41, 42, 43, 44, 45]
    for end in ("kv_failed", "abort"):
        request = make_request(f"turn1-{end}", prompt)
        table = scheduler.reserve_for_kv(request)
        assert table is not None
        if end == "kv_failed":
            assert scheduler.kv_failed(request.request_id, fall_back_to_local=False)
        else:
            scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
        assert pool.num_used_blocks == 0
        assert scheduler.kv.cached_prefix_tokens(prompt, "t") == 12
        assert scheduler.requests == {}


def test_a_pinned_prefix_is_never_evicted_and_shared_by_the_tenants_requests() -> None:
    scheduler = make_scheduler(num_blocks=8)
    history = answer_turn(scheduler, "turn0", PROMPT).all_token_ids
    pool = pool_of(scheduler)
    one = make_request("one", history + [50])
    two = make_request("two", history + [60, 61])
    table_one = scheduler.reserve_for_kv(one)
    table_two = scheduler.reserve_for_kv(two)
    assert table_one is not None and table_two is not None
    assert table_one[:3] == table_two[:3]  # one prefix, held twice
    assert all(pool.ref_count(b) == 2 for b in table_one[:3])
    # the other blocks: 8 - 3 pinned - 2 fresh = 3 left; a request needing 4 does not fit,
    # and evicting can never take a pinned block
    assert scheduler.reserve_for_kv(make_request("big", list(range(100, 116)))) is None
    assert all(pool.ref_count(b) == 2 for b in table_one[:3])
    for rid in ("one", "two"):
        scheduler.kv_failed(rid, fall_back_to_local=False)
    assert pool.num_used_blocks == 0
    assert scheduler.kv.cached_prefix_tokens(history + [50], "t") == 12


def test_tenants_never_share_blocks() -> None:
    scheduler = make_scheduler()
    history = answer_turn(scheduler, "turn0", PROMPT, tenant="a").all_token_ids
    prompt = history + [41, 42]
    assert scheduler.kv.cached_prefix_tokens(prompt, "b") == 0
    mine = make_request("a1", prompt, tenant="a")
    theirs = make_request("b1", prompt, tenant="b")
    table_a = scheduler.reserve_for_kv(mine)
    table_b = scheduler.reserve_for_kv(theirs)
    assert table_a is not None and table_b is not None
    assert mine.num_computed_tokens == 12 and theirs.num_computed_tokens == 0
    assert not set(table_a) & set(table_b)
    for rid in ("a1", "b1"):
        scheduler.kv_received(rid, 9)
    run_to_end(scheduler)
    # each tenant's copy is findable only by that tenant
    for tenant in ("a", "b"):
        assert scheduler.kv.cached_prefix_tokens(prompt + [9, 7, 1], tenant) >= 12
    assert pool_of(scheduler).num_used_blocks == 0


def test_without_a_prefix_cache_nothing_is_pinned() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=64)
    scheduler = Scheduler(config, KVCacheManager(32, BLOCK, enable_prefix_caching=False))
    history = answer_turn(scheduler, "turn0", PROMPT).all_token_ids
    request = make_request("turn1", history + [41])
    assert scheduler.kv.cached_prefix_tokens(request.prompt_token_ids, "t") == 0
    assert scheduler.reserve_for_kv(request) is not None
    assert request.num_computed_tokens == 0
    assert scheduler.kv_received("turn1", 9).num_transferred_tokens == 14
