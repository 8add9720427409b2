"""Quota building blocks, deterministic: token buckets and leases on an injected clock, the
slot counts and the class-ordered wait queue, the quota ledger driven in-process, and the
ingress side (`Admission`) against it."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from app.admission import controller
from app.admission.controller import Admission
from app.admission.leases import Lease
from app.admission.quota_service import QuotaLedger
from app.admission.quotas import Limit, SlotCounts, SlotDemand, TokenBucket, WaitQueue
from app.config import AdmissionSettings, TenantQuota
from app.errors import RateLimitError

# ---- token bucket ----------------------------------------------------------------------


def test_bucket_grants_all_of_need_or_nothing_and_refills() -> None:
    bucket = TokenBucket.full(capacity=10, rate=2, now=0.0)
    assert bucket.take(need=4, want=4, now=0.0) == 4
    assert bucket.take(need=1, want=100, now=0.0) == 6  # as many as there are, up to want
    assert bucket.take(need=1, want=1, now=0.0) == 0
    assert bucket.seconds_until(3, now=0.0) == pytest.approx(1.5)
    assert bucket.take(need=3, want=3, now=1.0) == 0  # 2 tokens after 1 s
    assert bucket.take(need=3, want=3, now=1.5) == 3
    bucket.refill(now=100.0)
    assert bucket.tokens == 10  # never above capacity


def test_bucket_debt_blocks_until_repaid_and_returns_cap_at_capacity() -> None:
    bucket = TokenBucket.full(capacity=60, rate=1, now=0.0)
    bucket.charge(80, now=0.0)  # output already produced: -20
    assert bucket.take(need=1, want=1, now=0.0) == 0
    assert bucket.seconds_until(1, now=0.0) == pytest.approx(21)
    assert bucket.take(need=1, want=1, now=21.0) == 1
    bucket.give_back(1000, now=21.0)
    assert bucket.tokens == 60
    assert math.isinf(bucket.seconds_until(61, now=21.0))  # more than capacity: never


def test_bucket_rejects_a_zero_rate() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        TokenBucket.full(capacity=1, rate=0, now=0.0)


# ---- leases --------------------------------------------------------------------------------


def test_lease_takes_locally_and_returns_idle_tokens_after_ttl() -> None:
    lease = Lease(capacity=100, fraction=0.25)
    assert lease.batch == 25
    assert not lease.try_take(10, now=0.0)
    assert lease.shortfall(10) == 10
    lease.add(25, now=0.0)
    assert lease.try_take(10, now=0.5) and lease.available == 15
    assert lease.idle_tokens(now=1.0, ttl_s=2.0) == 0  # used 0.5 s ago
    assert lease.idle_tokens(now=2.5, ttl_s=2.0) == 15
    assert lease.available == 0


def test_lease_turns_output_beyond_it_into_debt() -> None:
    lease = Lease(capacity=60, fraction=0.5)
    lease.add(30, now=0.0)
    lease.spend(40, now=0.0)
    assert (lease.available, lease.debt) == (0, 10)
    assert lease.take_debt() == 10 and lease.debt == 0


def test_lease_batch_is_at_least_one_token() -> None:
    assert Lease(capacity=3, fraction=0.1).batch == 1


# ---- slots and the wait queue ----------------------------------------------------------


def test_slots_count_sequences_and_requests() -> None:
    slots = SlotCounts(max_requests=3, max_sequences=8)
    slots.acquire(SlotDemand(8))
    assert slots.refusal(SlotDemand(1)) is Limit.CONCURRENT_SEQUENCES
    slots.release(SlotDemand(8))
    for _ in range(3):
        slots.acquire(SlotDemand(1))
    assert slots.refusal(SlotDemand(1)) is Limit.CONCURRENT_REQUESTS
    assert slots.never_fits(SlotDemand(9)) is Limit.CONCURRENT_SEQUENCES
    assert slots.never_fits(SlotDemand(8)) is None


def test_kv_share_counts_blocks_per_decode_pool() -> None:
    slots = SlotCounts(max_requests=None, max_sequences=None)
    slots.acquire(SlotDemand(1, "a", num_kv_blocks=60, max_kv_blocks=100))
    assert slots.refusal(SlotDemand(1, "a", 41, 100)) is Limit.KV_SHARE
    assert slots.refusal(SlotDemand(1, "a", 40, 100)) is None
    assert slots.refusal(SlotDemand(1, "b", 100, 100)) is None  # another pool's share
    assert slots.never_fits(SlotDemand(1, "b", 101, 100)) is Limit.KV_SHARE
    slots.release(SlotDemand(1, "a", 60, 100))
    assert slots.kv_blocks == {"a": 0}


def test_wait_queue_serves_the_most_important_class_first_fifo_within() -> None:
    queue: WaitQueue[str] = WaitQueue()
    for item, priority in [("batch-1", 10), ("int-1", 0), ("batch-2", 10), ("int-2", 0)]:
        queue.push(item, priority)
    assert queue.remove("int-2")
    assert not queue.remove("absent")
    assert [queue.pop() for _ in range(len(queue))] == ["int-1", "batch-1", "batch-2"]


# ---- the quota service, in-process --------------------------------------------------------


def _service(**quota: Any) -> QuotaLedger:
    return QuotaLedger({"t": (TenantQuota(**quota), None)}, clock=lambda: 0.0)


def test_service_leases_never_exceed_the_bucket() -> None:
    async def scenario() -> None:
        service = _service(requests_per_second=0.001, request_burst=6)
        rate = Limit.REQUESTS_PER_SECOND.value
        grants = [(await service.acquire_tokens("t", rate, 1, 4))[0] for _ in range(3)]
        assert grants == [4, 2, 0]
        granted, retry_after_s = await service.acquire_tokens("t", rate, 1, 4)
        assert granted == 0 and retry_after_s == 1000  # one token at 0.001/s
        await service.return_tokens("t", rate, 2)  # an idle lease comes back
        assert (await service.acquire_tokens("t", rate, 1, 4))[0] == 2

    asyncio.run(scenario())


def test_service_queue_admits_by_class_and_refuses_past_its_length() -> None:
    async def scenario() -> list[str]:
        service = _service(max_concurrent_sequences=4, max_queued_requests=2)
        assert await service.acquire_slots("t", "holder", SlotDemand(4), 0, 10) == (None, None)
        order: list[str] = []

        async def wait(grant_id: str, priority: int) -> None:
            code, _ = await service.acquire_slots("t", grant_id, SlotDemand(2), priority, 10)
            assert code is None
            order.append(grant_id)

        batch = asyncio.create_task(wait("batch", 10))
        await asyncio.sleep(0)
        interactive = asyncio.create_task(wait("interactive", 0))
        await asyncio.sleep(0)
        code, retry_after_s = await service.acquire_slots("t", "third", SlotDemand(1), 0, 10)
        assert code == Limit.QUEUED_REQUESTS.value and retry_after_s == 1.0
        code, retry_after_s = await service.acquire_slots("t", "huge", SlotDemand(5), 0, 10)
        assert code == Limit.CONCURRENT_SEQUENCES.value and retry_after_s is None
        await service.release_slots("holder")  # 4 free: both waiters (2 each) fit, in order
        await asyncio.gather(batch, interactive)
        assert (await service.stats())["t"]["num_sequences"] == 4
        await service.release_slots("batch")
        await service.release_slots("batch")  # idempotent
        await service.release_slots("interactive")
        assert (await service.stats())["t"]["num_sequences"] == 0
        return order

    assert asyncio.run(scenario()) == ["interactive", "batch"]


def test_service_queue_times_out_and_release_before_acquire_wins() -> None:
    async def scenario() -> None:
        service = _service(max_concurrent_sequences=1, max_queued_requests=1)
        assert await service.acquire_slots("t", "a", SlotDemand(1), 0, 10) == (None, None)
        code, _ = await service.acquire_slots("t", "b", SlotDemand(1), 0, 0.05)
        assert code == Limit.CONCURRENT_SEQUENCES.value
        assert (await service.stats())["t"]["num_queued"] == 0
        await service.release_slots("c")  # the caller gave up before its acquire arrived
        await service.release_slots("a")
        code, _ = await service.acquire_slots("t", "c", SlotDemand(1), 0, 10)
        assert code is not None and (await service.stats())["t"]["num_sequences"] == 0

    asyncio.run(scenario())


def test_a_silent_owners_grants_are_freed_and_a_renewing_owners_kept() -> None:
    """An ingress replica that dies holding grants (no release will come) frees them once
    silent for the owner TTL; one that renews keeps its grants however long they run."""
    clock = _Clock()
    quotas = {"t": (TenantQuota(max_queued_requests=1), 1)}
    ledger = QuotaLedger(quotas, clock=clock, owner_ttl_s=60)

    async def scenario() -> None:
        assert await ledger.acquire_slots("t", "a1", SlotDemand(1), 0, 10, "a") == (None, None)
        code, _ = await ledger.acquire_slots("t", "b1", SlotDemand(1), 0, 0.01, "b")
        assert code == Limit.CONCURRENT_REQUESTS.value
        for _ in range(5):  # a renews for five minutes: its grant stays
            clock.now += 59
            await ledger.renew("a")
            await ledger.renew("b")
        assert ledger.reap() == 0
        assert (await ledger.stats())["t"]["num_requests"] == 1
        # a waiter of b's queues behind a's grant; then a falls silent (it died)
        waiter = asyncio.ensure_future(ledger.acquire_slots("t", "b2", SlotDemand(1), 0, 30, "b"))
        await asyncio.sleep(0)
        clock.now += 61
        await ledger.renew("b")  # any call reaps: a's grant goes, b's waiter gets it
        assert await waiter == (None, None)
        assert ledger.reap() == 0
        await ledger.release_slots("a1")  # a late release of the freed grant changes nothing
        assert (await ledger.stats())["t"]["num_requests"] == 1
        await ledger.release_slots("b2")
        assert (await ledger.stats())["t"]["num_requests"] == 0
        assert ledger._grant_owners == {}  # nothing kept for refused or released grants

    asyncio.run(scenario())


def test_a_silent_owners_queued_request_is_withdrawn_not_granted_ownerless() -> None:
    """A request still queued when its owner is reaped leaves the queue (its caller is
    gone): had it been granted afterwards it would have had no owner to free it."""
    clock = _Clock()
    quotas = {"t": (TenantQuota(max_queued_requests=2), 1)}
    ledger = QuotaLedger(quotas, clock=clock, owner_ttl_s=60)

    async def scenario() -> None:
        assert await ledger.acquire_slots("t", "b1", SlotDemand(1), 0, 10, "b") == (None, None)
        waiter = asyncio.ensure_future(ledger.acquire_slots("t", "a1", SlotDemand(1), 0, 600, "a"))
        await asyncio.sleep(0)
        assert (await ledger.stats())["t"]["num_queued"] == 1
        clock.now += 61
        await ledger.renew("b")  # a is silent: its queued request is withdrawn
        code, _ = await asyncio.wait_for(waiter, 5)  # old code: waits out its 600 s
        assert code == Limit.CONCURRENT_REQUESTS.value
        await ledger.release_slots("b1")
        stats = (await ledger.stats())["t"]
        assert stats["num_requests"] == 0 and stats["num_queued"] == 0
        assert ledger._grant_owners == {}

    asyncio.run(scenario())


# ---- the ingress side (Admission) against the in-process service --------------------------


class _InProcess:
    """A `QuotaLedger` behind `.remote(...)`, as its actor handle offers it; `ledger` hands
    out this handle, as the `QuotaService` deployment does. Counts the calls."""

    def __init__(self, ledger: QuotaLedger) -> None:
        self.ledger_object = ledger
        self.num_calls = 0

    def __getattr__(self, method: str) -> Any:
        outer = self

        class _Method:
            def remote(self, *args: Any) -> Any:
                if method == "ledger":
                    return _done(outer)
                outer.num_calls += 1
                return getattr(outer.ledger_object, method)(*args)

        return _Method()


async def _done(value: Any) -> Any:
    return value


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _admissions(quota: TenantQuota, replicas: int = 2) -> tuple[list[Admission], _InProcess]:
    quotas = {"t": (quota, None)}
    handle = _InProcess(QuotaLedger(quotas, clock=lambda: 0.0))
    settings = AdmissionSettings(lease_fraction=0.5)
    replica_list = [
        Admission(settings, quotas, handle, kv_pool_blocks={"decode": 100}, clock=_Clock())
        for _ in range(replicas)
    ]
    return replica_list, handle


def test_two_replicas_admit_exactly_the_burst_with_leases() -> None:
    async def scenario() -> tuple[int, int]:
        replicas, handle = _admissions(TenantQuota(requests_per_second=0.001, request_burst=6))
        admitted = 0
        for i in range(20):  # alternate replicas, as the proxy would
            try:
                await replicas[i % 2].admit("t", f"r{i}", 10, 1, 0)
                admitted += 1
            except RateLimitError as exc:
                assert exc.code == "tenant_rate_limit"
                assert int(exc.headers["Retry-After"]) > 900
        return admitted, handle.num_calls

    admitted, num_calls = asyncio.run(scenario())
    assert admitted == 6
    assert num_calls < 20  # leases of 3: most requests need no remote call


def test_refused_request_puts_back_what_it_took() -> None:
    async def scenario() -> None:
        quota = TenantQuota(request_burst=2, requests_per_second=0.001, prompt_tokens_per_minute=60)
        (replica,), _ = _admissions(quota, replicas=1)
        with pytest.raises(RateLimitError) as refused:
            await replica.admit("t", "big", 61, 1, 0)
        assert refused.value.code == "tenant_prompt_tokens_per_minute"
        assert "Retry-After" not in refused.value.headers  # it can never fit
        await replica.admit("t", "a", 30, 1, 0)  # the request token was put back
        await replica.admit("t", "b", 30, 1, 0)

    asyncio.run(scenario())


def test_output_debt_refuses_the_next_request() -> None:
    async def scenario() -> None:
        (replica,), handle = _admissions(TenantQuota(output_tokens_per_minute=60), replicas=1)
        admitted = await replica.admit("t", "a", 5, 1, 0)
        admitted.on_output(100)  # 40 beyond the bucket
        admitted.release()
        await asyncio.sleep(0)  # the debt's charge runs in the background
        with pytest.raises(RateLimitError) as refused:
            await replica.admit("t", "b", 5, 1, 0)
        assert refused.value.code == "tenant_output_tokens_per_minute"
        assert int(refused.value.headers["Retry-After"]) == 41  # from -40 to 1 at 1/s

    asyncio.run(scenario())


def test_kv_share_is_a_share_of_the_pool_counted_at_the_most_a_request_can_fill() -> None:
    async def scenario() -> None:
        (replica,), _ = _admissions(TenantQuota(kv_block_share=0.5), replicas=1)
        # 50 blocks of 16 tokens: a request of 20 + 60 tokens can fill 5 blocks per choice.
        first = await replica.admit("t", "a", 20, 8, 0, "decode", 60)  # 40 blocks
        with pytest.raises(RateLimitError) as refused:
            await replica.admit("t", "b", 20, 3, 0, "decode", 60)  # 15 more: over 50
        assert refused.value.code == "tenant_kv_share"
        assert "quota.kv_block_share" in refused.value.message
        await replica.admit("t", "c", 20, 2, 0, "decode", 60)  # 10 more: 50 exactly
        with pytest.raises(RateLimitError) as never:
            await replica.admit("t", "d", 20, 11, 0, "decode", 60)  # 55 alone
        assert "Retry-After" not in never.value.headers
        first.release()
        await asyncio.sleep(0)  # the release runs in the background
        await replica.admit("t", "e", 20, 8, 0, "decode", 60)  # the 40 blocks are back

    asyncio.run(scenario())


class _FailingReleases(_InProcess):
    """The in-process ledger, whose first `failures` release calls fail (a ledger that did
    not answer in time)."""

    def __init__(self, ledger: QuotaLedger, failures: int) -> None:
        super().__init__(ledger)
        self.failures = failures

    def __getattr__(self, method: str) -> Any:
        if method == "release_slots" and self.failures > 0:
            self.failures -= 1

            class _Fails:
                def remote(self, *args: Any) -> Any:
                    raise RuntimeError("the ledger did not answer")

            return _Fails()
        return super().__getattr__(method)


def test_a_release_the_ledger_missed_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller, "RELEASE_RETRY_FIRST_S", 0.01)
    quotas = {"t": (TenantQuota(), 1)}
    ledger = QuotaLedger(quotas, clock=lambda: 0.0)
    handle = _FailingReleases(ledger, failures=3)
    replica = Admission(AdmissionSettings(), quotas, handle, kv_pool_blocks={}, clock=_Clock())

    async def scenario() -> None:
        admitted = await replica.admit("t", "a", 5, 1, 0)
        with pytest.raises(RateLimitError):
            await replica.admit("t", "b", 5, 1, 0)  # the one slot is held
        admitted.release()
        deadline = asyncio.get_running_loop().time() + 30
        while (await ledger.stats())["t"]["num_requests"]:
            assert asyncio.get_running_loop().time() < deadline, "the slot was never freed"
            await asyncio.sleep(0.01)
        assert handle.failures == 0  # freed by the fourth attempt
        await replica.admit("t", "c", 5, 1, 0)

    asyncio.run(scenario())


def test_a_replica_renews_while_its_request_waits_in_the_queue() -> None:
    """A request queued past the owner TTL (a long `queue_timeout_s`) is not withdrawn as a
    dead owner's: its replica renews while it waits, and it gets the slot when freed."""
    clock = _Clock()
    quotas = {"t": (TenantQuota(max_queued_requests=1), 1)}
    ledger = QuotaLedger(quotas, clock=clock, owner_ttl_s=60)
    handle = _InProcess(ledger)
    holder = Admission(
        AdmissionSettings(lease_ttl_s=0.02), quotas, handle, kv_pool_blocks={}, clock=clock
    )
    settings = AdmissionSettings(lease_ttl_s=0.02, queue_timeout_s=600)
    waiter = Admission(settings, quotas, handle, kv_pool_blocks={}, clock=clock)

    async def scenario() -> None:
        held = await holder.admit("t", "a", 5, 1, 0)
        queued = asyncio.ensure_future(waiter.admit("t", "b", 5, 1, 0))
        while not (await ledger.stats())["t"]["num_queued"]:
            await asyncio.sleep(0.01)
        for _ in range(3):  # 150 s queued, both replicas renewing
            clock.now += 50
            await asyncio.sleep(0.1)
            await ledger.renew("someone else")  # reaps
        assert (await ledger.stats())["t"]["num_queued"] == 1
        held.release()
        admitted = await asyncio.wait_for(queued, 10)
        admitted.release()

    asyncio.run(scenario())


def test_a_replica_renews_its_grants_while_it_holds_them() -> None:
    clock = _Clock()
    quotas = {"t": (TenantQuota(), 2)}
    ledger = QuotaLedger(quotas, clock=clock, owner_ttl_s=60)
    handle = _InProcess(ledger)
    settings = AdmissionSettings(lease_ttl_s=0.02)
    replica = Admission(settings, quotas, handle, kv_pool_blocks={}, clock=clock)

    async def renewals(calls: int) -> int:
        before = handle.num_calls
        await asyncio.sleep(calls * 0.01 + 0.2)
        return handle.num_calls - before

    async def scenario() -> None:
        admitted = await replica.admit("t", "a", 5, 1, 0)
        assert ledger._grant_owners == {"a": replica.owner}
        clock.now += 50
        assert await renewals(10) > 0  # the sweeper renews while "a" is held
        clock.now += 50  # 100 s since the acquire, 50 since a renewal: still held
        await ledger.renew("someone else")  # reaps
        assert (await ledger.stats())["t"]["num_requests"] == 1
        admitted.release()
        await asyncio.sleep(0.05)
        assert await renewals(10) == 0  # nothing held: nothing to renew

    asyncio.run(scenario())
