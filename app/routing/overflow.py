"""Decode overflow: a prefill pool with `serves_decode` serves whole requests while the
decode pool is the busier of the two.

Disaggregation gives a prefill replica's cores to prompts only. When the load is decode-bound
(many short chat turns, few long prompts) those cores idle while the decode pool's batch
grows and every token slows: on two cores, 1 prefill + 1 decode replica then has half the
decode capacity of two colocated replicas (BENCHMARKS.md, the issue-14 run). A prefill pool
marked `serves_decode` lends its replicas out: after the router and adaptive
disaggregation have placed a request, the ingress compares what a new stream would meet on
the decode pool's least loaded replica and on each such prefill pool's, and when the decode
pool's figure is at least `adaptive_prefill.decode_overflow_gap` higher, the whole request
(prompt and decode, no KV transfer) goes to that prefill pool's `generate` instead
(`prefill/server.py`). Otherwise the route stands: long prompts still prefill on the prefill
pool, short ones on the decode replica, so prompts keep their isolation whenever the decode
pool has room.

The figure is a replica's decode load, `(num_sequences + 1) / (1 - prompt_busy)`: a new
stream joins a batch of `num_sequences + 1` (running, queued, awaiting KV), and decodes only
in the share of the time the replica is not computing prompts (`prompt_busy`: the last 30 s,
or its life so far when younger, from `Engine.prompt_steps`, a mixed step counting for its
prompt tokens' share of its tokens; both pools report it). So a
prefill replica busy with prompts takes whole requests only when the decode pool is that
much fuller, and the two pools' load evens out whichever of prompts or tokens binds. A
replica busier with prompts than `adaptive_prefill.decode_overflow_max_prompt_busy` takes
none: its streams' TPOT would more than double (the prefill-bound case, long-context load,
where disaggregation pays and overflow would undo it; BENCHMARKS.md).

A conversation follows its history: the side caching more of the prompt takes it, within
a load margin (`app/routing/history.py`), before the load rule below.

That share is an average; what a new stream meets is the prompt being computed now. A whole
request that lands while a long prompt computes waits for it (TTFT) and then stalls at every
chunk of it (TPOT): in the multi-tenant runs, 36 of 77 interactive requests served whole
while a batch document's prompt computed on the prefill replica missed their SLO, against 0
of 157 when none did and 9 of 136 placed on the decode replica at such moments
(BENCHMARKS.md). So a pool also takes none while more than
`adaptive_prefill.decode_overflow_max_prompt_tokens` prompt tokens compute there per replica:
the ones this ingress sent (from the send until the request's first output comes back, which
is exact and immediate) or, for each replica, the ones it reports queued (other ingress
replicas' too, a stats period late). With `adaptive_prefill.decode_overflow_max_prompt_ms`
the gate is in time where the replica has measured its prefill rate: those tokens at that
rate must take at most that long. A count cannot fit every model: on 2 cores 256 tokens are
~13 ms of `tiny`'s prompt work and ~250 ms of `small`'s, and a multi-turn load whose
first turns (513 tokens, ~26 ms on `tiny`) closed the token gate kept most whole requests
on the decode replica at its busiest (BENCHMARKS.md, multi-turn).

Short outputs (`adaptive_prefill.serve_whole_max_output_tokens`, 0 = off): a request
asking for at most that many new tokens is placed as two colocated replicas would place it,
whatever adaptive disaggregation chose: whole (no KV hand-off) on the decode pool, which
prefills it locally, or on a prefill pool with `serves_decode`, ranked as colocated's
replica router ranks two replicas (`app/serve/replica_router.py`): fewest prompt tokens to
compute, then fewest requests in flight, ties taking turns. For a few tokens the hand-off
(a second replica call, blocks reserved on the decode replica, the bytes) buys nothing,
and the decode replica would decode every such request while the prefill replica only
computes prompts. On a RAG-like load (long prompts, 16-token answers) it gave 0.87x
colocated's goodput against 0.84x without it, within the noise (0.77x when it ranked by
requests alone; BENCHMARKS.md), so it is off in `configs/cpu-adaptive.yaml`. The figures
of a pool's least loaded replica: prompt tokens, its reported `queued_tokens` and at least
those this ingress's requests are computing there; requests, its reported `num_sequences`
plus what this ingress sent since, and at least what it has running there. A decode pool
is a candidate only for prompts up to `adaptive_prefill.max_local_prompt_tokens`; without
recent loads the rules below decide.

A candidate pool must cover the prompt's length (its context range) and be one the tenant may
use. Loads come from this process's replica routers (`replica.placement.pool_view`) and lag by
up to a stats period; the sequences this ingress replica sent to a pool since its snapshot
are added to it, so a burst does not all go one way. A snapshot can also arrive after a
request was sent yet have been measured before that request reached the replica: it then
hides the request for a whole stats period, and the next one joins the same replica. So a
pool's figure is never below what this ingress replica itself has running there (`started`
to `ended`, spread over the pool's replicas), as Serve's own router counts its requests in
flight (without it, 27 of 500 chat requests joined the busier replica and 20 of those
missed their TPOT SLO; BENCHMARKS.md, the chat runs). Stale loads (older than
`adaptive_prefill.max_age_s`: a pool whose replicas stopped answering) leave the route as it
is.

A pool whose replicas have not reported yet (a fresh deployment, in the second or so before
Serve's first stats; its router may know the replicas, without stats) reads as those
replicas (or its configured count) idle: its figures are then this ingress's own, the
streams it has running there and the prompt tokens it has computing there (the gate counts
tokens: no rate is known). Not the sequences it sent since: a handed-off stream counts on
both pools until their next stats, so every new conversation would read as a tie, which
stays on the decode pool. Left to the route instead, a burst at a fresh deployment all
stood on the decode pool, and a conversation stays where its history is: in `bench
compare`'s multi-turn runs 4-20 first turns of a point's 30 were placed before the first
stats, all on the decode replica, which then carried their later turns too (BENCHMARKS.md,
multi-turn). A pool still unreported `adaptive_prefill.max_age_s` after this ingress first
found it so counts as stale (its replicas never answered), as does one that reported once
and lost its stats since, or one with no running replica. Requests placed but not yet
started (an admission wait between the two) are not counted in that window. Event loop
only.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.config import PDServeConfig, PoolConfig
from app.observability.cost import initial_replicas
from app.routing.adaptive import SentSince
from app.routing.history import History, cached_tokens, follow_prefix, prompt_computes
from app.routing.pool_router import RouteDecision
from replica.placement import PoolSnapshot, figure

MAX_PROMPT_BUSY = 0.95  # keeps the load finite for a replica that only computed prompts


def decode_load(num_sequences: float, prompt_busy: float) -> float:
    """What a new stream meets on a replica (module docstring): the batch it joins, over
    the share of the time the replica decodes."""
    return (num_sequences + 1) / (1 - min(max(prompt_busy, 0.0), MAX_PROMPT_BUSY))


@dataclass(frozen=True, slots=True)
class OverflowChoice:
    """`pool`: the prefill pool that serves the whole request (None: the route stands)."""

    pool: str | None
    reason: str


def choose_overflow(
    decode: float,
    candidates: Mapping[str, float | None],
    gap: float,
    history: History | None = None,
) -> OverflowChoice:
    """Where a request goes, from the decode load (`decode_load`) of the decode pool's least
    loaded replica (`decode`) and of each candidate pool's (`candidates`, in preference
    order; None: no replica of that pool is idle enough between prompts to take whole
    requests). `history`: what each side caches of the prompt; the side holding more takes
    it within the prefix margin (`follow_prefix`)."""
    if not candidates:
        return OverflowChoice(None, "no prefill pool that serves decode has a recent load")
    idle = {pool: load for pool, load in candidates.items() if load is not None}
    if not idle:
        busy = ", ".join(candidates)
        return OverflowChoice(None, f"prefill pools {busy} busy with prompts: route stands")
    candidates = idle
    held = follow_prefix(decode, idle, history) if history is not None else None
    if held is not None:
        return OverflowChoice(held.pool, held.reason)
    pool, load = min(candidates.items(), key=lambda item: item[1])
    figures = f"decode load {decode:.1f} on decode vs {load:.1f} on {pool}"
    if decode > load and decode - load >= gap:  # a tie stays on decode, even at gap 0
        return OverflowChoice(pool, f"decode overflow: {figures} -> served whole on {pool}")
    need = f"above by {gap:g}" if gap else "above"
    return OverflowChoice(None, f"{figures}: decode not {need}, route stands")


class DecodeOverflow:
    """The ingress's decode overflow (module docstring): may move a placed request whole
    onto a prefill pool with `serves_decode`."""

    def __init__(
        self,
        config: PDServeConfig,
        snapshot: Callable[[str], PoolSnapshot | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`snapshot(pool)`: the pool's latest load, never waiting (`PoolLoadMonitor`)."""
        self._config = config
        self._snapshot = snapshot
        self._clock = clock
        self._gap = config.adaptive_prefill.decode_overflow_gap
        self._max_age_s = config.adaptive_prefill.max_age_s
        self._max_prompt_busy = config.adaptive_prefill.decode_overflow_max_prompt_busy
        self._serving: list[PoolConfig] = [p for p in config.pools if p.serves_decode]
        self._sent = SentSince()
        self._running: Counter[str] = Counter()  # pool -> this replica's sequences there
        self._max_prompt_tokens = config.adaptive_prefill.decode_overflow_max_prompt_tokens
        self._max_prompt_s = config.adaptive_prefill.decode_overflow_max_prompt_ms / 1000.0
        self._prompts: Counter[str] = Counter()  # pool -> prompt tokens computing there
        self._max_whole_output = config.adaptive_prefill.serve_whole_max_output_tokens
        self._ties = 0  # short outputs placed among tied pools, which take them in turn
        # A pool's replicas before its first stats (`_unseen`): the count it starts with.
        self._initial_replicas = {pool.name: initial_replicas(pool) for pool in config.pools}
        self._first_look: dict[str, float] = {}  # pool -> when it was first found unreported
        self._reported: set[str] = set()  # pools whose replicas have reported stats

    def started(self, pool: str, num_sequences: int) -> None:
        """The ingress started `num_sequences` streams on `pool` (its decode pool, or the
        prefill pool serving the request whole)."""
        self._running[pool] += num_sequences

    def ended(self, pool: str, num_sequences: int) -> None:
        """Those streams ended, however (done, failed, cancelled, moved to a fallback)."""
        self._running[pool] = max(0, self._running[pool] - num_sequences)

    def running(self, pool: str) -> int:
        """The streams this ingress replica has running on `pool` now."""
        return self._running[pool]

    def prompt_started(self, pool: str, num_prompt_tokens: int) -> None:
        """The ingress sent a request whose prompt computes on `pool` (its prefill pool, or
        the pool that prefills it locally); `prompt_computed` follows exactly once."""
        self._prompts[pool] += num_prompt_tokens

    def prompt_computed(self, pool: str, num_prompt_tokens: int) -> None:
        """That request's first output came back, or it ended without one."""
        self._prompts[pool] = max(0, self._prompts[pool] - num_prompt_tokens)

    def computing(self, pool: str) -> int:
        """The prompt tokens this ingress replica's requests are computing on `pool` now."""
        return self._prompts[pool]

    @property
    def enabled(self) -> bool:
        """True when some prefill pool serves whole requests."""
        return bool(self._serving)

    @property
    def pools(self) -> list[str]:
        """The prefill pools that serve whole requests (their handles need `generate`)."""
        return [pool.name for pool in self._serving]

    def apply(
        self,
        route: RouteDecision,
        num_prompt_tokens: int,
        tenant: str,
        num_sequences: int = 1,
        max_tokens: int | None = None,
        prompt_token_ids: Sequence[int] = (),
    ) -> RouteDecision:
        """`route`, moved whole onto a prefill pool when the decode pool's load is higher by
        the gap, or when that pool caches more of the prompt (`prompt_token_ids`) within the
        prefix margin; a short output (`max_tokens` at most `serve_whole_max_output_tokens`)
        served whole where less is in flight (`_place_short`). Its reason is extended with the
        figures; `num_sequences`: the request's `n`."""
        if not self._serving:
            return route
        now = self._clock()
        if self._is_short(max_tokens):
            placed = self._place_short(route, num_prompt_tokens, tenant, max_tokens, now)
            if placed is not None:
                return self._served_whole(route, *placed, num_sequences, now)
        decode = self._load(route.decode_pool, now)
        choice = OverflowChoice(None, f"no recent load of decode pool {route.decode_pool}")
        pools = self._covering(num_prompt_tokens, tenant)
        cached = cached_tokens(
            [route.decode_pool, *pools, *filter(None, [route.prefill_pool])],
            prompt_token_ids,
            tenant,
        )
        if decode is not None:
            candidates: dict[str, float | None] = {}
            for pool in pools:
                if seen := self._fresh(pool, now):
                    candidates[pool] = self._least(pool, seen, candidate=True)
            history = History(
                {pool: cached[pool] for pool in candidates},
                cached[route.decode_pool],
                num_prompt_tokens,
                self._config.local_prefill_threshold,
            )
            choice = choose_overflow(decode, candidates, self._gap, history)
        computes: tuple[str, int] | None = None  # as the route says, with nothing cached
        if choice.pool is None:
            if any(cached.values()):
                computes = prompt_computes(
                    route.decode_pool,
                    None if route.local_prefill else route.prefill_pool,
                    num_prompt_tokens,
                    cached,
                    self._config.local_prefill_threshold,
                )
            return self._stands(route, choice.reason, num_sequences, now, computes)
        if cached[choice.pool]:
            computes = (choice.pool, num_prompt_tokens - cached[choice.pool])
        return self._served_whole(route, choice.pool, choice.reason, num_sequences, now, computes)

    def _place_short(
        self,
        route: RouteDecision,
        num_prompt_tokens: int,
        tenant: str,
        max_tokens: int | None,
        now: float,
    ) -> tuple[str, str] | None:
        """Where a short output is served whole (module docstring) and why: the candidate
        pool whose least loaded replica has the fewest prompt tokens to compute, then the
        fewest requests in flight, ties in turn; None without a recent load of the decode
        pool or of any serving prefill pool."""
        short = f"short output: max_tokens {max_tokens} <= {self._max_whole_output}"
        candidates = self._covering(num_prompt_tokens, tenant)
        if num_prompt_tokens <= self._config.adaptive_prefill.max_local_prompt_tokens:
            candidates.append(route.decode_pool)
        loads = {pool: self._in_flight(pool, now) for pool in candidates}
        known = {pool: load for pool, load in loads.items() if load is not None}
        if route.decode_pool in loads and route.decode_pool not in known:
            return None
        if not known.keys() - {route.decode_pool}:
            return None
        least = min(known.values())
        tied = [pool for pool, load in known.items() if load == least]
        self._ties += len(tied) > 1
        pool = tied[self._ties % len(tied)]
        figures = ", ".join(
            f"{t:.0f} tokens, {n:.1f} requests on {p}" for p, (t, n) in known.items()
        )
        return pool, f"{short}, per replica {figures} -> served whole on {pool}"

    def _stands(
        self,
        route: RouteDecision,
        why: str,
        num_sequences: int,
        now: float,
        computes: tuple[str, int] | None = None,
    ) -> RouteDecision:
        """`route` unchanged (counted as sent to its pools), `why` ending its reason;
        `computes`: where its prompt computes (`RouteDecision.computes`). A stream whose
        prompt computes on a prefill pool also counts there until the pool's next stats,
        which keeps a burst of new conversations on the decode pool (ties stay). Counted
        on the decode pool only, such a burst spread over both pools: `bench compare`'s
        multi-turn capacity rose from 0.92x to 0.98x colocated's, but later turns' TTFT
        in `bench multiturn` rose from 36-43 ms to 53-60 ms (BENCHMARKS.md, multi-turn)."""
        self._sent.add(route.decode_pool, num_sequences, now)
        prompt_pool = computes[0] if computes is not None else route.prefill_pool
        if prompt_pool is not None and prompt_pool != route.decode_pool:
            self._sent.add(prompt_pool, num_sequences, now)  # its prompt computes there
        reason = f"{route.reason}; {why}"
        return dataclasses.replace(route, reason=reason, computes=computes)

    def _served_whole(
        self,
        route: RouteDecision,
        pool: str,
        why: str,
        num_sequences: int,
        now: float,
        computes: tuple[str, int] | None = None,
    ) -> RouteDecision:
        """`route` moved whole onto `pool` (counted as sent there), `why` ending its reason;
        `computes`: the prompt tokens its cache there lacks (`RouteDecision.computes`)."""
        self._sent.add(pool, num_sequences, now)
        reason = f"{route.reason}; {why}"
        return dataclasses.replace(
            route,
            decode_pool=pool,
            prefill_pool=None,
            local_prefill=True,
            reason=reason,
            computes=computes,
        )

    def _covering(self, num_prompt_tokens: int, tenant: str) -> list[str]:
        """The pools that serve decode, may serve `tenant` and cover the prompt's length."""
        allowed = {pool.name for pool in self._config.allowed_pools(tenant)}
        return [
            pool.name
            for pool in self._serving
            if pool.name in allowed
            and pool.context_range[0] <= num_prompt_tokens <= pool.context_range[1]
        ]

    def _is_short(self, max_tokens: int | None) -> bool:
        """Whether the request asks for at most `serve_whole_max_output_tokens` new tokens."""
        return max_tokens is not None and 0 < max_tokens <= self._max_whole_output

    def _load(self, pool: str, now: float) -> float | None:
        """The decode load of the pool's least loaded replica (`_least`), None without a
        recent snapshot."""
        snapshot = self._fresh(pool, now)
        return None if snapshot is None else self._least(pool, snapshot)

    def _fresh(self, pool: str, now: float) -> PoolSnapshot | None:
        """The pool's snapshot if it has replicas reporting sequences and is recent; before
        its first such one (no snapshot, or replicas known without stats yet), `_unseen`
        for `max_age_s` from the first look that found it so. A pool that has reported
        once and lost its stats since, or whose router knows no replica at all (none is
        running), has no figures: the route stands."""
        snapshot = self._snapshot(pool)
        if snapshot is not None and any(
            s.get("num_sequences") is not None for s in snapshot.replicas.values()
        ):
            self._reported.add(pool)
            return snapshot if now - snapshot.updated_at <= self._max_age_s else None
        if pool in self._reported or (snapshot is not None and not snapshot.replicas):
            return None
        first_look = self._first_look.setdefault(pool, now)
        if now - first_look > self._max_age_s:
            return None
        num_replicas = len(snapshot.replicas) if snapshot is not None else None
        return self._unseen(pool, now, num_replicas)

    def _unseen(self, pool: str, now: float, num_replicas: int | None) -> PoolSnapshot:
        """A pool whose replicas have not reported yet (module docstring): `num_replicas`
        (None: unknown, its initial count) idle as of now, so that what this ingress has
        running and computing there make its figures (`_sequences`, `_in_flight`); no
        prefill rate (token gate). As of now, not earlier: the sequences this ingress sent
        since (`_sequences`) then add nothing, on purpose (module docstring)."""
        count = num_replicas or self._initial_replicas.get(pool, 1)
        replicas = {f"{pool}-unseen-{i}": {"num_sequences": 0} for i in range(count)}
        return PoolSnapshot(replicas, now)

    def _in_flight(self, pool: str, now: float) -> tuple[float, float] | None:
        """(prompt tokens to compute, requests in flight) on the pool's least loaded
        replica (module docstring, short outputs); None without a recent snapshot."""
        snapshot = self._fresh(pool, now)
        if snapshot is None:
            return None
        computing = self.computing(pool) / len(snapshot.replicas)
        return min(
            (max(figure(s, "queued_tokens"), computing), sequences)
            for s, sequences in self._sequences(pool, snapshot)
        )

    def _sequences(
        self, pool: str, snapshot: PoolSnapshot
    ) -> list[tuple[Mapping[str, Any], float]]:
        """Each reporting replica's stats with the sequences it holds: those it reports plus
        the ones this ingress sent since the snapshot, and at least those this ingress has
        running there (both spread over the pool's replicas)."""
        num_replicas = len(snapshot.replicas)
        extra = self._sent.since(pool, snapshot.updated_at) / num_replicas
        running = self.running(pool) / num_replicas
        return [
            (s, max(figure(s, "num_sequences") + extra, running))
            for s in snapshot.replicas.values()
            if s.get("num_sequences") is not None
        ]

    def _least(self, pool: str, snapshot: PoolSnapshot, candidate: bool = False) -> float | None:
        """The decode load of the pool's least loaded replica, counting the sequences this
        ingress sent since the snapshot, and at least those it has running there (both
        spread over its replicas). As an overflow `candidate`, only replicas at most
        `decode_overflow_max_prompt_busy` busy with prompts and with at most
        `decode_overflow_max_prompt_tokens` (or ms, `_prompt_room`) computing count (None
        when none does)."""
        if candidate:
            rates = [figure(s, "prefill_tokens_per_s") for s in snapshot.replicas.values()]
            if not self._prompt_room(self.computing(pool) / len(rates), min(rates)):
                return None
        loads = [
            decode_load(sequences, figure(s, "prompt_busy"))
            for s, sequences in self._sequences(pool, snapshot)
            if not candidate
            or (
                figure(s, "prompt_busy") <= self._max_prompt_busy
                and self._prompt_room(figure(s, "queued_tokens"), figure(s, "prefill_tokens_per_s"))
            )
        ]
        return min(loads) if loads else None

    def _prompt_room(self, tokens: float, tokens_per_s: float) -> bool:
        """Whether a replica computing `tokens` of prompts (at its measured `tokens_per_s`,
        0 when not measured) can take a whole request: in time where the rate is known and
        the time gate is on, else by the token count."""
        if self._max_prompt_s > 0 and tokens_per_s > 0:
            return tokens / tokens_per_s <= self._max_prompt_s
        return tokens <= self._max_prompt_tokens
