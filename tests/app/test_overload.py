"""TTFT prediction (prefill queue plus decode admission wait), load shedding and deadlines
(pure: injected clocks, no Ray)."""

from __future__ import annotations

import asyncio
from types import MappingProxyType

import pytest
from pydantic import ValidationError

from app.admission.deadlines import Deadline, requested_timeout, resolve_timeout_s
from app.admission.overload import OverloadGuard
from app.admission.shedding import (
    DecodeSlots,
    LoadShedder,
    ReplicaLoad,
    drain_time_s,
    predict_decode_wait_s,
    predict_ttft_s,
)
from app.config import OverloadSettings, SheddingSettings, load_config
from app.errors import BadRequestError, DeadlineExceededError, error_response
from replica.placement import PoolSnapshot


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def snapshot(at: float, *replicas: tuple[float, float]) -> PoolSnapshot:
    stats = {
        f"r{i}": {"queued_tokens": q, "prefill_tokens_per_s": rate}
        for i, (q, rate) in enumerate(replicas)
    }
    return PoolSnapshot(MappingProxyType(stats), at)


def test_prediction_uses_the_best_measured_replica() -> None:
    loads = [ReplicaLoad(900, 100), ReplicaLoad(100, 50), ReplicaLoad(0, 0)]
    # (900 + 100) / 100 = 10 s; (100 + 100) / 50 = 4 s; the unmeasured one is skipped.
    assert predict_ttft_s(loads, 100) == pytest.approx(4.0)
    assert drain_time_s(loads) == pytest.approx(2.0)
    assert predict_ttft_s([ReplicaLoad(10, 0)], 100) is None


def test_lowest_class_is_shed_first() -> None:
    clock = Clock()
    settings = SheddingSettings(factor=2.0, priority_step=0.5, min_factor=0.25)
    shedder = LoadShedder(settings, priorities=[0, 5, 10], clock=clock)
    assert [shedder.factor(p) for p in (0, 5, 10)] == [2.0, 1.0, 0.5]
    assert shedder.factor(20) == 0.25  # below every class: clamped at min_factor
    load = snapshot(clock.now, (1400, 1000))  # (1400 + 100) / 1000 = 1.5 s predicted
    interactive = shedder.check("p", load, 100, ttft_slo_s=1.0, priority=0)
    batch = shedder.check("p", load, 100, ttft_slo_s=1.0, priority=10)
    assert not interactive.shed and interactive.limit_s == pytest.approx(2.0)
    assert batch.shed and batch.limit_s == pytest.approx(0.5)
    assert batch.predicted_ttft_s == pytest.approx(1.5)
    assert batch.retry_after_s == pytest.approx(1.4)  # the queue's drain time
    assert "predicted TTFT 1.50 s on pool p, limit 0.50 s" in batch.reason
    assert batch.reason.endswith(": shed") and interactive.reason.endswith(": admitted")


def test_only_work_at_or_above_the_priority_is_ahead() -> None:
    stats = {
        "queued_tokens": 5000,
        "pending_tokens_by_priority": {"0": 200, "10": 6000},
        "prefill_tokens_per_s": 1000,
    }
    assert ReplicaLoad.from_stats(stats, priority=0) == ReplicaLoad(200, 1000)
    assert ReplicaLoad.from_stats(stats, priority=10) == ReplicaLoad(5000, 1000)
    assert ReplicaLoad.from_stats({"queued_tokens": 7}, priority=0) == ReplicaLoad(7, 0)
    clock = Clock()
    shedder = LoadShedder(SheddingSettings(factor=1.0), priorities=[0, 10], clock=clock)
    flooded = PoolSnapshot(MappingProxyType({"r": stats}), clock.now)
    assert not shedder.check("p", flooded, 100, ttft_slo_s=1.0, priority=0).shed  # 0.3 s
    assert shedder.check("p", flooded, 100, ttft_slo_s=10.0, priority=10).shed  # 5.1 s > 5


def decode_pool(at: float, *replicas: tuple[int, dict[int, int], float]) -> PoolSnapshot:
    """A decode pool: per replica (active streams of 4 slots, waiters by priority, slots
    freed per second), as `SlotGate.snapshot` reports them."""
    stats = {
        f"d{i}": {
            "admission": {
                "num_active": active,
                "max_active": 4,
                "num_waiting_by_priority": waiting,
                "releases_per_s": rate,
            }
        }
        for i, (active, waiting, rate) in enumerate(replicas)
    }
    return PoolSnapshot(MappingProxyType(stats), at)


def test_decode_admission_wait_counts_waiters_at_or_above_the_priority() -> None:
    full = {
        "admission": {
            "num_active": 4,
            "max_active": 4,
            "num_waiting_by_priority": {0: 1, 10: 30},
            "releases_per_s": 2.0,
        }
    }
    interactive = DecodeSlots.from_stats(full, priority=0)
    batch = DecodeSlots.from_stats(full, priority=10)
    assert interactive == DecodeSlots(0, 1, 2.0) and batch == DecodeSlots(0, 31, 2.0)
    assert interactive.wait_s() == pytest.approx(1.0)  # behind 1: the 2nd slot freed
    assert batch.wait_s() == pytest.approx(16.0)  # behind 31
    assert DecodeSlots(3, 2, 0.0).wait_s() == 0.0  # a free slot each
    assert DecodeSlots(0, 0, 0.0).wait_s() is None  # full, and no slot freed lately
    assert DecodeSlots.from_stats({"queued_tokens": 3}, priority=0) is None  # no gate
    assert predict_decode_wait_s([DecodeSlots(0, 5, 1.0), DecodeSlots(0, 1, 1.0)]) == 2.0
    assert predict_decode_wait_s([DecodeSlots(0, 0, 0.0)]) is None


def test_full_decode_pool_sheds_batch_first_and_adds_to_the_prefill_wait() -> None:
    clock = Clock()
    shedder = LoadShedder(SheddingSettings(factor=1.0), priorities=[0, 10], clock=clock)
    prefill = snapshot(clock.now, (100, 1000))  # 0.2 s of prefill for 100 tokens
    # Long batch streams hold every slot; 30 batch requests and 1 interactive wait.
    decode = decode_pool(clock.now, (4, {0: 1, 10: 30}, 1.0))
    interactive = shedder.check("p", prefill, 100, 3.0, 0, "decode", decode)
    batch = shedder.check("p", prefill, 100, 30.0, 10, "decode", decode)
    assert not interactive.shed and interactive.predicted_ttft_s == pytest.approx(2.2)
    assert batch.shed and batch.predicted_ttft_s == pytest.approx(32.2)
    assert "+ decode admission wait 32.00 s on pool decode" in batch.reason
    assert batch.retry_after_s == pytest.approx(30.0)  # capped at max_retry_after_s
    # A prompt prefilled on the decode replica: its decode wait alone decides.
    local = shedder.check(None, None, 10, 30.0, 10, "decode", decode)
    assert local.shed and "local prefill + decode admission wait" in local.reason
    # Free slots, stale or missing decode data: the prefill prediction alone, as before.
    idle = decode_pool(clock.now, (1, {}, 0.0))
    assert shedder.check("p", prefill, 100, 1.0, 10, "decode", idle).predicted_ttft_s == 0.2
    stale = decode_pool(clock.now - 60, (4, {10: 30}, 1.0))
    assert not shedder.check("p", prefill, 100, 30.0, 10, "decode", stale).shed
    assert not shedder.check(None, None, 10, 1.0, 10, "decode", None).shed


def test_nothing_is_shed_without_fresh_measurements() -> None:
    clock = Clock()
    shedder = LoadShedder(SheddingSettings(max_age_s=10), priorities=[], clock=clock)
    overloaded = snapshot(clock.now - 11, (10**6, 10))
    assert not shedder.check("p", overloaded, 10, 1.0, 0).shed  # stale
    assert not shedder.check("p", None, 10, 1.0, 0).shed  # never seen
    assert not shedder.check("p", snapshot(clock.now, (10**6, 0)), 10, 1.0, 0).shed
    assert not shedder.check(None, snapshot(clock.now, (10**6, 10)), 10, 1.0, 0).shed  # local
    assert shedder.check("p", snapshot(clock.now, (10**6, 10)), 10, 1.0, 0).shed
    off = LoadShedder(SheddingSettings(enabled=False), priorities=[], clock=clock)
    assert not off.check("p", snapshot(clock.now, (10**6, 10)), 10, 1.0, 0).shed


def test_default_ttft_and_retry_after_cap() -> None:
    clock = Clock()
    settings = SheddingSettings(default_ttft_s=3.0, factor=1.0, max_retry_after_s=5)
    shedder = LoadShedder(settings, priorities=[], clock=clock)
    check = shedder.check("p", snapshot(clock.now, (10_000, 100)), 1, None, 0)
    assert check.shed and check.limit_s == 3.0 and check.retry_after_s == 5


def test_shed_error_is_503_overloaded_with_retry_after_and_reason() -> None:
    clock = Clock()
    shedder = LoadShedder(SheddingSettings(), priorities=[], clock=clock)
    check = shedder.check("p", snapshot(clock.now, (10_000, 100)), 1, 1.0, 0)
    error = OverloadGuard.shed_error(check, "len 1 -> pool p")
    status, body = error_response(error)
    assert status == 503 and body["error"]["code"] == "overloaded"
    assert error.headers["Retry-After"] == "30"  # drain 100 s, capped at max_retry_after_s
    assert error.headers["x-pdserve-route"].startswith("len 1 -> pool p; predicted TTFT")


def test_timeouts_resolve_and_are_checked() -> None:
    settings = OverloadSettings(
        default_timeout_s=60, class_timeouts_s={"batch": 300}, max_timeout_s=600
    )
    assert resolve_timeout_s(settings, None) == 60
    assert resolve_timeout_s(settings, None, "batch") == 300
    assert resolve_timeout_s(settings, 2.5, "batch") == 2.5
    with pytest.raises(BadRequestError, match="exceeds this service's limit of 600 s") as info:
        resolve_timeout_s(settings, 601, param="x-pdserve-timeout")
    assert info.value.param == "x-pdserve-timeout"
    with pytest.raises(BadRequestError, match="positive"):
        resolve_timeout_s(settings, float("nan"))
    assert requested_timeout({"x-pdserve-timeout": " 1.5 "}, 9.0) == (1.5, "x-pdserve-timeout")
    assert requested_timeout({}, 9.0) == (9.0, "timeout")
    with pytest.raises(BadRequestError, match="must be a number of seconds"):
        requested_timeout({"x-pdserve-timeout": "soon"}, None)


def test_deadline_counts_down_and_maps_to_504() -> None:
    clock = Clock()
    deadline = Deadline.start(2.0, clock)
    clock.now += 0.5
    assert deadline.remaining_s() == pytest.approx(1.5)
    clock.now += 5
    assert deadline.remaining_s() == 0.0
    status, body = error_response(deadline.error())
    assert status == 504
    assert body["error"]["code"] == "deadline_exceeded"
    assert body["error"]["type"] == "timeout_error"


def test_within_raises_deadline_exceeded() -> None:
    async def main() -> None:
        deadline = Deadline.start(0.05, Clock())  # stopped: 0.05 s left for either call
        assert await OverloadGuard.within(deadline, asyncio.sleep(0, result=7)) == 7
        with pytest.raises(DeadlineExceededError):
            await OverloadGuard.within(deadline, asyncio.Event().wait())

    asyncio.run(main())


def test_config_is_validated_with_clear_messages() -> None:
    base = {"pools": [{"name": "d", "role": "decode"}], "local_prefill_threshold": 10**6}
    config = load_config(base)
    assert config.overload.default_timeout_s == 600
    assert config.pools[0].serve_options()["max_queued_requests"] == 256
    with pytest.raises(ValidationError, match="unknown SLO class"):
        load_config({**base, "overload": {"class_timeouts_s": {"nope": 5}}})
    with pytest.raises(ValidationError, match="must be <= overload.max_timeout_s"):
        load_config({**base, "overload": {"default_timeout_s": 100, "max_timeout_s": 50}})
    with pytest.raises(ValidationError, match="min_factor"):
        load_config({**base, "overload": {"shedding": {"factor": 0.5, "min_factor": 1}}})
    with pytest.raises(ValidationError, match="failure_threshold"):
        load_config({**base, "overload": {"breaker": {"failure_threshold": 0}}})


def test_serve_backpressure_is_a_clean_503() -> None:
    from ray.serve.exceptions import BackPressureError

    error = OverloadGuard.backpressure(
        BackPressureError(num_queued_requests=256, max_queued_requests=256)
    )
    assert error is not None
    status, body = error_response(error)
    assert status == 503 and body["error"]["code"] == "overloaded"
    assert error.headers["Retry-After"] == "1"
    assert OverloadGuard.backpressure(RuntimeError("other")) is None


def test_deadline_timer_puts_the_504_into_the_queue() -> None:
    async def main() -> None:
        queue: asyncio.Queue[object] = asyncio.Queue()
        assert OverloadGuard.deadline_timer(None, queue) is None
        timer = OverloadGuard.deadline_timer(Deadline.start(0.01), queue)
        assert timer is not None
        item = await asyncio.wait_for(queue.get(), timeout=30)
        assert isinstance(item, DeadlineExceededError)
        cancelled = OverloadGuard.deadline_timer(Deadline.start(0.01), queue)
        assert cancelled is not None
        cancelled.cancel()
        await asyncio.sleep(0.05)
        assert queue.empty()

    asyncio.run(main())
