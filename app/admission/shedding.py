"""Load shedding: predict a request's TTFT from its prefill pool's load, refuse it early.

Each prefill replica reports `queued_tokens` (prompt tokens admitted, not yet computed),
`pending_tokens_by_priority` (prompt tokens accepted and not yet handed off, by priority)
and `prefill_tokens_per_s` (measured; 0 until it has prefilled something) in its routing
stats. The engine admits by priority, so only work at or above a request's priority is
ahead of it: a batch flood does not make an interactive request look late;
the replica routers of the ingress process see them as Serve pushes them
(`replica.placement.pool_view`), so a check is a dictionary read: no call, no wait.

The prediction for a prompt of P tokens on a pool is the best replica's
`(queued_tokens + P) / prefill_tokens_per_s` (the replica router sends it to the least loaded
replica). It is compared with the request's class TTFT SLO times a factor; the factor shrinks
by `priority_step` per priority level below the most important one, so the lowest class is
shed first and at the lowest load. A shed request gets 503 `overloaded` with a Retry-After of
the predicted drain time.

The decode pool adds its admission wait: a decode replica holds `max_active` streams and
admits waiters most important first (`replica/slot_gate.py`); it reports `num_active`,
`num_waiting_by_priority` and `releases_per_s` (slots freed per second lately) under
`admission`. With `a` waiters at or above the request's priority and `f` free slots, the
request waits nothing when `a < f`, else `(a - f + 1) / releases_per_s` (`DecodeSlots`);
the best replica's wait is added to the prefill prediction (the decode replica takes a
request before it calls the prefill pool). So when long batch streams fill the decode pool,
batch (with every batch waiter ahead) is shed before interactive (only interactive ahead).
Prompts prefilled on the decode replica are checked on this wait alone.

Nothing is shed without measurements (a replica that has not prefilled yet or freed no slot
lately, a pool the router has not seen, data older than `max_age_s`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.config import SheddingSettings
from app.errors import ServiceUnavailableError
from replica.placement import PoolSnapshot, figure


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's prefill load."""

    queued_tokens: float
    tokens_per_s: float  # measured prefill rate; 0 = not measured yet

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any], priority: int) -> ReplicaLoad:
        """The load ahead of a request of `priority` (lower = more important)."""
        queued = figure(stats, "queued_tokens")
        by_priority = stats.get("pending_tokens_by_priority")
        if isinstance(by_priority, Mapping):
            ahead = sum(float(n) for p, n in by_priority.items() if int(p) <= priority)
            queued = min(queued, ahead)
        return cls(queued, figure(stats, "prefill_tokens_per_s"))


def predict_ttft_s(replicas: Iterable[ReplicaLoad], num_prompt_tokens: int) -> float | None:
    """Predicted TTFT of a prompt on the best replica; None when no replica has a rate."""
    times = [
        (r.queued_tokens + num_prompt_tokens) / r.tokens_per_s
        for r in replicas
        if r.tokens_per_s > 0
    ]
    return min(times) if times else None


@dataclass(frozen=True, slots=True)
class DecodeSlots:
    """One decode replica's stream slots, as a request of some priority sees them."""

    num_free: int
    num_ahead: int  # waiters at or above the request's priority
    releases_per_s: float  # measured; 0 = no slot freed lately

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any], priority: int) -> DecodeSlots | None:
        """None when the replica reports no `admission` (not a decode replica, or older)."""
        admission = stats.get("admission")
        if not isinstance(admission, Mapping):
            return None
        waiting = admission.get("num_waiting_by_priority") or {}
        ahead = sum(int(n) for p, n in waiting.items() if int(p) <= priority)
        free = int(admission.get("max_active", 0)) - int(admission.get("num_active", 0))
        return cls(max(free, 0), ahead, figure(admission, "releases_per_s"))

    def wait_s(self) -> float | None:
        """Seconds until a new request holds a slot; None: it would wait, for how long is
        not measured (no slot freed lately)."""
        if self.num_ahead < self.num_free:
            return 0.0
        if self.releases_per_s <= 0:
            return None
        return (self.num_ahead - self.num_free + 1) / self.releases_per_s


def predict_decode_wait_s(replicas: Iterable[DecodeSlots]) -> float | None:
    """The best replica's admission wait; None when no replica's wait is known."""
    waits = [w for w in (r.wait_s() for r in replicas) if w is not None]
    return min(waits) if waits else None


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

    def _fresh(self, snapshot: PoolSnapshot | None) -> bool:
        return (
            snapshot is not None and self._clock() - snapshot.updated_at <= self.settings.max_age_s
        )

    def decode_wait_s(self, snapshot: PoolSnapshot | None, priority: int) -> float | None:
        """The predicted admission wait on a decode pool (None: no fresh measurement)."""
        if snapshot is None or not self._fresh(snapshot):
            return None
        slots = [DecodeSlots.from_stats(stats, priority) for stats in snapshot.replicas.values()]
        return predict_decode_wait_s(s for s in slots if s is not None)

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
        decode_pool: str | None = None,
        decode_snapshot: PoolSnapshot | None = None,
    ) -> ShedCheck:
        """Whether to shed a request for prefill pool `pool` (None: prefilled locally) and
        `decode_pool` (`decode_snapshot`: its load; None: its wait is not counted)."""
        if not self.settings.enabled:
            return ShedCheck(False, "")
        decode_wait = self.decode_wait_s(decode_snapshot, priority)
        waits = ""
        if decode_wait:
            waits = f" + decode admission wait {decode_wait:.2f} s on pool {decode_pool}"
        loads: list[ReplicaLoad] = []
        if pool is None:
            if not decode_wait:
                return ShedCheck(False, "")
            predicted, where = decode_wait, f"local prefill{waits}"
        elif not self._fresh(snapshot):
            return ShedCheck(False, f"no recent load of pool {pool}: admitted")
        else:
            assert snapshot is not None
            loads = [ReplicaLoad.from_stats(s, priority) for s in snapshot.replicas.values()]
            prefill = predict_ttft_s(loads, num_prompt_tokens)
            if prefill is None:
                return ShedCheck(False, f"pool {pool} has no measured rate yet: admitted")
            predicted, where = prefill + (decode_wait or 0.0), f"pool {pool}{waits}"
        slo = ttft_slo_s if ttft_slo_s is not None else self.settings.default_ttft_s
        factor = self.factor(priority)
        limit = slo * factor
        numbers = f"predicted TTFT {predicted:.2f} s on {where}, limit {limit:.2f} s"
        numbers += f" (SLO {slo:g} s x {factor:g}, priority {priority})"
        if predicted <= limit:
            return ShedCheck(False, f"{numbers}: admitted", predicted, limit)
        drain = max(drain_time_s(loads), decode_wait or 0.0)
        retry = min(max(drain, 1.0), self.settings.max_retry_after_s)
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
