"""Scheduler behaviour without a model: budgets, chunking, preemption, hand-off states."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, budget: int = 32, chunk: int = 16, max_seqs: int = 8
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, long_prefill_token_threshold=chunk
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def make_request(rid: str, num_prompt: int, max_tokens: int = 4, **kwargs) -> Request:
    return Request(
        rid, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens), **kwargs
    )


def run_step(scheduler: Scheduler, token: int = 5) -> list[Request]:
    """One step with a fake model that samples `token` for every sampling request."""
    out = scheduler.schedule()
    sampled = {s.request.request_id: (token, None) for s in out.scheduled if s.samples}
    return scheduler.update_from_output(out, sampled)


def test_budget_and_chunked_prefill() -> None:
    scheduler = make_scheduler(budget=32, chunk=16)
    scheduler.add_request(make_request("long", 40))
    scheduler.add_request(make_request("short", 10))
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("long", 16),
        ("short", 10),
    ]
    assert not out.scheduled[0].samples and out.scheduled[1].samples


def test_requests_finish_by_length_and_free_blocks() -> None:
    scheduler = make_scheduler()
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 7 + 3 * i, max_tokens=3))
    finished = []
    for _ in range(50):
        finished += run_step(scheduler)
        if not scheduler.has_work:
            break
    assert sorted(r.request_id for r in finished) == [f"r{i}" for i in range(5)]
    assert all(
        r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3 for r in finished
    )
    assert scheduler.kv.num_free_blocks == 64


def test_eos_and_stop_token_ids() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", 4, max_tokens=10, eos_token_ids=(5,)))
    (done,) = run_step(scheduler, token=5)
    assert done.status == RequestStatus.FINISHED_STOPPED and done.num_output_tokens == 1


def test_preemption_when_kv_runs_out_then_everything_finishes() -> None:
    # 6 blocks of 4: two requests of 8 prompt tokens + 8 outputs cannot both stay resident.
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64, chunk=64)
    scheduler.add_request(make_request("a", 8, max_tokens=8, arrival_time=0.0))
    scheduler.add_request(make_request("b", 8, max_tokens=8, arrival_time=1.0))
    preempted = []
    finished = []
    for _ in range(100):
        out = scheduler.schedule()
        preempted += out.preempted_ids
        sampled = {s.request.request_id: (5, None) for s in out.scheduled if s.samples}
        finished += scheduler.update_from_output(out, sampled)
        if not scheduler.has_work:
            break
    assert "b" in preempted  # the later arrival is the victim
    assert sorted(r.request_id for r in finished) == ["a", "b"]
    assert all(r.num_output_tokens == 8 for r in finished)
    assert scheduler.kv.num_free_blocks == 6


def test_abort_in_every_state_frees_blocks() -> None:
    scheduler = make_scheduler(num_blocks=16)
    scheduler.add_request(make_request("waiting", 4))
    running = make_request("running", 4)
    scheduler.add_request(running)
    run_step(scheduler)
    kv_request = make_request("kv", 8)
    assert scheduler.reserve_for_kv(kv_request) is not None
    scheduler.add_request(make_request("queued", 4))
    for rid in ["running", "kv", "queued", "waiting"]:
        assert scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED) is not None
    assert scheduler.finish_request("running", RequestStatus.FINISHED_ABORTED) is None
    assert scheduler.kv.num_free_blocks == 16 and not scheduler.has_work


def test_decode_pool_starts_from_received_kv() -> None:
    scheduler = make_scheduler()
    request = make_request("d", 10, max_tokens=3)
    block_ids = scheduler.reserve_for_kv(request)
    assert block_ids is not None and len(block_ids) == 3
    assert request.status == RequestStatus.WAITING_FOR_KV
    assert scheduler.schedule().is_empty  # nothing runs until the KV is there
    scheduler.kv_received("d", first_token_id=9)
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("d", 1)]
    assert request.num_computed_tokens == 10 and request.output_token_ids == [9]


def test_decode_pool_transfer_failure_falls_back_or_aborts() -> None:
    scheduler = make_scheduler(num_blocks=16)
    scheduler.reserve_for_kv(make_request("local", 6))
    scheduler.reserve_for_kv(make_request("gone", 6))
    scheduler.kv_failed("local", fall_back_to_local=True)
    scheduler.kv_failed("gone", fall_back_to_local=False)
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["local"]
    assert out.scheduled[0].num_new_tokens == 6


def test_prefill_pool_holds_blocks_until_hand_off() -> None:
    scheduler = make_scheduler(num_blocks=16)
    scheduler.add_request(make_request("p", 9, prefill_only=True))
    (done,) = run_step(scheduler)
    assert done.status == RequestStatus.FINISHED_PREFILLED and done.output_token_ids == [5]
    assert scheduler.kv.num_free_blocks == 16 - 3
    scheduler.release_held("p")
    assert scheduler.kv.num_free_blocks == 16


def test_priority_orders_admission() -> None:
    scheduler = make_scheduler(max_seqs=1)
    scheduler.add_request(make_request("low", 4, priority=5))
    scheduler.add_request(make_request("high", 4, priority=0))
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["high"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 6)), min_size=1, max_size=8),
    st.integers(8, 24),
    st.integers(4, 40),
    st.lists(st.integers(0, 7), max_size=3),
)
def test_random_workloads_finish_or_abort_without_leaks(specs, num_blocks, budget, aborts):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, budget=budget, chunk=budget)
    requests = []
    for i, (num_prompt, max_tokens) in enumerate(specs):
        if -(-(num_prompt + max_tokens) // 4) > num_blocks:
            continue  # the engine rejects requests that can never fit
        request = make_request(f"r{i}", num_prompt, max_tokens, arrival_time=float(i))
        scheduler.add_request(request)
        requests.append(request)
    for step in range(400):
        if step == 3:
            for index in aborts:
                if index < len(requests):
                    scheduler.finish_request(
                        requests[index].request_id, RequestStatus.FINISHED_ABORTED
                    )
        run_step(scheduler)
        if not scheduler.has_work:
            break
    assert not scheduler.has_work
    for request in requests:
        assert request.is_finished
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.sampling_params.max_tokens
    assert scheduler.kv.num_free_blocks == num_blocks


def quarantine_step(scheduler: Scheduler) -> list[str]:
    """A step that fails with several requests in it: each is quarantined (as the engine
    does). Returns the quarantined ids."""
    out = scheduler.schedule()
    assert len(out.scheduled) > 1
    for item in out.scheduled:
        scheduler.quarantine(item.request)
    return [item.request.request_id for item in out.scheduled]


def test_quarantined_requests_run_alone_until_they_sample() -> None:
    scheduler = make_scheduler(num_blocks=64, budget=32, chunk=16)
    scheduler.add_request(make_request("long", 40, max_tokens=2))
    scheduler.add_request(make_request("short", 10, max_tokens=2))
    assert quarantine_step(scheduler) == ["long", "short"]
    assert scheduler.kv.num_free_blocks == 64 and scheduler.num_quarantined == 2
    scheduler.add_request(make_request("late", 4, max_tokens=2))

    steps = []
    for _ in range(20):
        out = scheduler.schedule()
        steps.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        run_sampled = {s.request.request_id: (5, None) for s in out.scheduled if s.samples}
        scheduler.update_from_output(out, run_sampled)
        if not scheduler.has_work:
            break
    # "long" is recomputed alone, chunk by chunk, until it samples; then "short" alone (its
    # first 8 tokens are long's prefix, cached); only then do the innocents run together
    # again and "late" is admitted.
    assert steps[:4] == [[("long", 16)], [("long", 16)], [("long", 8)], [("short", 2)]]
    assert steps[4] == [("long", 1), ("short", 1), ("late", 4)]
    assert not scheduler.has_work and scheduler.kv.num_free_blocks == 64


def test_abort_of_a_suspect_frees_it() -> None:
    scheduler = make_scheduler(num_blocks=16)
    for rid in ("a", "b", "c"):
        scheduler.add_request(make_request(rid, 6))
    quarantine_step(scheduler)
    run_step(scheduler)  # "a" on trial: it sampled, so it is cleared
    out = scheduler.schedule()  # "b" on trial now
    assert [s.request.request_id for s in out.scheduled] == ["b"] and scheduler.on_trial
    for rid in ("b", "c", "a"):
        assert scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED) is not None
    assert scheduler.on_trial is None and not scheduler.suspects and not scheduler.has_work
    assert scheduler.kv.num_free_blocks == 16


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 6)), min_size=2, max_size=8),
    st.integers(8, 24),
    st.integers(4, 40),
    st.integers(0, 7),
)
def test_random_workloads_with_a_culprit(specs, num_blocks, budget, culprit_index):
    """A fake model fails every step the culprit is in, with the engine's policy (fail a
    lone request, quarantine several): only the culprit fails, no block leaks."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, budget=budget, chunk=budget)
    requests = []
    for i, (num_prompt, max_tokens) in enumerate(specs):
        if -(-(num_prompt + max_tokens) // 4) > num_blocks:
            continue
        request = make_request(f"r{i}", num_prompt, max_tokens, arrival_time=float(i))
        scheduler.add_request(request)
        requests.append(request)
    culprit = requests[culprit_index % len(requests)].request_id if requests else None
    for _ in range(1000):
        out = scheduler.schedule()
        ids = [s.request.request_id for s in out.scheduled]
        if scheduler.on_trial is not None:
            assert ids == [scheduler.on_trial.request_id]
        if culprit in ids:
            if len(ids) == 1:
                scheduler.finish_request(culprit, RequestStatus.FINISHED_ABORTED)
            else:
                for item in out.scheduled:
                    scheduler.quarantine(item.request)
            continue
        sampled = {s.request.request_id: (5, None) for s in out.scheduled if s.samples}
        scheduler.update_from_output(out, sampled)
        if not scheduler.has_work:
            break
    assert not scheduler.has_work
    for request in requests:
        if request.request_id == culprit:
            assert request.status == RequestStatus.FINISHED_ABORTED
        else:
            assert request.status == RequestStatus.FINISHED_LENGTH
            assert request.num_output_tokens == request.sampling_params.max_tokens
    assert scheduler.kv.num_free_blocks == num_blocks
