"""SLO class priority inside the engine: the batch class waits behind interactive requests
and is preempted first when KV runs out, whatever the arrival order."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler

INTERACTIVE, BATCH = 0, 10  # class priorities: lower is more important


def _scheduler(num_blocks: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=64
    )
    return Scheduler(config, KVCacheManager(num_blocks, 4))


def _request(rid: str, priority: int, arrival_time: float) -> Request:
    return Request(
        rid,
        list(range(1, 9)),
        SamplingParams(max_tokens=8),
        priority=priority,
        arrival_time=arrival_time,
    )


def _run(scheduler: Scheduler) -> tuple[list[str], list[str]]:
    """Run to completion: (preempted ids in order, finished ids in order)."""
    preempted: list[str] = []
    finished: list[str] = []
    for _ in range(200):
        out = scheduler.schedule()
        preempted += out.preempted_ids
        sampled = {s.request.request_id: (5, None) for s in out.scheduled if s.samples}
        finished += [r.request_id for r in scheduler.update_from_output(out, sampled)]
        if not scheduler.has_work:
            break
    return preempted, finished


def test_batch_is_preempted_first_even_when_it_arrived_first() -> None:
    # 6 blocks of 4: two requests of 8 prompt + 8 output tokens cannot both stay resident.
    scheduler = _scheduler(num_blocks=6)
    scheduler.add_request(_request("batch", BATCH, arrival_time=0.0))
    scheduler.add_request(_request("interactive", INTERACTIVE, arrival_time=1.0))
    preempted, finished = _run(scheduler)
    assert preempted and set(preempted) == {"batch"}
    assert finished == ["interactive", "batch"]


def test_interactive_is_admitted_before_earlier_batch() -> None:
    scheduler = _scheduler(num_blocks=3)  # room for one request's prompt at a time
    scheduler.add_request(_request("batch", BATCH, arrival_time=0.0))
    scheduler.add_request(_request("interactive", INTERACTIVE, arrival_time=1.0))
    first = scheduler.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["interactive"]
