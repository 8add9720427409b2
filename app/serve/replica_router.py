"""Replica choice inside a pool: Serve's custom `RequestRouter`, fed by replica stats.

Each prefill and decode replica reports `replica` (its name), `queued_tokens` (prompt tokens
waiting), `num_sequences` (requests it holds that still compute) and `num_free_blocks`
through `record_routing_stats`; this router ranks the pool's replicas by that load (ties
broken at random, so idle replicas share the load), and Serve takes the first ranked
replica whose queue is not full.

The stats lag: Serve polls them once per `request_routing_stats_period_s`, and a report can
be measured before a call sent just earlier reached its replica. Ranked on the report alone,
every call of that period went to the same replica (the one that looked least loaded a
moment ago), and a burst of streams piled onto it while the other replicas idled (in a
test app: six of seven streams on one of two replicas). So each figure is never below what
this router itself has in flight there (`InFlight`: calls ranked first for a replica or
sent to it and not completed, and the prompt tokens they make it compute; counted from the
ranking, as Serve may switch tasks before it sends). Replicas rank by queued prompt tokens
first (a new call waits for them, and a stream there stalls while they are computed), in
whole KV blocks, then sequences (the batch a stream joins), then most free KV blocks. Less
than a block is no queue: a decode replica reports the one token a handed-off request or a
prefix hit leaves it to compute, and a report of 1 queued token, stale for a stats period,
outranked three sequences in flight and sent six new conversations in a row to the other
replica (`bench multiturn`, two decode replicas: 11 of 17 conversations on one). A prefill
call's prompt counts until its hand-off; a stream's prompt, when the replica prefills it itself
(colocated, or served whole), counts until the replica's reports can show it
(`REPORT_LAG_S`), so a chat turn sent right after a 4k-token document does not join it.

Remote-prefill calls carry hints (`PrefillRequest.exclude_replicas`, `probe_replica`): an
excluded replica (its circuit breaker is open, or it just failed this request) is never
offered, and a half-open replica being probed is offered first. Requests are matched to
the replica chosen for them exactly (no FIFO hand-over between requests), so an exclusion
holds for the request that carries it. The router also records, in `replica.placement`,
which replica each prefill call was sent to (at the send, so a replica that never answers,
not even to accept, is still known) and every pool's replicas with their stats.

Prefix-aware: replicas also publish a digest of their prefix cache (`prefix_digest`,
`block_size`; `replica/prefix_digest.py`). The router hashes each call's prompt blocks as
the engine does (tenant-salted, chained), looks up how long a prefix each replica caches
(`app/routing/prefix_index.py`) and credits it against that replica's queued tokens while
its sequences stay near the least loaded replica's (`app/routing/prefix_choice.py`); a call
with a cached prefix also counts only its uncached prompt tokens in flight. Its choices are
counted per pool (`prefix_choice.prefix_routing`) for the ingress's stats report.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from ray.serve._private.common import ReplicaID, RunningReplicaInfo
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# The modules, not their objects: Serve pickles this router module by value into every caller
# process, and objects named here would travel as copies, not the process's shared ones.
from app.routing import prefix_choice
from app.routing import prefix_index as prefix_indexes
from app.routing.prefix_choice import Candidate, prefix_order
from app.routing.prefix_index import PrefixIndex
from replica import placement
from replica.prefix_digest import prompt_block_keys

MAX_IN_FLIGHT = 100_000  # far above the calls one process has open; bounds a lost completion
# How long a replica's reports may lag behind a call (the stats period, 1 s, and Serve's
# push). A call counts on the replica ranked first for it from that moment (Serve switches
# tasks between choosing and sending, and a burst routed meanwhile must see it) until it is
# sent, or for this long if it never is; a stream's prompt, prefilled where it runs, counts
# for this long after the send, after which the replica's own `queued_tokens` show it.
REPORT_LAG_S = 2.0


class InFlight:
    """What this router chose or sent that Serve has not completed, per replica: calls, and
    the prompt tokens they make the replica compute (module docstring). Serve reports each
    send's end exactly once (`on_request_completed`, with the replica it went to), whether
    it finished, failed, was rejected or cancelled; a retried call is a second send of the
    same id, to the same replica or another. Should an end go missing, sends beyond
    `max_entries` drop oldest first."""

    def __init__(self, max_entries: int = MAX_IN_FLIGHT, report_lag_s: float = REPORT_LAG_S):
        self._max_entries, self._lag_s = max_entries, report_lag_s
        self._lock = threading.Lock()
        self._serials = itertools.count()
        self._chosen: OrderedDict[str, tuple[str, int, float]] = (
            OrderedDict()
        )  # call -> replica, tokens, when
        self._sends: OrderedDict[int, tuple[str, str, int]] = (
            OrderedDict()
        )  # serial -> call, replica, tokens
        self._by_call: dict[tuple[str, str], deque[int]] = {}  # (call, replica) -> serials
        self._prompts: deque[tuple[float, int]] = deque()  # (until, serial) of streams' prompts
        self._load: dict[str, list[int]] = {}  # replica -> [calls, prompt tokens]

    def chosen(self, call_id: str, replica: str, prompt_tokens: int) -> None:
        """`replica` was ranked first for the call (Serve usually takes it)."""
        with self._lock:
            self._unchoose(call_id)
            self._chosen[call_id] = (replica, prompt_tokens, time.monotonic())
            self._count(replica, 1, prompt_tokens)

    def sent(self, call_id: str, replica: str, prompt_tokens: int, until_done: bool) -> None:
        """Serve is sending the call to `replica`; its prompt tokens count until it completes
        (`until_done`: a prefill call) or for `report_lag_s` (a stream). Sent where it was
        ranked first, it counts the tokens of that ranking (its uncached ones) if fewer."""
        with self._lock:
            if (entry := self._chosen.get(call_id)) is not None and entry[0] == replica:
                prompt_tokens = min(prompt_tokens, entry[1])
            self._unchoose(call_id)
            serial = next(self._serials)
            self._sends[serial] = (call_id, replica, prompt_tokens)
            self._by_call.setdefault((call_id, replica), deque()).append(serial)
            self._count(replica, 1, prompt_tokens)
            if prompt_tokens and not until_done:
                self._prompts.append((time.monotonic() + self._lag_s, serial))
            while len(self._sends) > self._max_entries:
                self._drop_send(next(iter(self._sends)))

    def completed(self, call_id: str, replica: str) -> None:
        """One send of the call to `replica` ended."""
        with self._lock:
            serials = self._by_call.get((call_id, replica))
            if serials:
                self._drop_send(serials[0])
            else:
                self._unchoose(call_id)

    def load(self, replica: str) -> tuple[int, int]:
        """(calls, prompt tokens) chosen for or in flight to `replica`."""
        with self._lock:
            now = time.monotonic()
            while self._chosen and next(iter(self._chosen.values()))[2] < now - self._lag_s:
                self._unchoose(next(iter(self._chosen)))
            while self._prompts and self._prompts[0][0] <= now:
                serial = self._prompts.popleft()[1]
                if (entry := self._sends.get(serial)) is not None:
                    self._sends[serial] = (entry[0], entry[1], 0)
                    self._count(entry[1], 0, -entry[2])
            calls, tokens = self._load.get(replica, (0, 0))
            return calls, tokens

    def _count(self, replica: str, calls: int, tokens: int) -> None:
        load = self._load.setdefault(replica, [0, 0])
        load[0] += calls
        load[1] += tokens
        if load[0] <= 0:
            del self._load[replica]

    def _unchoose(self, call_id: str) -> None:
        if (entry := self._chosen.pop(call_id, None)) is not None:
            self._count(entry[0], -1, -entry[1])

    def _drop_send(self, serial: int) -> None:
        call_id, replica, tokens = self._sends.pop(serial)
        serials = self._by_call[(call_id, replica)]
        serials.remove(serial)
        if not serials:
            del self._by_call[(call_id, replica)]
        self._count(replica, -1, -tokens)


def replica_load(
    stats: dict, in_flight: tuple[int, int], block_size: int = 1
) -> tuple[float, float, float]:
    """Sort key (module docstring): queued prompt tokens in whole blocks of `block_size`,
    then sequences, then most free KV blocks; each figure at least what this router has in
    flight there."""
    calls, prompt_tokens = in_flight
    tokens = max(placement.figure(stats, "queued_tokens"), float(prompt_tokens))
    tokens -= tokens % max(block_size, 1)
    sequences = max(placement.figure(stats, "num_sequences"), float(calls))
    return tokens, sequences, -placement.figure(stats, "num_free_blocks")


def call_cost(first_arg: Any) -> tuple[int, bool] | None:
    """(prompt tokens the call makes its replica compute, whether they count until the call
    completes). A prefill call's count until it completes (the hand-off follows the prompt);
    a stream's, when the replica prefills it itself (`prefill_pool` None: colocated, a short
    prompt, or a request served whole), for `REPORT_LAG_S`; a stream prefilled elsewhere
    brings none. None for control calls (stats, drain): only calls whose first argument
    describes a request are load."""
    prompt = getattr(first_arg, "prompt_token_ids", None)
    if prompt is None:
        return None
    if hasattr(first_arg, "exclude_replicas"):  # a PrefillRequest
        return len(prompt), True
    return (len(prompt) if getattr(first_arg, "prefill_pool", None) is None else 0), False


def replica_name(replica: RunningReplica) -> str:
    """The name the replica reports in its routing stats (Serve's id until it has)."""
    stats = replica.routing_stats or {}
    return str(stats.get("replica") or f"serve:{replica.replica_id.unique_id}")


def _hints(pending_request: PendingRequest | None) -> tuple[frozenset[str], str | None]:
    """(replicas to exclude, replica to probe) named by the call's first argument."""
    if pending_request is None or not pending_request.args:
        return frozenset(), None
    first: Any = pending_request.args[0]
    exclude = getattr(first, "exclude_replicas", ()) or ()
    return frozenset(exclude), getattr(first, "probe_replica", None)


class _TrackedReplica(RunningReplica):
    """A replica handle that notes each call as it is sent: the router's `InFlight`, and
    where each prefill call goes. Serve's `on_request_routed` would be too late: it waits
    for the replica to accept the call."""

    in_flight: InFlight

    def try_send_request(self, pr: PendingRequest, with_rejection: bool) -> Any:
        first: Any = pr.args[0] if pr.args else None
        if (cost := call_cost(first)) is not None:
            call_id, replica = pr.metadata.internal_request_id, self.replica_id.unique_id
            self.in_flight.sent(call_id, replica, *cost)
        if hasattr(first, "exclude_replicas"):  # a PrefillRequest
            placement.placements.record(first.request_id, replica_name(self))
        return super().try_send_request(pr, with_rejection)


class KVAwareRouter(RequestRouter):
    """Least loaded first (module docstring), counting this router's calls in flight;
    replicas without stats rank last; a call's excluded replicas are never offered, its
    probed replica first."""

    @property
    def in_flight(self) -> InFlight:
        # Serve may wrap replicas before `initialize_state` runs: created on first use.
        if (ledger := getattr(self, "_in_flight", None)) is None:
            ledger = self._in_flight = InFlight()
        return ledger

    @property
    def prefix_index(self) -> PrefixIndex:
        # One per pool in this process, shared by its routers and read by decode overflow.
        if (index := getattr(self, "_prefix_index", None)) is None:
            index = self._prefix_index = prefix_indexes.shared.pool(self._deployment_id.name)
        return index

    def create_replica_wrapper(self, replica_info: RunningReplicaInfo) -> RunningReplica:
        replica = _TrackedReplica(replica_info)
        replica.in_flight = self.in_flight
        return replica

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.completed(internal_request_id, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        named = [(replica_name(r), r.routing_stats or {}) for r in replicas]
        placement.pool_view.update(self._deployment_id.name, named)
        for name, stats in named:
            self.prefix_index.update(name, stats)
        self.prefix_index.retain(name for name, _ in named)

    def _prompt_keys(self, first_arg: Any) -> list[int]:
        """The call's prompt block keys, as its pool's replicas hash blocks ([] when the
        call has no prompt or no replica publishes a digest)."""
        prompt = getattr(first_arg, "prompt_token_ids", None)
        block_size = self.prefix_index.block_size
        if prompt is None or block_size is None:
            return []
        tenant = getattr(first_arg, "tenant", "") or ""
        return prompt_block_keys(prompt, block_size, tenant, prefix_indexes.MAX_PROMPT_BLOCKS)

    def _rank(self, replicas: list[RunningReplica], keys: list[int]) -> tuple[list[int], list[int]]:
        """(order of `replicas`, most preferred first; blocks of the prompt each caches)."""
        index = self.prefix_index
        matched = [index.matched(replica_name(r), keys) for r in replicas]
        block_size = index.block_size or 0
        choices = prefix_choice.prefix_routing.pool(self._deployment_id.name)
        candidates = [
            Candidate(
                replica_load(
                    r.routing_stats, self.in_flight.load(r.replica_id.unique_id), block_size
                ),
                matched[i] * block_size,
                random.random(),
                choices.held(replica_name(r)),
            )
            for i, r in enumerate(replicas)
        ]
        return prefix_order(candidates), matched

    def _chose(
        self,
        chosen: RunningReplica,
        pending_request: PendingRequest | None,
        keys: list[int],
        cached_blocks: int,
        best_blocks: int,
    ) -> None:
        """`chosen` is ranked first for the call, caching `cached_blocks` of its prompt's
        `keys` where the pool's best caches `best_blocks`: count its uncached prompt tokens
        in flight there, its blocks as sent there, and the choice."""
        first_arg = pending_request.args[0] if pending_request and pending_request.args else None
        cost = call_cost(first_arg)
        if cost is not None and pending_request is not None:
            uncached = max(0, cost[0] - cached_blocks * (self.prefix_index.block_size or 0))
            call_id = pending_request.metadata.internal_request_id
            self.in_flight.chosen(call_id, chosen.replica_id.unique_id, uncached)
        if keys:
            name = replica_name(chosen)
            self.prefix_index.note_sent(name, keys)
            stats = prefix_choice.prefix_routing.pool(self._deployment_id.name)
            stats.record(name, cached_blocks, best_blocks, keys[0])

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        exclude, probe = _hints(pending_request)
        first_arg = pending_request.args[0] if pending_request and pending_request.args else None
        allowed = [r for r in candidate_replicas if replica_name(r) not in exclude]
        first = [r for r in allowed if probe is not None and replica_name(r) == probe]
        rest = [r for r in allowed if r not in first]
        with_stats = [r for r in rest if r.routing_stats]
        without = [r for r in rest if not r.routing_stats]
        for r in with_stats:  # the stats Serve handed over (also pushed to update_replicas)
            self.prefix_index.update(replica_name(r), r.routing_stats)
        keys = self._prompt_keys(first_arg)
        order, matched = self._rank(with_stats, keys)
        ranked = first + [with_stats[i] for i in order]
        ranks = [[r] for r in ranked]
        if ranks:
            chosen = ranks[0][0]
            cached = matched[with_stats.index(chosen)] if chosen in with_stats else 0
            self._chose(chosen, pending_request, keys, cached, max(matched, default=0))
        if without:
            ranks.append(without)
        return ranks
