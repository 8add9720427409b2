"""Admission at the ingress: a request's tenant quotas, checked against the global state.

`Admission.admit` runs once per request, after validation and routing and before any pool
sees it. In order: the request bucket (1), the prompt-token bucket (the prompt's length),
the output-token bucket (must not be in debt), then the concurrency slots (requests, and
sequences counting `n`, and the tenant's share of its decode pool's KV blocks), for which
the request may wait in the tenant's queue. The token checks draw on this replica's leases
(`app/admission/leases.py`), so they cost no remote call most of the time; a refused check
puts back what earlier checks took. The returned `Admitted` charges output tokens as they
stream and frees the slots when the request ends. Calls go to the quota ledger actor
(`app/admission/quota_service.py`); background ones (releases, returned leases, output
debt) are not awaited by the request.

Errors: 429 `RateLimitError` with `code` naming the limit (`Limit`) and a Retry-After from
the bucket's refill time (none when the request can never fit the quota); 503
`quota_service_unavailable` when the quota service does not answer in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ray.exceptions import RayActorError

from app.admission.leases import Lease
from app.admission.quotas import Limit, SlotDemand
from app.config import AdmissionSettings, PDServeConfig, TenantConfig, TenantQuota
from app.errors import RateLimitError, ServiceUnavailableError
from engine.config import ModelConfig
from engine.cuda_graphs import uses_decode_graphs
from engine.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)

_TAKE_ATTEMPTS = 3  # other requests of this replica may drain a fresh grant first
# A release the ledger did not answer is retried, backing off, for this long.
RELEASE_RETRY_FIRST_S = 0.5
RELEASE_RETRY_MAX_S = 5.0
RELEASE_RETRY_FOR_S = 120.0


def _capacities(quota: TenantQuota) -> dict[Limit, float]:
    capacities: dict[Limit, float] = {}
    if quota.burst is not None:
        capacities[Limit.REQUESTS_PER_SECOND] = quota.burst
    if quota.prompt_tokens_per_minute is not None:
        capacities[Limit.PROMPT_TOKENS_PER_MINUTE] = quota.prompt_tokens_per_minute
    if quota.output_tokens_per_minute is not None:
        capacities[Limit.OUTPUT_TOKENS_PER_MINUTE] = quota.output_tokens_per_minute
    return capacities


def _refusal(
    tenant: str, limit: Limit, value: float, retry_after_s: float | None
) -> RateLimitError:
    message = f"tenant {tenant!r} is over its {limit.field} quota ({value:g})"
    if retry_after_s is None or math.isinf(retry_after_s):
        message += "; this request alone exceeds it and can never be admitted"
        retry_after_s = None
    return RateLimitError(message, code=limit.value, retry_after_s=retry_after_s)


class Admitted:
    """An admitted request: charges its output tokens, then frees its slots (`release`)."""

    def __init__(self, admission: Admission, tenant: str, grant_id: str | None) -> None:
        self._admission = admission
        self._tenant = tenant
        self._grant_id = grant_id
        self._released = False

    def on_output(self, num_tokens: int) -> None:
        """`num_tokens` more output tokens were produced (charged to the tenant's bucket)."""
        if num_tokens > 0:
            self._admission.spend_output(self._tenant, num_tokens)

    def release(self) -> None:
        """The request ended (any way): free its slots, charge its output debt. Idempotent."""
        if self._released:
            return
        self._released = True
        self._admission.flush_debt(self._tenant)
        if self._grant_id is not None:
            self._admission.release_slots(self._grant_id)


def tenant_quotas(tenants: Sequence[TenantConfig]) -> dict[str, tuple[TenantQuota, int | None]]:
    """Each tenant's quota and concurrent-request limit; tenants without any are left out."""
    return {
        t.name: (t.quota, t.max_concurrent_requests)
        for t in tenants
        if t.max_concurrent_requests is not None or t.quota != TenantQuota()
    }


def decode_pool_blocks(
    config: PDServeConfig, model_config: ModelConfig, fallback_config: ModelConfig | None = None
) -> dict[str, int]:
    """KV blocks of each pool that decodes (decode pools, and prefill pools that serve whole
    requests): one replica's blocks x its replicas (the fixed count, or the autoscaling
    minimum: the share must hold even at the smallest size). `fallback_config`: the
    fallback pool's own model (required when there is one)."""
    blocks: dict[str, int] = {}
    for pool in config.pools:
        if pool.role != "decode" and not pool.serves_decode:
            continue
        own = fallback_config if pool.fallback else model_config
        assert own is not None, f"fallback pool {pool.name} needs its model config"
        engine_config = config.engine_config(pool)
        spec = KVCacheSpec.for_engine(engine_config, own)
        # A replica capturing CUDA graphs keeps one block as its padding rows' scratch.
        usable = spec.num_blocks - uses_decode_graphs(engine_config)
        replicas = pool.autoscaling.min_replicas if pool.autoscaling else pool.num_replicas
        blocks[pool.name] = usable * (replicas or 1)
    return blocks


class Admission:
    """One ingress replica's side of the tenants' quotas (see the module docstring).

    `service` is the quota service deployment's handle (None when no tenant has a quota:
    `admit` then checks nothing); calls go straight to the ledger actor it names.
    `kv_pool_blocks`: each decode pool's KV blocks (all its replicas), which
    `quota.kv_block_share` is a share of. `clock` is injectable for tests.
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        quotas: Mapping[str, tuple[TenantQuota, int | None]],
        service: Any | None,
        block_size: int = 16,
        kv_pool_blocks: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._block_size = block_size
        self._kv_pool_blocks = dict(kv_pool_blocks or {})
        self._service = service
        self._clock = clock
        self._quotas = {name: quota for name, (quota, _) in quotas.items()}
        self._request_limits = {
            name: limit for name, (_, limit) in quotas.items() if limit is not None
        }
        self._slot_limited = {
            name
            for name, (quota, max_requests) in quotas.items()
            if max_requests is not None
            or quota.max_concurrent_sequences is not None
            or quota.kv_block_share is not None
        }
        self._leases: dict[tuple[str, Limit], Lease] = {
            (name, limit): Lease(capacity, settings.lease_fraction)
            for name, quota in self._quotas.items()
            for limit, capacity in _capacities(quota).items()
        }
        self._ledger: Any = None  # the quota ledger's actor handle, once looked up
        self._background: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        # This replica, as the ledger knows the grants it holds (renewed while it holds
        # any: a replica that dies holding some has them freed after the ledger's TTL).
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._held: set[str] = set()  # grant ids held, not yet released
        self._queued: set[str] = set()  # grant ids waiting in a tenant's queue

    # ---- the request ------------------------------------------------------------------

    async def admit(
        self,
        tenant: str,
        request_id: str,
        num_prompt_tokens: int,
        n: int,
        priority: int,
        decode_pool: str = "",
        max_tokens: int = 0,
    ) -> Admitted:
        """Check every quota of `tenant` for this request (may wait for a slot), which runs
        `n` choices of at most `max_tokens` tokens each on `decode_pool`."""
        if self._service is None:
            return Admitted(self, tenant, None)
        self._start_sweeper()
        taken: list[tuple[Lease, float]] = []
        try:
            for limit, amount in (
                (Limit.REQUESTS_PER_SECOND, 1.0),
                (Limit.PROMPT_TOKENS_PER_MINUTE, float(num_prompt_tokens)),
            ):
                lease = self._leases.get((tenant, limit))
                if lease is not None:
                    await self._take(tenant, limit, lease, amount)
                    taken.append((lease, amount))
            output = self._leases.get((tenant, Limit.OUTPUT_TOKENS_PER_MINUTE))
            if output is not None:  # not in debt: one token there (taken as output comes)
                await self._take(tenant, Limit.OUTPUT_TOKENS_PER_MINUTE, output, 1.0)
                output.put_back(1.0)
            grant_id = None
            if tenant in self._slot_limited:
                grant_id = request_id
                # The most blocks the request can fill: n x (prompt + max_tokens), no sharing.
                num_blocks = n * -(-(num_prompt_tokens + max_tokens) // self._block_size)
                max_kv_blocks = self._kv_limit(tenant, decode_pool)
                demand = SlotDemand(n, decode_pool, num_blocks, max_kv_blocks)
                await self._acquire_slots(tenant, grant_id, demand, priority)
        except BaseException:
            for lease, amount in taken:
                lease.put_back(amount)
            raise
        return Admitted(self, tenant, grant_id)

    async def _take(self, tenant: str, limit: Limit, lease: Lease, amount: float) -> None:
        for _ in range(_TAKE_ATTEMPTS):
            if lease.try_take(amount, self._clock()):
                return
            need = lease.shortfall(amount)
            granted, retry_after_s = await self._call(
                "acquire_tokens", tenant, limit.value, need, max(need, lease.batch)
            )
            if granted <= 0:
                raise _refusal(tenant, limit, lease.capacity, retry_after_s)
            lease.add(granted, self._clock())
        raise _refusal(tenant, limit, lease.capacity, 1.0)

    def _kv_limit(self, tenant: str, decode_pool: str) -> int | None:
        share = self._quotas[tenant].kv_block_share
        if share is None or decode_pool not in self._kv_pool_blocks:
            return None
        return math.floor(share * self._kv_pool_blocks[decode_pool])

    async def _acquire_slots(
        self, tenant: str, grant_id: str, demand: SlotDemand, priority: int
    ) -> None:
        timeout_s = self._settings.queue_timeout_s
        self._queued.add(grant_id)  # renewed while queued too (the ledger reaps silent owners)
        try:
            code, retry_after_s = await self._call(
                "acquire_slots",
                tenant,
                grant_id,
                demand,
                priority,
                timeout_s,
                self.owner,
                wait_s=timeout_s,
            )
        except BaseException:
            self.release_slots(grant_id)  # whether it was granted or is still queued
            raise
        finally:
            self._queued.discard(grant_id)
        if code is None:
            self._held.add(grant_id)
        else:
            limit = Limit(code)
            value = self._limit_value(tenant, limit)
            raise _refusal(tenant, limit, value, retry_after_s)

    def _limit_value(self, tenant: str, limit: Limit) -> float:
        quota = self._quotas[tenant]
        if limit is Limit.KV_SHARE and quota.kv_block_share is not None:
            return quota.kv_block_share
        if limit is Limit.CONCURRENT_SEQUENCES and quota.max_concurrent_sequences is not None:
            return quota.max_concurrent_sequences
        if limit is Limit.QUEUED_REQUESTS:
            return quota.max_queued_requests
        return self._request_limits.get(tenant, 0)

    # ---- after admission --------------------------------------------------------------

    def spend_output(self, tenant: str, num_tokens: int) -> None:
        lease = self._leases.get((tenant, Limit.OUTPUT_TOKENS_PER_MINUTE))
        if lease is None:
            return
        lease.spend(num_tokens, self._clock())
        if lease.debt >= lease.batch:
            self.flush_debt(tenant)

    def flush_debt(self, tenant: str) -> None:
        lease = self._leases.get((tenant, Limit.OUTPUT_TOKENS_PER_MINUTE))
        if lease is not None and lease.debt > 0:
            limit = Limit.OUTPUT_TOKENS_PER_MINUTE.value
            self._spawn(self._call("charge_tokens", tenant, limit, lease.take_debt()))

    def release_slots(self, grant_id: str) -> None:
        """Free a grant's slots in the background. A release the ledger did not answer is
        sent again (it is idempotent; a restarted ledger files an unknown grant as
        abandoned) until it is delivered: a lost release would hold the tenant's slot for
        good."""
        self._held.discard(grant_id)
        self._spawn(self._release(grant_id))

    async def _release(self, grant_id: str) -> None:
        delay_s = RELEASE_RETRY_FIRST_S
        deadline = time.monotonic() + RELEASE_RETRY_FOR_S
        while True:
            try:
                await self._call("release_slots", grant_id)
                return
            except ServiceUnavailableError:
                if time.monotonic() + delay_s > deadline:
                    logger.error("quota release of %s was never delivered", grant_id)
                    return
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, RELEASE_RETRY_MAX_S)

    async def stats(self) -> dict[str, Any]:
        """The quota ledger's per-tenant state ({} without quotas); raises the 503 of
        `_call` when the ledger does not answer."""
        if self._service is None:
            return {}
        result: dict[str, Any] = await self._call("stats")
        return result

    # ---- the quota service ------------------------------------------------------------

    async def _call(self, method: str, *args: Any, wait_s: float = 0.0) -> Any:
        """Call the quota ledger actor, bounded by the call timeout (plus `wait_s` of
        queueing). A ledger that died (its Serve replica restarted) is looked up again on
        the next call; this one fails with 503."""
        assert self._service is not None
        timeout_s = self._settings.quota_call_timeout_s
        try:
            if self._ledger is None:
                self._ledger = await asyncio.wait_for(
                    _resolve(self._service.ledger.remote()), timeout_s
                )
            call = getattr(self._ledger, method).remote(*args)
            return await asyncio.wait_for(_resolve(call), timeout_s + wait_s)
        except Exception as exc:  # noqa: BLE001 - the request fails, not the replica
            if isinstance(exc, RayActorError):
                self._ledger = None
            logger.warning("quota service %s failed: %r", method, exc)
            raise ServiceUnavailableError(
                "the quota service did not answer; retry the request",
                code="quota_service_unavailable",
                retry_after_s=1.0,
            ) from None

    def _spawn(self, call: Awaitable[Any]) -> None:
        async def run() -> None:
            with contextlib.suppress(ServiceUnavailableError):
                await call

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Forever: renew this replica's grants, return leases idle for `lease_ttl_s`,
        charge output debts."""
        ttl_s = self._settings.lease_ttl_s
        while True:
            await asyncio.sleep(ttl_s / 2)
            if self._held or self._queued:  # the ledger keeps them while it hears from it
                self._spawn(self._call("renew", self.owner))
            now = self._clock()
            for (tenant, limit), lease in self._leases.items():
                idle = lease.idle_tokens(now, ttl_s)
                if idle > 0:
                    self._spawn(self._call("return_tokens", tenant, limit.value, idle))
                if limit is Limit.OUTPUT_TOKENS_PER_MINUTE:
                    self.flush_debt(tenant)


async def _resolve(response: Any) -> Any:
    return await response
