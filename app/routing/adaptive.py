"""Adaptive disaggregation: prefill a prompt on its decode replica while that is cheaper.

The static rule (`app/routing/pool_router.py`) sends every prompt of at least
`local_prefill_threshold` tokens to a prefill pool. With `adaptive_prefill.enabled` the
ingress then weighs, for such a prompt of P tokens (`choose_prefill`, a pure function):

- the remote wait: the prefill pool's predicted TTFT, the best replica's
  `(prompt tokens ahead of the request + P) / prefill_tokens_per_s`, as load shedding
  predicts it (`app/admission/shedding.py`);
- the local cost: the best decode replica's `(queued_tokens + P) / prefill_tokens_per_s`
  (its rate measured on the prompts it prefilled itself, first step to first token), plus
  `local_cost_factor` x `P / rate` when it has running sequences, which stall while the
  prompt is computed.

The prompt goes local when the remote wait exceeds the local cost x (1 + margin) and by at
least `min_gain_s`; it goes back to remote once the wait is no longer than the local cost
(disaggregation is the default when the two are even). In between, each (prefill pool,
decode pool) pair keeps its last choice, so decisions do not flap around the boundary.
While prompts go local although a prefill replica has an empty queue, one prompt per
`probe_interval_s` goes remote anyway: a replica's rate is re-measured only by the prompts
it is sent, and a rate measured across a stall would otherwise keep every prompt local for
good. Prompts over `max_local_prompt_tokens` always go remote. Missing or stale data (a pool not
seen yet, load older than `max_age_s`, no measured rate) leaves the static rule's choice,
and the reason says so.

Both loads come from this process's replica routers (`replica.placement.pool_view`, kept
fresh by `app/admission/load_monitor.py`) and lag by up to a stats period: the prompt tokens
this ingress replica sent each way since a pool's snapshot are added to that pool's queue,
so a burst of requests does not all go one way before the next snapshot.

Both sides count only what they would compute: a chat turn resends its whole history, and
the side that served the previous turn caches it (`app/routing/history.py`). So P is, on
each side, the prompt less the prefix that side caches for the tenant (as this process's
prefix indexes know it), and a prompt whose decode replica caches all but a suffix shorter
than `local_prefill_threshold` is not weighed at all: the decode replica computes such a
suffix itself, against its cached prefix, whatever the route says (`decode/server.py`),
and only those tokens are counted there. Weighing the whole history instead counted a
later turn's ~900 tokens on one side for its ~100-token suffix, and read both pools as
seconds behind (BENCHMARKS.md, multi-turn).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.admission.shedding import ReplicaLoad, predict_ttft_s
from app.config import AdaptivePrefillSettings
from app.routing.history import cached_tokens
from app.routing.pool_router import RouteDecision
from replica.placement import PoolSnapshot, figure

MAX_SENT_ENTRIES = 4096  # per pool; far above the requests of one stats period


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """What a local prefill would cost on one decode replica (its routing stats)."""

    queued_tokens: float  # prompt tokens queued on the replica, not yet computed
    tokens_per_s: float  # its measured prefill rate; 0 = not measured yet
    num_running: int  # sequences decoding, stalled while a local prompt is computed

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> DecodeLoad:
        return cls(
            figure(stats, "queued_tokens"),
            figure(stats, "prefill_tokens_per_s"),
            int(figure(stats, "num_running")),
        )


@dataclass(frozen=True, slots=True)
class AdaptiveChoice:
    """`local`: True = prefill on the decode replica, False = on the prefill pool, None = no
    adaptive decision (the static rule stands); `reason` says why, with the figures."""

    local: bool | None
    reason: str
    remote_wait_s: float | None = None
    local_cost_s: float | None = None


def local_cost_s(load: DecodeLoad, num_prompt_tokens: int, rate: float, factor: float) -> float:
    """Seconds a local prefill of the prompt costs on `load`'s replica at `rate` tokens/s:
    its wait behind the replica's queue, plus `factor` x its compute when sequences are
    running (each step that computes it delays their next token)."""
    compute_s = num_prompt_tokens / rate
    stall_s = factor * compute_s if load.num_running > 0 else 0.0
    return (load.queued_tokens + num_prompt_tokens) / rate + stall_s


def choose_prefill(
    settings: AdaptivePrefillSettings,
    num_prompt_tokens: int,
    prefill: Sequence[ReplicaLoad] | None,
    decode: Sequence[DecodeLoad] | None,
    was_local: bool = False,
    cached: tuple[int, int] = (0, 0),
) -> AdaptiveChoice:
    """Where a prompt the static rule sends remote should be prefilled (module docstring).

    `prefill` / `decode`: the pools' replicas, None when the pool's load is missing or
    stale; `was_local`: the pair's last choice (the hysteresis); `cached`: the prompt's
    tokens cached on the prefill pool and on the decode pool, which neither computes."""
    limit = settings.max_local_prompt_tokens
    if num_prompt_tokens > limit:
        return AdaptiveChoice(False, f"len {num_prompt_tokens} > max_local_prompt_tokens {limit}")
    if prefill is None:
        return AdaptiveChoice(None, "no recent load of the prefill pool: static rule")
    remote_tokens = num_prompt_tokens - cached[0]
    local_tokens = num_prompt_tokens - cached[1]
    remote = predict_ttft_s(prefill, remote_tokens)
    if remote is None:
        return AdaptiveChoice(None, "prefill pool has no measured rate yet: static rule")
    if decode is None:
        return AdaptiveChoice(None, "no recent load of the decode pool: static rule", remote)
    borrowed = max(r.tokens_per_s for r in prefill) if settings.borrow_prefill_rate else 0.0
    costs = [
        local_cost_s(load, local_tokens, rate, settings.local_cost_factor)
        for load in decode
        if (rate := load.tokens_per_s or borrowed) > 0
    ]
    if not costs:
        return AdaptiveChoice(None, "decode pool has no measured rate yet: static rule", remote)
    local = min(costs)
    figures = f"predicted wait {remote:.3f} s remote, local cost {local:.3f} s"
    if any(cached):
        figures += f" (computing {remote_tokens} there, {local_tokens} here)"
    go_local = remote > local * (1 + settings.margin) and remote - local >= settings.min_gain_s
    stay_local = was_local and remote > local
    if go_local or stay_local:
        why = "" if go_local else " (hysteresis: within the margin, stays local)"
        return AdaptiveChoice(True, f"{figures} -> local prefill{why}", remote, local)
    why = " (hysteresis: within the margin, stays remote)" if remote > local else ""
    return AdaptiveChoice(False, f"{figures} -> remote prefill{why}", remote, local)


class SentSince:
    """What this ingress replica sent to each pool (prompt tokens here, sequences in
    `app/routing/overflow.py`), with when (monotonic), until the pool's next snapshot."""

    def __init__(self) -> None:
        self._sent: dict[str, deque[tuple[float, int]]] = {}

    def add(self, pool: str, amount: int, now: float) -> None:
        self._sent.setdefault(pool, deque(maxlen=MAX_SENT_ENTRIES)).append((now, amount))

    def since(self, pool: str, since: float) -> int:
        """The amount sent to `pool` after `since`, forgetting older entries."""
        entries = self._sent.get(pool)
        if not entries:
            return 0
        while entries and entries[0][0] <= since:
            entries.popleft()
        return sum(n for _, n in entries)


class AdaptivePrefill:
    """The ingress's adaptive disaggregation: rewrites a route's prefill target (module
    docstring). Event loop only (the hysteresis state is not locked)."""

    def __init__(
        self,
        settings: AdaptivePrefillSettings,
        snapshot: Callable[[str], PoolSnapshot | None],
        clock: Callable[[], float] = time.monotonic,
        local_prefill_threshold: int = 0,
    ) -> None:
        """`snapshot(pool)`: the pool's latest load, never waiting (`PoolLoadMonitor`);
        `local_prefill_threshold`: the decode replicas' short-suffix rule (module docstring)."""
        self.settings = settings
        self._local_prefill_threshold = local_prefill_threshold
        self._snapshot = snapshot
        self._clock = clock
        self._local: dict[tuple[str, str], bool] = {}  # (prefill, decode) -> last choice
        self._last_remote: dict[tuple[str, str], float] = {}  # pair -> last prompt sent remote
        self._sent = SentSince()

    def apply(
        self,
        route: RouteDecision,
        num_prompt_tokens: int,
        priority: int,
        prompt_token_ids: Sequence[int] = (),
        tenant: str = "",
    ) -> RouteDecision:
        """`route`, prefilled locally instead when that is cheaper now, its reason extended
        with the decision; `priority` orders the prefill pool's queue (lower = sooner);
        `prompt_token_ids` and `tenant`: the prompt, whose prefix cached on either side
        that side does not compute (module docstring)."""
        now = self._clock()
        if route.local_prefill or route.prefill_pool is None or not self.settings.enabled:
            target = route.decode_pool if route.local_prefill else route.prefill_pool
            self._sent.add(target or route.decode_pool, num_prompt_tokens, now)
            return route
        pair = (route.prefill_pool, route.decode_pool)
        cached = cached_tokens([route.prefill_pool, route.decode_pool], prompt_token_ids, tenant)
        held, suffix = cached[route.decode_pool], num_prompt_tokens - cached[route.decode_pool]
        if held and suffix < self._local_prefill_threshold:
            self._sent.add(route.decode_pool, suffix, now)
            why = (
                f"adaptive ({route.prefill_pool} vs {route.decode_pool}): {route.decode_pool} "
                f"caches {held} tokens, computes the {suffix}-token suffix itself"
            )
            reason = f"{route.reason}; {why}"  # and shedding weighs no prefill pool for it
            return dataclasses.replace(route, reason=reason, computes=(route.decode_pool, suffix))
        prefill = self._fresh(route.prefill_pool, now)
        decode = self._fresh(route.decode_pool, now)
        prefill_loads = (
            None if prefill is None else self._prefill_loads(route.prefill_pool, prefill, priority)
        )
        choice = choose_prefill(
            self.settings,
            num_prompt_tokens,
            prefill_loads,
            None if decode is None else self._decode_loads(route.decode_pool, decode),
            self._local.get(pair, False),
            (cached[route.prefill_pool], held),
        )
        if choice.local_cost_s is not None:  # a comparison, not a rule: the pair's state
            self._local[pair] = bool(choice.local)
        if choice.local and prefill_loads is not None:
            choice = self._probe(pair, choice, prefill_loads, now)
        why = f"adaptive ({route.prefill_pool} vs {route.decode_pool}): {choice.reason}"
        if not choice.local:
            self._last_remote[pair] = now
            self._sent.add(route.prefill_pool, num_prompt_tokens - cached[route.prefill_pool], now)
            return dataclasses.replace(route, reason=f"{route.reason}; {why}")
        self._sent.add(route.decode_pool, suffix, now)
        return route.prefilled_locally(why)

    def _probe(
        self,
        pair: tuple[str, str],
        choice: AdaptiveChoice,
        prefill: Sequence[ReplicaLoad],
        now: float,
    ) -> AdaptiveChoice:
        """`choice` (local), or a probe sent remote instead: a prefill replica that has an
        empty queue yet looks dearer than a local prefill is judged by a rate measured
        before it went quiet (a step slowed by a stall, a pause or a cold start), which no
        prompt re-measures while every prompt stays local. So one prompt per
        `probe_interval_s` goes to the pool while one of its replicas is idle."""
        interval = self.settings.probe_interval_s
        if interval <= 0 or not any(r.queued_tokens <= 0 for r in prefill):
            return choice
        since = now - self._last_remote.setdefault(pair, now)
        if since < interval:
            return choice
        why = f"{choice.reason}; probe: an idle prefill replica, no prompt sent for {since:.1f} s"
        return dataclasses.replace(choice, local=False, reason=f"{why} -> remote prefill")

    def _fresh(self, pool: str, now: float) -> PoolSnapshot | None:
        snapshot = self._snapshot(pool)
        if snapshot is None or not snapshot.replicas:
            return None
        return snapshot if now - snapshot.updated_at <= self.settings.max_age_s else None

    def _prefill_loads(self, pool: str, snapshot: PoolSnapshot, priority: int) -> list[ReplicaLoad]:
        extra = self._sent.since(pool, snapshot.updated_at) / len(snapshot.replicas)
        loads = [ReplicaLoad.from_stats(s, priority) for s in snapshot.replicas.values()]
        return [ReplicaLoad(r.queued_tokens + extra, r.tokens_per_s) for r in loads]

    def _decode_loads(self, pool: str, snapshot: PoolSnapshot) -> list[DecodeLoad]:
        extra = self._sent.since(pool, snapshot.updated_at) / len(snapshot.replicas)
        loads = [DecodeLoad.from_stats(s) for s in snapshot.replicas.values()]
        return [dataclasses.replace(d, queued_tokens=d.queued_tokens + extra) for d in loads]
