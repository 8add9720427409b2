"""An ingress replica's lease on one global token bucket (pure; injected clock).

The hot path draws from `available` with no remote call. Only when it runs short does the
replica ask the quota service for more: at least what the request needs, up to `batch`
more, so one remote call serves many requests. Tokens are only ever granted out of the
global bucket, so leases never let replicas together exceed the rate; the price is that
tokens idle in one replica's lease are not usable by another until they are returned
(`idle_tokens`, after the lease's TTL), which can refuse a request slightly early.

Output tokens are produced before they are charged: `spend` draws them from the lease and
records what it lacked as `debt`, which the replica charges to the global bucket (taking it
below zero, so the tenant is refused until it refills).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class Lease:
    """Tokens of one (tenant, limit) bucket held by this replica."""

    capacity: float  # the global bucket's capacity
    fraction: float  # share of capacity asked per remote call
    available: float = 0.0
    debt: float = 0.0  # spent beyond the lease, not yet charged globally
    last_used: float = -math.inf

    @property
    def batch(self) -> float:
        """Tokens asked per remote call beyond the need (whole tokens, at least 1)."""
        return max(1.0, math.floor(self.capacity * self.fraction))

    def try_take(self, amount: float, now: float) -> bool:
        """Take `amount` from the lease if it holds that much (no remote call)."""
        self.last_used = now
        if self.available >= amount:
            self.available -= amount
            return True
        return False

    def shortfall(self, amount: float) -> float:
        """What the service must grant for `amount` to be taken now."""
        return max(0.0, amount - self.available)

    def add(self, granted: float, now: float) -> None:
        """The service granted `granted` tokens to this lease."""
        self.available += granted
        self.last_used = now

    def put_back(self, amount: float) -> None:
        """A request refused by a later check returns what it took (locally)."""
        self.available += amount

    def spend(self, amount: float, now: float) -> None:
        """Output tokens produced: draw them from the lease, the rest becomes debt."""
        self.last_used = now
        drawn = min(self.available, amount)
        self.available -= drawn
        self.debt += amount - drawn

    def take_debt(self) -> float:
        """The debt to charge globally now (reset to 0)."""
        debt, self.debt = self.debt, 0.0
        return debt

    def idle_tokens(self, now: float, ttl_s: float) -> float:
        """Tokens to return to the global bucket because the lease sat idle for `ttl_s`."""
        if self.available <= 0 or now - self.last_used < ttl_s:
            return 0.0
        tokens, self.available = self.available, 0.0
        return tokens
