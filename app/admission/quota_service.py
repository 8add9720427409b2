"""The quota service: every tenant's global quota state, shared by all ingress replicas.

`QuotaService` is a Serve deployment with one replica (`build_app` creates it; every ingress
replica holds its handle). The state lives in a `QuotaLedger` Ray actor that the replica
creates and owns, so it lives and dies with the app (a restarted replica starts a fresh
ledger). Ingress replicas ask the deployment once for the ledger's actor handle
(`ledger`) and then call the ledger directly: a plain actor call has no router queue probe,
which a busy ingress (one relaying many streams) can miss for a long time. The ledger is an
async actor: every method is a coroutine on its one event loop, so none interleaves inside
a check-and-take and a limit cannot be passed by two replicas racing.

Two kinds of state, two protocols:
- Token buckets (requests/s, prompt and output tokens/min) are *leased*: an ingress replica
  takes a batch of tokens per call (`acquire_tokens`), spends them locally, returns idle
  ones (`return_tokens`) and charges output tokens it produced beyond its lease
  (`charge_tokens`). See `app/admission/leases.py` for the trade-off.
- Concurrency slots (requests, sequences, KV blocks of a decode pool) are taken one request
  at a time (`acquire_slots` / `release_slots`), so the count is exact: a hard limit. A
  lease of idle slots would keep the total exact too, but slots idle in one replica would
  make another replica's requests queue or fail while the tenant is under its limit, and
  would break the class order of the tenant's queue, which lives here. So a tenant with a
  concurrency limit pays one call per request (the release is not awaited by the request).
  Waiters queue here, most important class first, up to the tenant's `max_queued_requests`.

A request's slots are named by its grant id, so a release that overtakes its own acquire (a
client that went away) still frees them, and a release is idempotent. If the ledger
restarts, the counts start from zero again (requests then in flight are not counted until
they finish).

A grant also names its owner, the ingress replica that holds it, which renews its claim
(`renew`) while it holds any. An owner silent for `owner_ttl_s` is taken for dead (killed,
crashed, or stopped before its last releases got out) and its grants are freed, so a dead
ingress replica cannot hold a tenant's slots for good. A live owner stalled that long loses
its grants early: its tenants may briefly run over their limit, never under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import ray

from app.admission.quotas import Limit, SlotDemand, TenantLedger, WaitQueue
from app.config import TenantQuota

# One replica: the ledger it owns is the state.
QUOTA_SERVICE_OPTIONS: dict[str, Any] = {
    "name": "quota_service",
    "num_replicas": 1,
    "ray_actor_options": {"num_cpus": 0.05},
}
# Waiting acquires hold a call open each, so the ledger runs many coroutines at once.
LEDGER_MAX_CONCURRENCY = 10_000
HEALTH_TIMEOUT_S = 10.0
RETRY_AFTER_SLOT_S = 1.0  # no refill time for a slot: a client should try again soon
OWNER_TTL_S = 60.0  # an ingress replica renews every ~1 s while it holds grants
_MAX_ABANDONED = 10_000


@dataclass(slots=True)
class SlotWaiter:
    grant_id: str
    demand: SlotDemand
    # True: slots held; False: stopped waiting (timed out, withdrawn)
    granted: asyncio.Future[bool] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class QuotaLedger:
    """The global quota state (see the module docstring); a Ray actor in production."""

    def __init__(
        self,
        tenants: Mapping[str, tuple[TenantQuota, int | None]],
        clock: Callable[[], float] = time.monotonic,
        owner_ttl_s: float = OWNER_TTL_S,
    ) -> None:
        """`tenants`: name -> (quota, max_concurrent_requests), as `tenant_quotas` gives."""
        self._clock = clock
        self._owner_ttl_s = owner_ttl_s
        self._owners: dict[str, float] = {}  # owner -> when it last called
        self._grant_owners: dict[str, str] = {}  # grant id -> owner
        self._reaper: asyncio.Task[None] | None = None
        now = clock()
        self._ledgers = {
            name: TenantLedger(quota, max_requests, now)
            for name, (quota, max_requests) in tenants.items()
        }
        self._queues: dict[str, WaitQueue[SlotWaiter]] = {n: WaitQueue() for n in tenants}
        self._grants: dict[str, tuple[str, SlotDemand]] = {}  # grant id -> (tenant, demand)
        self._waiting: dict[str, tuple[str, SlotWaiter]] = {}  # grant id -> (tenant, waiter)
        self._abandoned: OrderedDict[str, None] = OrderedDict()

    # ---- token buckets ----------------------------------------------------------------

    async def acquire_tokens(
        self, tenant: str, limit: str, need: float, want: float
    ) -> tuple[float, float]:
        """Lease tokens: `(granted, retry_after_s)`. Grants between `need` and `want`, or
        nothing with the seconds until `need` will be there (inf: need > capacity)."""
        bucket = self._ledgers[tenant].buckets[Limit(limit)]
        now = self._clock()
        granted = bucket.take(need, want, now)
        if granted > 0 or need <= 0:
            return granted, 0.0
        return 0.0, bucket.seconds_until(need, now)

    async def charge_tokens(self, tenant: str, limit: str, amount: float) -> None:
        """Charge tokens already spent beyond a lease (the bucket may go into debt)."""
        self._ledgers[tenant].buckets[Limit(limit)].charge(amount, self._clock())

    async def return_tokens(self, tenant: str, limit: str, amount: float) -> None:
        """Give back the unused tokens of an idle lease."""
        self._ledgers[tenant].buckets[Limit(limit)].give_back(amount, self._clock())

    # ---- concurrency slots ------------------------------------------------------------

    async def acquire_slots(
        self,
        tenant: str,
        grant_id: str,
        demand: SlotDemand,
        priority: int,
        timeout_s: float,
        owner: str | None = None,
    ) -> tuple[str | None, float | None]:
        """Hold one request's slots: `(None, None)` when held (release with `grant_id`),
        else `(limit code, retry_after_s)`; retry None when no retry can succeed. Waits up
        to `timeout_s` in the tenant's queue when the tenant allows queued requests.
        `owner`: the ingress replica holding the grant (None: held until released)."""
        if owner is not None:
            self._seen(owner)
            self._grant_owners[grant_id] = owner
        try:
            return await self._acquire_slots(tenant, grant_id, demand, priority, timeout_s)
        finally:
            if grant_id not in self._grants:  # not held: nothing to free when owner dies
                self._grant_owners.pop(grant_id, None)

    async def _acquire_slots(
        self, tenant: str, grant_id: str, demand: SlotDemand, priority: int, timeout_s: float
    ) -> tuple[str | None, float | None]:
        ledger = self._ledgers[tenant]
        slots, queue = ledger.slots, self._queues[tenant]
        if grant_id in self._abandoned:  # released before it got here: the caller is gone
            del self._abandoned[grant_id]
            return Limit.CONCURRENT_REQUESTS.value, RETRY_AFTER_SLOT_S
        never = slots.never_fits(demand)
        if never is not None:
            return never.value, None
        refusal = slots.refusal(demand)
        if refusal is None and not queue:
            self._hold(tenant, grant_id, demand)
            return None, None
        if len(queue) >= ledger.max_queued:
            limit = Limit.QUEUED_REQUESTS if ledger.max_queued else refusal
            return (limit or Limit.CONCURRENT_REQUESTS).value, RETRY_AFTER_SLOT_S
        waiter = SlotWaiter(grant_id, demand)
        queue.push(waiter, priority)
        self._waiting[grant_id] = (tenant, waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiter.granted), timeout_s)
        except asyncio.CancelledError:
            self._unqueue(grant_id)
            if waiter.granted.done() and waiter.granted.result():
                self._release(grant_id)
            raise
        self._unqueue(grant_id)
        if waiter.granted.done() and waiter.granted.result():
            return None, None
        limit = slots.refusal(demand) or refusal or Limit.CONCURRENT_REQUESTS
        return limit.value, RETRY_AFTER_SLOT_S

    async def release_slots(self, grant_id: str) -> None:
        """Free a request's slots (idempotent), or withdraw it from the queue."""
        self._release(grant_id)

    async def renew(self, owner: str) -> None:
        """`owner` is alive: its grants stay held for another `owner_ttl_s`."""
        self._seen(owner)

    def _seen(self, owner: str) -> None:
        self._owners[owner] = self._clock()
        self.reap()
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    def reap(self) -> int:
        """Free the grants of owners silent for `owner_ttl_s`; how many were freed."""
        now = self._clock()
        dead = {o for o, seen in self._owners.items() if now - seen > self._owner_ttl_s}
        if not dead:
            return 0
        for owner in dead:
            del self._owners[owner]
        orphans = [g for g, owner in self._grant_owners.items() if owner in dead]
        for grant_id in orphans:  # held: freed; still queued: withdrawn (granted later, it
            self._release(grant_id)  # would have no owner left to free it)
        return len(orphans)

    async def _reap_forever(self) -> None:
        """While owners are known: reap now and then (waiters need no other call)."""
        while self._owners:
            await asyncio.sleep(self._owner_ttl_s / 4)
            self.reap()

    def _release(self, grant_id: str) -> None:
        self._grant_owners.pop(grant_id, None)
        held = self._grants.pop(grant_id, None)
        if held is None:
            if not self._unqueue(grant_id):
                self._abandoned[grant_id] = None
                while len(self._abandoned) > _MAX_ABANDONED:
                    self._abandoned.popitem(last=False)
            return
        tenant, demand = held
        self._ledgers[tenant].slots.release(demand)
        self._dispatch(tenant)

    def _hold(self, tenant: str, grant_id: str, demand: SlotDemand) -> None:
        self._ledgers[tenant].slots.acquire(demand)
        self._grants[grant_id] = (tenant, demand)

    def _dispatch(self, tenant: str) -> None:
        """Admit the queue's head while it fits (strict class order: no overtaking)."""
        slots, queue = self._ledgers[tenant].slots, self._queues[tenant]
        while queue and slots.refusal(queue.peek().demand) is None:
            waiter = queue.pop()
            del self._waiting[waiter.grant_id]
            self._hold(tenant, waiter.grant_id, waiter.demand)
            waiter.granted.set_result(True)

    def _unqueue(self, grant_id: str) -> bool:
        """Take a waiter out of its queue (it stops waiting); False if none is there."""
        entry = self._waiting.pop(grant_id, None)
        if entry is None:
            return False
        tenant, waiter = entry
        self._queues[tenant].remove(waiter)
        if not waiter.granted.done():
            waiter.granted.set_result(False)
        self._dispatch(tenant)  # the waiters behind it may fit
        return True

    # ---- operations -------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """Per tenant: slots in use, queue length and each bucket's tokens now."""
        now = self._clock()
        report: dict[str, Any] = {}
        for name, ledger in self._ledgers.items():
            buckets = {}
            for limit, bucket in ledger.buckets.items():
                bucket.refill(now)
                buckets[limit.value] = round(bucket.tokens, 3)
            report[name] = {
                "num_requests": ledger.slots.num_requests,
                "num_sequences": ledger.slots.num_sequences,
                "kv_blocks": dict(ledger.slots.kv_blocks),
                "num_queued": len(self._queues[name]),
                "buckets": buckets,
            }
        return report


class QuotaService:
    """The Serve deployment that owns the `QuotaLedger` actor and hands out its handle."""

    def __init__(self, tenants: Mapping[str, tuple[TenantQuota, int | None]]) -> None:
        actor = ray.remote(QuotaLedger).options(num_cpus=0, max_concurrency=LEDGER_MAX_CONCURRENCY)
        self._ledger: Any = cast(Any, actor.remote(tenants))
        # The ledger starts a worker process, which a loaded machine can take longer to do
        # than HEALTH_TIMEOUT_S: Serve's first health check follows this constructor, so the
        # replica is constructed once the ledger answers (a constructor has no deadline).
        ray.get(self._ledger.stats.remote())

    async def ledger(self) -> Any:
        """The ledger's actor handle (ingress replicas call it directly)."""
        return self._ledger

    async def stats(self) -> dict[str, Any]:
        """The ledger's per-tenant state."""
        result: dict[str, Any] = await self._ledger.stats.remote()
        return result

    async def check_health(self) -> None:
        """Serve's health check: the ledger answers (else Serve restarts this replica, and
        with it a fresh ledger)."""
        await asyncio.wait_for(self._ledger.stats.remote(), HEALTH_TIMEOUT_S)
