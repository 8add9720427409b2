"""Unit cost: dollars per request and per 1M tokens, from configured pool prices, measured
replica-hours and measured usage.

Prices are `observability.cost.pools` (per replica-hour, or per GPU-hour times the pool's
`num_gpus`). Replica-hours are integrated from the replica counts the ingress observes
(Serve's RUNNING replicas at each health probe and stats call; the configured count until
the first observation). Prompt tokens are charged to the prefill pools and generated
tokens to the decode pools; colocated (no priced prefill pool) only the total splits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.config import CostSettings, PoolConfig

PER_MILLION = 1_000_000


@dataclass(frozen=True, slots=True)
class PoolRate:
    """One pool's price per replica-hour and what its tokens are."""

    role: str  # "prefill" | "decode"
    usd_per_replica_hour: float


def pool_rates(cost: CostSettings, pools: Iterable[PoolConfig]) -> dict[str, PoolRate]:
    """Each pool's $ per replica-hour (0 for pools `cost` does not price)."""
    rates = {}
    for pool in pools:
        price = cost.pools.get(pool.name)
        per_replica = 0.0
        if price is not None:
            per_replica = price.usd_per_hour * (pool.num_gpus if price.per == "gpu" else 1.0)
        rates[pool.name] = PoolRate(pool.role, per_replica)
    return rates


def initial_replicas(pool: PoolConfig) -> int:
    """The replica count a pool starts with, by its config."""
    if pool.num_replicas is not None:
        return pool.num_replicas
    if pool.autoscaling is not None:
        return pool.autoscaling.min_replicas
    return 1


def unit_cost(
    usd_prefill: float,
    usd_decode: float,
    num_requests: int,
    num_prompt_tokens: int,
    num_generated_tokens: int,
) -> dict[str, float | None]:
    """Dollars in total, per request and per 1M tokens (None where the divisor is 0).

    `usd_per_1m_prompt_tokens` charges the prefill pools' cost to prompt tokens and
    `usd_per_1m_generated_tokens` the decode pools' to generated tokens; without a priced
    prefill pool (colocated serving) decode does both, so only the totals are given.
    """
    total = usd_prefill + usd_decode
    num_tokens = num_prompt_tokens + num_generated_tokens
    split = usd_prefill > 0

    def per_million(usd: float, tokens: int) -> float | None:
        return usd / tokens * PER_MILLION if tokens else None

    return {
        "usd_total": total,
        "usd_per_request": total / num_requests if num_requests else None,
        "usd_per_1m_tokens": per_million(total, num_tokens),
        "usd_per_1m_prompt_tokens": per_million(usd_prefill, num_prompt_tokens) if split else None,
        "usd_per_1m_generated_tokens": per_million(usd_decode, num_generated_tokens)
        if split
        else None,
    }


def fleet_cost(
    usd_per_hour_by_pool: Mapping[str, float], roles: Mapping[str, str], seconds: float
) -> tuple[float, float]:
    """(prefill $, decode $) of running the pools at these hourly rates for `seconds`."""
    prefill = decode = 0.0
    for name, rate in usd_per_hour_by_pool.items():
        usd = rate * seconds / 3600
        if roles.get(name) == "prefill":
            prefill += usd
        else:
            decode += usd
    return prefill, decode


class CostMeter:
    """Replica-hours per pool, and the usage they served (ingress event loop only)."""

    def __init__(
        self,
        cost: CostSettings,
        pools: Iterable[PoolConfig],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        pools = list(pools)
        self.rates = pool_rates(cost, pools)
        self.clock = clock
        self._replicas = {pool.name: initial_replicas(pool) for pool in pools}
        self._replica_seconds = dict.fromkeys(self._replicas, 0.0)
        self._since = clock()
        self._last = self._since
        self.num_requests = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    def observe_replicas(self, counts: Mapping[str, int]) -> None:
        """Pools' replica counts now; the previous counts held since the last observation."""
        self._advance()
        for name, count in counts.items():
            if name in self._replicas:
                self._replicas[name] = count

    def add_usage(self, num_prompt_tokens: int, num_generated_tokens: int) -> None:
        """One finished request's tokens."""
        self.num_requests += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generated_tokens += num_generated_tokens

    def _advance(self) -> None:
        now = self.clock()
        for name, count in self._replicas.items():
            self._replica_seconds[name] += count * (now - self._last)
        self._last = now

    def replicas(self) -> dict[str, int]:
        """Each pool's replica count, as last observed."""
        return dict(self._replicas)

    def usd_per_hour(self) -> dict[str, float]:
        """What each pool costs per hour at its current replica count."""
        return {
            name: rate.usd_per_replica_hour * self._replicas[name]
            for name, rate in self.rates.items()
        }

    def report(self) -> dict[str, Any]:
        """Replica-hours, spend and unit cost since this ingress started."""
        self._advance()
        prefill = decode = 0.0
        for name, rate in self.rates.items():
            usd = rate.usd_per_replica_hour * self._replica_seconds[name] / 3600
            if rate.role == "prefill":
                prefill += usd
            else:
                decode += usd
        return {
            "hours": (self._last - self._since) / 3600,
            "replica_hours": {n: s / 3600 for n, s in self._replica_seconds.items()},
            "usd_per_hour": self.usd_per_hour(),
            "pool_roles": {name: rate.role for name, rate in self.rates.items()},
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            **unit_cost(
                prefill,
                decode,
                self.num_requests,
                self.num_prompt_tokens,
                self.num_generated_tokens,
            ),
        }
