"""Load shedding: predict a request's TTFT from its prefill pool's load, refuse it early.

Each prefill replica reports `queued_tokens` (prompt tokens admitted, not yet computed),
`pending_tokens_by_priority` (prompt tokens accepted and not yet handed off, by priority)
and `prefill_tokens_per_s` (measured; 0 until it has prefilled something) in its routing
stats. The engine admits by priority, so only work at or above a request's priority is
ahead of it: a batch flood does not make an interactive request look late;
the replica routers of the ingress process see them as Serve pushes them
(`decode.placement.pool_view`), so a check is a dictionary read: no call, no wait.

The prediction for a prompt of P tokens on a pool is the best replica's
`(queued_tokens + P) / prefill_tokens_per_s` (the replica router sends it to the least loaded
replica). It is compared with the request's class TTFT SLO times a factor; the factor shrinks
by `priority_step` per priority level below the most important one, so the lowest class is
shed first and at the lowest load. A shed request gets 503 `overloaded` with a Retry-After of
the predicted drain time. Nothing is shed without measurements (a replica that has not
prefilled yet, a pool the router has not seen, data older than `max_age_s`), nor for
prompts prefilled on the decode replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.admission.overload_config import SheddingSettings
from app.errors import ServiceUnavailableError
from decode.placement import PoolSnapshot


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's prefill load."""

    queued_tokens: float
    tokens_per_s: float  # measured prefill rate; 0 = not measured yet

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any], priority: int) -> ReplicaLoad:
        """The load ahead of a request of `priority` (lower = more important)."""
        queued = float(stats.get("queued_tokens", 0) or 0)
        by_priority = stats.get("pending_tokens_by_priority")
        if isinstance(by_priority, Mapping):
            ahead = sum(float(n) for p, n in by_priority.items() if int(p) <= priority)
            queued = min(queued, ahead)
        return cls(queued, float(stats.get("prefill_tokens_per_s", 0) or 0))


def predict_ttft_s(replicas: Iterable[ReplicaLoad], num_prompt_tokens: int) -> float | None:
    """Predicted TTFT of a prompt on the best replica; None when no replica has a rate."""
    times = [
        (r.queued_tokens + num_prompt_tokens) / r.tokens_per_s
        for r in replicas
        if r.tokens_per_s > 0
    ]
    return min(times) if times else None


def drain_time_s(replicas: Iterable[ReplicaLoad]) -> float:
    """Seconds until the least loaded measured replica has worked off its queue."""
    times = [r.queued_tokens / r.tokens_per_s for r in replicas if r.tokens_per_s > 0]
    return min(times) if times else 0.0


@dataclass(frozen=True, slots=True)
class ShedCheck:
    """The outcome of one check: `shed` and why (for the routing record)."""

    shed: bool
    reason: str
    predicted_ttft_s: float | None = None
    limit_s: float | None = None
    retry_after_s: float | None = None


class LoadShedder:
    """Checks requests against their prefill pool's predicted TTFT (module docstring)."""

    def __init__(
        self,
        settings: SheddingSettings,
        priorities: Iterable[int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`priorities`: every configured class priority (lower = more important); a
        priority's level is its rank among them."""
        self.settings = settings
        self._levels = {p: i for i, p in enumerate(sorted(set(priorities)))}
        self._clock = clock

    def factor(self, priority: int) -> float:
        """The shedding factor of a priority: `factor`, scaled down per level below the top."""
        level = self._levels.get(priority)
        if level is None:  # not a configured class: rank it among them
            level = sum(1 for p in self._levels if p < priority)
        scaled = self.settings.factor * (1 - self.settings.priority_step) ** level
        return max(self.settings.min_factor, scaled)

    def check(
        self,
        pool: str | None,
        snapshot: PoolSnapshot | None,
        num_prompt_tokens: int,
        ttft_slo_s: float | None,
        priority: int,
    ) -> ShedCheck:
        """Whether to shed a request for `pool` (None: prefilled locally)."""
        if not self.settings.enabled or pool is None:
            return ShedCheck(False, "")
        if snapshot is None or self._clock() - snapshot.updated_at > self.settings.max_age_s:
            return ShedCheck(False, f"no recent load of pool {pool}: admitted")
        loads = [ReplicaLoad.from_stats(stats, priority) for stats in snapshot.replicas.values()]
        predicted = predict_ttft_s(loads, num_prompt_tokens)
        if predicted is None:
            return ShedCheck(False, f"pool {pool} has no measured rate yet: admitted")
        slo = ttft_slo_s if ttft_slo_s is not None else self.settings.default_ttft_s
        factor = self.factor(priority)
        limit = slo * factor
        numbers = f"predicted TTFT {predicted:.2f} s on pool {pool}, limit {limit:.2f} s"
        numbers += f" (SLO {slo:g} s x {factor:g}, priority {priority})"
        if predicted <= limit:
            return ShedCheck(False, f"{numbers}: admitted", predicted, limit)
        retry = min(max(drain_time_s(loads), 1.0), self.settings.max_retry_after_s)
        return ShedCheck(True, f"{numbers}: shed", predicted, limit, retry)


def overloaded(check: ShedCheck, headers: Mapping[str, str]) -> ServiceUnavailableError:
    """The 503 a shed request gets (code `overloaded`, Retry-After, `headers` added)."""
    assert check.shed and check.retry_after_s is not None
    error = ServiceUnavailableError(
        f"the service is overloaded: {check.reason}; retry later",
        code="overloaded",
        retry_after_s=check.retry_after_s,
    )
    error.headers.update(headers)
    return error
