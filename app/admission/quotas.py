"""The global quota state of every tenant: token buckets, slot counts, a priority queue.

Pure Python with an injected clock (`now` arguments, seconds, monotonic); the quota service
(`app/admission/quota_service.py`) holds one `TenantLedger` per tenant and calls these from
its single event loop, so nothing here locks.

Invariants, stated once:
- A bucket's tokens never exceed its capacity; they may go below zero only through
  `charge` (output tokens already produced: debt), and nothing is granted while in debt.
- `take` grants all of `need` or nothing, so the sum granted over any window is at most
  capacity + rate × window: leases never let ingress replicas together exceed a rate.
- Slots in use never exceed a limit: `SlotCounts.can_acquire` is checked before `acquire`.
- The wait queue pops the most important waiter (lowest priority value), FIFO within one.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from app.config import TenantQuota

T = TypeVar("T")


class Limit(str, Enum):
    """A tenant limit; the value is the `code` of the 429 that names it."""

    CONCURRENT_REQUESTS = "tenant_concurrent_requests"
    CONCURRENT_SEQUENCES = "tenant_concurrent_sequences"
    REQUESTS_PER_SECOND = "tenant_rate_limit"
    PROMPT_TOKENS_PER_MINUTE = "tenant_prompt_tokens_per_minute"
    OUTPUT_TOKENS_PER_MINUTE = "tenant_output_tokens_per_minute"
    KV_SHARE = "tenant_kv_share"
    QUEUED_REQUESTS = "tenant_queue_full"

    @property
    def field(self) -> str:
        """The config field that sets it (for error messages)."""
        return _FIELDS[self]


_FIELDS = {
    Limit.CONCURRENT_REQUESTS: "max_concurrent_requests",
    Limit.CONCURRENT_SEQUENCES: "quota.max_concurrent_sequences",
    Limit.REQUESTS_PER_SECOND: "quota.requests_per_second",
    Limit.PROMPT_TOKENS_PER_MINUTE: "quota.prompt_tokens_per_minute",
    Limit.OUTPUT_TOKENS_PER_MINUTE: "quota.output_tokens_per_minute",
    Limit.KV_SHARE: "quota.kv_block_share",
    Limit.QUEUED_REQUESTS: "quota.max_queued_requests",
}


@dataclass(slots=True)
class TokenBucket:
    """Refills at `rate` tokens/s up to `capacity`; starts full."""

    capacity: float
    rate: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, capacity: float, rate: float, now: float) -> TokenBucket:
        if capacity <= 0 or rate <= 0:
            raise ValueError(f"capacity and rate must be > 0, got {capacity}, {rate}")
        return cls(capacity=capacity, rate=rate, tokens=capacity, updated=now)

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def take(self, need: float, want: float, now: float) -> float:
        """Grant between `need` and `want` tokens (as many as there are), or 0 when fewer
        than `need` are there (a request larger than capacity never gets any)."""
        self.refill(now)
        if need > self.tokens:
            return 0.0
        granted = min(max(want, need), self.tokens)
        self.tokens -= granted
        return granted

    def charge(self, amount: float, now: float) -> None:
        """Take `amount` already spent, going into debt if need be."""
        self.refill(now)
        self.tokens -= amount

    def give_back(self, amount: float, now: float) -> None:
        """Return unused tokens of a lease (never above capacity)."""
        self.refill(now)
        self.tokens = min(self.capacity, self.tokens + amount)

    def seconds_until(self, amount: float, now: float) -> float:
        """How long until `amount` tokens are there (inf when over capacity)."""
        self.refill(now)
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.tokens) / self.rate)


@dataclass(frozen=True, slots=True)
class SlotDemand:
    """What one request holds while it runs."""

    num_sequences: int  # its n
    decode_pool: str = ""
    num_kv_blocks: int = 0  # n x blocks of (prompt + max_tokens): the most it can fill
    max_kv_blocks: int | None = None  # the tenant's share of that pool, in blocks


@dataclass(slots=True)
class SlotCounts:
    """Requests, sequences and KV blocks (per decode pool) in flight, against their limits
    (None = unlimited; the KV limit comes with each demand, computed by the ingress)."""

    max_requests: int | None
    max_sequences: int | None
    num_requests: int = 0
    num_sequences: int = 0
    kv_blocks: dict[str, int] = field(default_factory=dict)  # decode pool -> blocks held

    def refusal(self, demand: SlotDemand) -> Limit | None:
        """The limit that admitting `demand` would break now, if any."""
        if self.max_requests is not None and self.num_requests + 1 > self.max_requests:
            return Limit.CONCURRENT_REQUESTS
        if self.max_sequences is not None and self.num_sequences + demand.num_sequences > (
            self.max_sequences
        ):
            return Limit.CONCURRENT_SEQUENCES
        held = self.kv_blocks.get(demand.decode_pool, 0)
        if demand.max_kv_blocks is not None and held + demand.num_kv_blocks > (
            demand.max_kv_blocks
        ):
            return Limit.KV_SHARE
        return None

    def never_fits(self, demand: SlotDemand) -> Limit | None:
        """The limit `demand` breaks even when the tenant holds nothing, if any."""
        if self.max_sequences is not None and demand.num_sequences > self.max_sequences:
            return Limit.CONCURRENT_SEQUENCES
        if demand.max_kv_blocks is not None and demand.num_kv_blocks > demand.max_kv_blocks:
            return Limit.KV_SHARE
        return None

    def acquire(self, demand: SlotDemand) -> None:
        assert self.refusal(demand) is None, "acquire without room"
        self.num_requests += 1
        self.num_sequences += demand.num_sequences
        pool = demand.decode_pool
        self.kv_blocks[pool] = self.kv_blocks.get(pool, 0) + demand.num_kv_blocks

    def release(self, demand: SlotDemand) -> None:
        self.num_requests -= 1
        self.num_sequences -= demand.num_sequences
        self.kv_blocks[demand.decode_pool] -= demand.num_kv_blocks
        assert self.num_requests >= 0 and self.num_sequences >= 0, "released more than held"
        assert self.kv_blocks[demand.decode_pool] >= 0, "released more blocks than held"


@dataclass(order=True, slots=True)
class _Entry(Generic[T]):
    priority: int
    order: int
    item: T = field(compare=False)


class WaitQueue(Generic[T]):
    """Waiters for a slot: most important (lowest priority value) first, FIFO within one."""

    def __init__(self) -> None:
        self._heap: list[_Entry[T]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: T, priority: int) -> None:
        heapq.heappush(self._heap, _Entry(priority, next(self._order), item))

    def peek(self) -> T:
        return self._heap[0].item

    def pop(self) -> T:
        return heapq.heappop(self._heap).item

    def remove(self, item: T) -> bool:
        """Drop `item` (a waiter that gave up); False if it is not queued."""
        for index, entry in enumerate(self._heap):
            if entry.item is item:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False


class TenantLedger:
    """One tenant's global quota state (built from its config)."""

    def __init__(self, quota: TenantQuota, max_concurrent_requests: int | None, now: float) -> None:
        self.max_queued = quota.max_queued_requests
        self.slots = SlotCounts(max_concurrent_requests, quota.max_concurrent_sequences)
        self.buckets: dict[Limit, TokenBucket] = {}
        if quota.requests_per_second is not None and quota.burst is not None:
            self.buckets[Limit.REQUESTS_PER_SECOND] = TokenBucket.full(
                quota.burst, quota.requests_per_second, now
            )
        if quota.prompt_tokens_per_minute is not None:
            per_minute = quota.prompt_tokens_per_minute
            self.buckets[Limit.PROMPT_TOKENS_PER_MINUTE] = TokenBucket.full(
                per_minute, per_minute / 60, now
            )
        if quota.output_tokens_per_minute is not None:
            per_minute = quota.output_tokens_per_minute
            self.buckets[Limit.OUTPUT_TOKENS_PER_MINUTE] = TokenBucket.full(
                per_minute, per_minute / 60, now
            )
