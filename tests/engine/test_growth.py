"""Admission that leaves room for running requests' output (engine/growth.py)."""

from __future__ import annotations

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.growth import OutputGrowth
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, SamplingParams
from tests.engine.test_scheduler import make_scheduler, run_step


def line(rid: str, priority: int = 0, num_prompt: int = 8, max_tokens: int = 8) -> Request:
    """A request that runs to `max_tokens` for certain (a batch line with ignore_eos); its
    prompt shares no block with another's."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first = 1000 * (1 + sum(map(ord, rid)))
    return Request(rid, list(range(first, first + num_prompt)), params, priority=priority)


def run_all(scheduler, max_steps: int = 500) -> tuple[list[Request], int]:
    """Steps until nothing is left; (finished requests, most running at once)."""
    finished: list[Request] = []
    most = 0
    for _ in range(max_steps):
        finished += run_step(scheduler)
        most = max(most, len(scheduler.running))
        if not scheduler.has_work:
            return finished, most
    raise AssertionError("the scheduler did not finish")


def test_equal_lines_fit_their_output_instead_of_preempting() -> None:
    # 24 blocks of 4 tokens; each line ends holding 8 + 8 - 1 = 15 tokens (4 blocks), so
    # 6 fit. Admitted on their prompt's 2 blocks alone, all 8 would start and then preempt.
    scheduler = make_scheduler(num_blocks=24, block_size=4, budget=64, max_seqs=8)
    for i in range(8):
        scheduler.add_request(line(f"l{i}"))
    finished, most = run_all(scheduler)
    assert scheduler.num_preemptions == 0
    assert most == 6
    assert sorted(r.request_id for r in finished) == [f"l{i}" for i in range(8)]
    assert all(r.num_output_tokens == 8 for r in finished)
    assert scheduler.kv.num_free_blocks == 24


def test_a_more_important_request_does_not_wait_for_less_important_growth() -> None:
    scheduler = make_scheduler(num_blocks=24, block_size=4, budget=64, max_seqs=8)
    for i in range(5):
        scheduler.add_request(line(f"batch{i}", priority=10))
    run_step(scheduler)  # five lines hold 2 blocks each and keep 2 more each: 4 left
    assert len(scheduler.running) == 5
    scheduler.add_request(line("interactive", priority=0))
    scheduler.add_request(line("batch5", priority=10))
    run_step(scheduler)
    running = {r.request_id for r in scheduler.running}
    # The interactive request starts at once (the lines' growth is what preemption may take
    # back for it); a sixth line waits for room for the output of all before it.
    assert "interactive" in running and "batch5" not in running
    finished, _ = run_all(scheduler)
    assert len(finished) == 7
    assert scheduler.kv.num_free_blocks == 24


def test_more_important_requests_count_less_important_blocks_as_room() -> None:
    scheduler = make_scheduler(num_blocks=24, block_size=4, budget=64, max_seqs=8)
    for i in range(6):
        scheduler.add_request(line(f"batch{i}", priority=10))
    run_step(scheduler)  # 12 blocks held by lines, 12 kept for their output: none free
    scheduler.add_request(line("interactive0", priority=0))
    scheduler.add_request(line("interactive1", priority=0))
    run_step(scheduler)
    # Both start: after the first, the second's room is the free blocks plus the lines'
    # (preemption takes those back), less the first's growth; lines are preempted instead.
    running = {r.request_id for r in scheduler.running}
    assert {"interactive0", "interactive1"} <= running
    finished, _ = run_all(scheduler)
    assert len(finished) == 8 and scheduler.num_preemptions > 0
    assert scheduler.kv.num_free_blocks == 24


def test_a_line_held_back_at_the_head_lets_more_important_requests_pass() -> None:
    # 20 blocks of 4 tokens; lines of 4 prompt and 28 output tokens end on 8 blocks each.
    scheduler = make_scheduler(num_blocks=20, block_size=4, budget=64, max_seqs=8)
    for i in range(2):
        scheduler.add_request(line(f"batch{i}", priority=10, num_prompt=4, max_tokens=28))
    run_step(scheduler)  # 2 blocks held, 14 kept for their output: 4 left, not 8
    # A line preempted earlier waits at the head: requests arriving later queue behind it.
    preempted = line("preempted", priority=10, num_prompt=4, max_tokens=28)
    preempted.num_preemptions = 1
    scheduler.add_request(preempted)
    scheduler.add_request(line("interactive", priority=0, num_prompt=4, max_tokens=2))
    assert [r.request_id for r in scheduler.waiting] == ["preempted", "interactive"]
    run_step(scheduler)
    assert "interactive" in {r.request_id for r in scheduler.running}
    assert [r.request_id for r in scheduler.waiting] == ["preempted"]
    finished, _ = run_all(scheduler)
    assert len(finished) == 4 and scheduler.num_preemptions == 0
    assert scheduler.kv.num_free_blocks == 20


def test_a_kv_reservation_leaves_the_room_kept_for_running_output() -> None:
    scheduler = make_scheduler(num_blocks=20, block_size=4, budget=64, max_seqs=8)
    for i in range(2):
        scheduler.add_request(line(f"batch{i}", priority=10, num_prompt=4, max_tokens=28))
    run_step(scheduler)
    # A prompt prefilled elsewhere: refused (prefilled locally, queued) while the lines'
    # output needs the room; a more important one is reserved at once.
    remote = line("remote", priority=10, num_prompt=8, max_tokens=16)  # 6 blocks
    assert scheduler.reserve_for_kv(remote) is None
    assert scheduler.kv.num_free_blocks == 18
    important = line("remote-interactive", priority=0, num_prompt=8, max_tokens=8)
    assert scheduler.reserve_for_kv(important) is not None
    assert scheduler.kv.num_free_blocks == 16
    # The refused one left nothing behind (not even the block hashes looked up for it).
    assert "remote" not in scheduler.kv._block_hashes


def test_requests_that_stopped_on_a_stop_string_teach_the_estimate() -> None:
    scheduler = make_scheduler()
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=50, stop=("x",)))
    scheduler.add_request(request)
    for _ in range(5):
        run_step(scheduler)
    # The engine's detokenizer saw the stop string: it ends the request directly.
    scheduler.finish_request("r", RequestStatus.FINISHED_STOPPED)
    assert scheduler.growth.mean_output_tokens == 5
    aborted = Request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    scheduler.add_request(aborted)
    run_step(scheduler)
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.growth.mean_output_tokens == 5  # an abort says nothing about lengths


def test_a_cold_engine_admits_requests_that_may_stop_early_on_their_prompt() -> None:
    # Nothing finished yet: no estimate of their output, so all 8 start (as without growth
    # reservation) and the pool preempts as they outgrow it.
    scheduler = make_scheduler(num_blocks=24, block_size=4, budget=64, max_seqs=8)
    for i in range(8):
        params = SamplingParams(max_tokens=8)
        scheduler.add_request(Request(f"r{i}", list(range(1, 9)), params))
    run_step(scheduler)
    assert len(scheduler.running) == 8
    finished, _ = run_all(scheduler)
    assert len(finished) == 8 and scheduler.num_preemptions > 0
    assert scheduler.kv.num_free_blocks == 24


def finished_request(num_outputs: int, max_tokens: int = 100) -> Request:
    request = Request("done", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    for _ in range(num_outputs):
        request.append_output_token(7, None)
    request.status = RequestStatus.FINISHED_STOPPED
    return request


def test_the_estimate_follows_the_lengths_requests_stopped_at() -> None:
    growth = OutputGrowth(KVCacheManager(64, 4).num_blocks_for)
    fresh = Request("new", list(range(10)), SamplingParams(max_tokens=100))
    assert growth.expected_tokens(fresh) == 10  # cold: its prompt
    for _ in range(40):
        growth.finished(finished_request(20))
    assert round(growth.mean_output_tokens) == 20
    assert growth.expected_tokens(fresh) == 10 + 20 - 1
    assert growth.growth_blocks(fresh, num_held_blocks=3) == 8 - 3  # 29 tokens: 8 blocks
    # Never past max_tokens, and never less than what a request already holds.
    short = Request("short", list(range(10)), SamplingParams(max_tokens=5))
    assert growth.expected_tokens(short) == 10 + 5 - 1
    long_one = finished_request(50)
    assert growth.expected_tokens(long_one) == long_one.num_tokens
    # Certain lengths (ignore_eos) and prefill-only requests teach it nothing.
    before = growth.mean_output_tokens
    certain = Request("c", [1], SamplingParams(max_tokens=90, ignore_eos=True))
    growth.finished(certain)
    assert growth.mean_output_tokens == before
    assert growth.expected_tokens(certain) == 1 + 90 - 1
    stop_string = SamplingParams(max_tokens=90, ignore_eos=True, stop=("x",))
    assert growth.expected_tokens(Request("s", [1], stop_string)) == 1 + 20 - 1
    # min_tokens: at least that many; at max_tokens, certain.
    at_least = SamplingParams(max_tokens=90, min_tokens=30)
    assert growth.expected_tokens(Request("m", [1], at_least)) == 1 + 30 - 1
    exact = SamplingParams(max_tokens=40, min_tokens=40)
    assert growth.expected_tokens(Request("e", [1], exact)) == 1 + 40 - 1
    growth.finished(Request("e", [1], exact))
    assert growth.mean_output_tokens == before


def test_engine_batch_on_a_tight_cache_runs_without_preemption() -> None:
    prompts = [[(7 * i + j) % 200 + 3 for j in range(20)] for i in range(12)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    roomy = Engine(EngineConfig(model_dir="tiny"))
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    roomy.close()
    block_bytes = roomy.kv_spec.bytes_per_block
    # Each request starts on 2 blocks of 16 and ends holding 39 tokens (3 blocks): room for
    # 3 of the 12 at once (admitted on their prompts, 5 would start and outgrow the pool).
    engine = Engine(
        EngineConfig(model_dir="tiny", cache=CacheConfig(kv_cache_bytes=10 * block_bytes))
    )
    try:
        assert [o.token_ids for o in engine.generate(prompts, params)] == expected
        assert engine.scheduler.num_preemptions == 0
        assert engine.kv_manager.num_free_blocks == 10
    finally:
        engine.close()


def test_a_step_with_nothing_to_run_is_an_idle_pass() -> None:
    # A prompt waits for KV from a prefill replica; a local one waits for the room its
    # output is kept: nothing can run until the KV lands, so the engine loop sleeps on its
    # wakeup (engine/async_engine.py) instead of spinning, and no step time is recorded.
    probe = Engine(EngineConfig(model_dir="tiny"))
    block_bytes = probe.kv_spec.bytes_per_block
    probe.close()
    engine = Engine(
        EngineConfig(model_dir="tiny", cache=CacheConfig(kv_cache_bytes=10 * block_bytes))
    )
    try:
        prompt = [(5 * j) % 200 + 3 for j in range(20)]
        remote = engine.make_request(
            prompt, SamplingParams(max_tokens=40, ignore_eos=True), request_id="remote"
        )
        assert engine.reserve_for_kv(remote) is not None  # 2 blocks held, 2 kept
        assert engine.occupancy()["num_kept_blocks"] == 2
        local = engine.make_request(
            prompt[::-1], SamplingParams(max_tokens=80, ignore_eos=True), request_id="local"
        )
        engine.add_request(local)  # needs 7 of the 8 free, 2 of them kept: waits
        assert engine.step() == []
        assert engine.idle_pass and not engine.step_times
        assert engine.occupancy()["num_waiting"] == 1
        engine.kv_failed("remote")  # its blocks (and kept room) come back: `local` starts
        engine.step()
        assert not engine.idle_pass and engine.occupancy()["num_running"] == 1
    finally:
        engine.close()
