"""Circuit breakers for remote prefill: stop sending work to what keeps failing.

A decode replica keeps one breaker per prefill pool and one per prefill replica
(`BreakerBoard`). A breaker's life:

    CLOSED ──N consecutive failures──▶ OPEN ──cool-down──▶ HALF_OPEN ──probe ok──▶ CLOSED
                                        ▲                      │
                                        └────probe failed──────┘

While a replica's breaker is open the replica router excludes that replica; while a pool's
breaker is open the decode replica prefills locally instead of calling the pool. A failure
charged to a known replica counts on that replica's breaker only (the pool's other replicas
serve on: a retry goes to them); a failure no replica can be blamed for (the call timed out
before any replica took it) counts on the pool's. Every success closes both. Half-open
admits one probe at a time (a probe that never reports back frees its slot after another
cool-down). A failure is an error or a timeout of an attempt; a success is a prefill whose KV
landed. `PrefillPlanner` adds what else decides an attempt (the request's deadline, whether
any replica is left) and keeps the recent decisions with their reasons. Pure Python, no Ray;
the clock is injected so tests step time by hand.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

MIN_REMOTE_WINDOW_S = 0.5  # less of a request's deadline left: not worth a remote attempt
MAX_DECISIONS = 200


class BreakerState(enum.Enum):
    CLOSED = "closed"  # traffic flows
    OPEN = "open"  # no traffic until the cool-down ends
    HALF_OPEN = "half_open"  # one probe at a time decides


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """When a breaker opens and for how long."""

    failure_threshold: int = 3  # consecutive failures that open it
    cooldown_s: float = 10.0  # open this long before a probe is allowed

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if not self.cooldown_s > 0:
            raise ValueError(f"cooldown_s must be > 0, got {self.cooldown_s}")


class CircuitBreaker:
    """One target's breaker (see the module docstring for the state machine)."""

    def __init__(
        self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.num_opened = 0
        self._opened_at = 0.0
        self._probe_started_at: float | None = None

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker whose cool-down ended reads HALF_OPEN)."""
        cooled = self._clock() - self._opened_at >= self.settings.cooldown_s
        if self._state is BreakerState.OPEN and cooled:
            self._state = BreakerState.HALF_OPEN
            self._probe_started_at = None
        return self._state

    def can_send(self) -> bool:
        """True when a request may go to the target now, without taking a probe slot."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        return not self._probe_in_flight()

    def try_send(self) -> bool:
        """Like `can_send`, and in HALF_OPEN takes the probe slot when it returns True."""
        if not self.can_send():
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._probe_started_at = self._clock()
        return True

    def record_success(self) -> None:
        """The target served a request: close the breaker."""
        self._state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self._probe_started_at = None

    def record_failure(self) -> None:
        """The target failed or timed out a request: count it, open the breaker when due."""
        self.consecutive_failures += 1
        state = self.state
        if state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED
            and self.consecutive_failures >= self.settings.failure_threshold
        ):
            self._open()

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._probe_started_at = None
        self.num_opened += 1

    def _probe_in_flight(self) -> bool:
        started = self._probe_started_at
        return started is not None and self._clock() - started < self.settings.cooldown_s

    def snapshot(self) -> dict[str, Any]:
        """State and counts, for stats."""
        return {
            "state": self.state.value,
            "consecutive_failures": self.consecutive_failures,
            "num_opened": self.num_opened,
        }


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """What the breakers allow for one remote-prefill attempt on a pool."""

    remote: bool  # False: the pool's breaker is open, prefill locally
    exclude_replicas: tuple[str, ...]  # replicas whose breakers are open (or that just failed)
    probe_replica: str | None  # a half-open replica this attempt probes (route it there)
    reason: str  # why, for the routing record
    deadline_bound: bool = False  # local because the request's deadline is too close


class BreakerBoard:
    """The breakers of one decode replica: per prefill pool, and per (pool, replica)."""

    def __init__(
        self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._pools: dict[str, CircuitBreaker] = {}
        self._replicas: dict[str, dict[str, CircuitBreaker]] = {}

    def pool(self, pool: str) -> CircuitBreaker:
        """The pool's breaker (created closed)."""
        if pool not in self._pools:
            self._pools[pool] = CircuitBreaker(self.settings, self._clock)
        return self._pools[pool]

    def replica(self, pool: str, replica: str) -> CircuitBreaker:
        """The replica's breaker (created closed)."""
        breakers = self._replicas.setdefault(pool, {})
        if replica not in breakers:
            breakers[replica] = CircuitBreaker(self.settings, self._clock)
        return breakers[replica]

    def plan(self, pool: str, failed: tuple[str, ...] = ()) -> PrefillPlan:
        """Where the next attempt on `pool` may go; `failed` are replicas that already
        failed this request (never retried)."""
        if not self.pool(pool).try_send():
            return PrefillPlan(False, (), None, f"breaker of pool {pool} is open")
        excluded = list(failed)
        probe = None
        for name, breaker in self._replicas.get(pool, {}).items():
            if name in failed:
                continue
            if probe is None and breaker.state is BreakerState.HALF_OPEN and breaker.try_send():
                probe = name
            elif not breaker.can_send():
                excluded.append(name)
        reasons = []
        if failed:
            reasons.append(f"retry excluding failed {', '.join(failed)}")
        open_ones = [name for name in excluded if name not in failed]
        if open_ones:
            reasons.append(f"breaker open for {', '.join(open_ones)}")
        if probe is not None:
            reasons.append(f"probing half-open {probe}")
        return PrefillPlan(True, tuple(excluded), probe, "; ".join(reasons))

    def record(self, pool: str, replica: str | None, ok: bool) -> None:
        """An attempt on `pool` ended; `replica` is where it ran (None: never routed)."""
        if ok:
            self.pool(pool).record_success()
            if replica is not None:
                self.replica(pool, replica).record_success()
        elif replica is None:
            self.pool(pool).record_failure()
        else:
            self.replica(pool, replica).record_failure()

    def pool_names(self) -> set[str]:
        """The pools that have a breaker, of their own or of a replica."""
        return set(self._pools) | set(self._replicas)

    def pool_state(self, pool: str, known_replicas: Collection[str] | None) -> BreakerState:
        """Whether `pool` as a whole takes work: its own breaker's state unless that is
        closed; else, when every replica in `known_replicas` (None or empty: unknown) has
        a breaker and none is closed, OPEN if all are open and HALF_OPEN otherwise."""
        own = self.pool(pool).state if pool in self._pools else BreakerState.CLOSED
        if own is not BreakerState.CLOSED or not known_replicas:
            return own
        breakers = self._replicas.get(pool, {})
        states = [breakers[name].state if name in breakers else None for name in known_replicas]
        if any(state in (None, BreakerState.CLOSED) for state in states):
            return BreakerState.CLOSED
        if all(state is BreakerState.OPEN for state in states):
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def snapshot(self) -> dict[str, Any]:
        """Every breaker's state, for the replica's stats (copies first: stats may run on
        another thread than the one recording)."""
        return {
            pool: {
                **breaker.snapshot(),
                "replicas": {
                    name: b.snapshot() for name, b in list(self._replicas.get(pool, {}).items())
                },
            }
            for pool, breaker in list(self._pools.items())
        }


class PrefillPlanner:
    """Decides each remote-prefill attempt of one decode replica, and remembers why.

    `known_replicas(pool)` names the pool's replicas as this process's router last saw them
    (None: not seen yet). An attempt goes local when the request has less than
    `MIN_REMOTE_WINDOW_S` left, when the pool's breaker is open, or when every known replica
    is excluded (open breakers, or failed this request already).
    """

    def __init__(
        self,
        board: BreakerBoard,
        known_replicas: Callable[[str], Collection[str] | None],
        max_decisions: int = MAX_DECISIONS,
    ) -> None:
        self.board = board
        self._known_replicas = known_replicas
        self.decisions: deque[dict[str, Any]] = deque(maxlen=max_decisions)

    def plan(
        self, request_id: str, pool: str, failed: tuple[str, ...], seconds_left: float
    ) -> PrefillPlan:
        """The next attempt of `request_id` on `pool` (decision recorded when notable)."""
        if seconds_left < MIN_REMOTE_WINDOW_S:
            plan = PrefillPlan(
                False, (), None, "request deadline too close for remote prefill", True
            )
        else:
            plan = self.board.plan(pool, failed)
            known = self._known_replicas(pool)
            if plan.remote and known is not None and set(known) <= set(plan.exclude_replicas):
                reason = f"every replica of pool {pool} is excluded ({plan.reason})"
                plan = PrefillPlan(False, plan.exclude_replicas, None, reason)
        if not plan.remote:
            self.decide(request_id, pool, f"{plan.reason} -> local prefill")
        elif plan.reason:
            self.decide(request_id, pool, plan.reason)
        return plan

    def blocked_pools(self) -> dict[str, str]:
        """Prefill pools not taking this replica's work now -> `open` or `half_open`
        (`BreakerBoard.pool_state` over the replicas the router knows); closed pools are
        left out. Compact, for routing stats: the ingress reads it for the fallback pool."""
        states = {
            pool: self.board.pool_state(pool, self._known_replicas(pool))
            for pool in self.board.pool_names()
        }
        return {pool: s.value for pool, s in states.items() if s is not BreakerState.CLOSED}

    def decide(self, request_id: str, pool: str, reason: str) -> None:
        """Record a decision about `request_id`'s prefill and its reason."""
        self.decisions.append({"request_id": request_id, "pool": pool, "reason": reason})

    def snapshot(self, num_decisions: int = 20) -> dict[str, Any]:
        """Breakers and the latest decisions, for the replica's stats."""
        return {
            "breakers": self.board.snapshot(),
            "prefill_decisions": list(self.decisions)[-num_decisions:],
        }
