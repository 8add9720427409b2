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
first (a new call waits for them, and a stream there stalls while they are computed), then
sequences (the batch a stream joins), then most free KV blocks. A prefill call's prompt
counts until its hand-off; a stream's prompt counts when the replica prefills it itself
(colocated, or served whole), for the stream's life: a replica with a 4k-token document in
flight stays the worse place for a chat turn until that request ends, and with prompts of
one size the order is by streams.

Remote-prefill calls carry hints (`PrefillRequest.exclude_replicas`, `probe_replica`): an
excluded replica (its circuit breaker is open, or it just failed this request) is never
offered, and a half-open replica being probed is offered first. Requests are matched to
the replica chosen for them exactly (no FIFO hand-over between requests), so an exclusion
holds for the request that carries it. The router also records, in `decode.placement`,
which replica each prefill call was sent to (at the send, so a replica that never answers,
not even to accept, is still known) and every pool's replicas with their stats.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from typing import Any

from ray.serve._private.common import ReplicaID, RunningReplicaInfo
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# The module, not its objects: Serve pickles this router module by value into every caller
# process, and objects named here would travel as copies, not the process's shared ones.
from decode import placement

MAX_IN_FLIGHT = 100_000  # far above the calls one process has open; bounds a lost completion
# A call counts on the replica ranked first for it from that moment: Serve switches tasks
# between choosing and sending (a queue-length probe), and a burst routed meanwhile must see
# it. Sending moves it to the replica Serve took; a call never sent stops counting after this.
CHOSEN_TTL_S = 2.0


class InFlight:
    """Calls this router chose or sent that Serve has not completed, per replica: how many,
    and the prompt tokens of the prefill calls among them. Serve reports every sent call's
    end exactly once (`on_request_completed`), whether it finished, failed, was rejected or
    cancelled; should one go missing, the oldest entries beyond `max_entries` are dropped."""

    def __init__(self, max_entries: int = MAX_IN_FLIGHT, chosen_ttl_s: float = CHOSEN_TTL_S):
        self._max_entries, self._chosen_ttl_s = max_entries, chosen_ttl_s
        self._lock = threading.Lock()
        # call id -> (replica, prompt tokens, monotonic time chosen; None once sent)
        self._calls: OrderedDict[str, tuple[str, int, float | None]] = OrderedDict()
        self._chosen: OrderedDict[str, float] = OrderedDict()  # not yet sent, oldest first
        self._load: dict[str, list[int]] = {}  # replica -> [calls, prompt tokens]

    def chosen(self, call_id: str, replica: str, prompt_tokens: int) -> None:
        """`replica` was ranked first for the call (Serve usually takes it)."""
        with self._lock:
            if call_id in self._calls and self._calls[call_id][2] is None:
                return  # already sent (a retry ranks again): the send counts
            self._add(call_id, replica, prompt_tokens, time.monotonic())

    def sent(self, call_id: str, replica: str, prompt_tokens: int) -> None:
        """Serve is sending the call to `replica`."""
        with self._lock:
            self._add(call_id, replica, prompt_tokens, None)

    def completed(self, call_id: str) -> None:
        with self._lock:
            self._drop(call_id)

    def load(self, replica: str) -> tuple[int, int]:
        """(calls, prompt tokens of prefill calls) chosen for or in flight to `replica`."""
        with self._lock:
            expired = time.monotonic() - self._chosen_ttl_s
            while self._chosen and next(iter(self._chosen.values())) < expired:
                self._drop(next(iter(self._chosen)))
            calls, tokens = self._load.get(replica, (0, 0))
            return calls, tokens

    def _add(self, call_id: str, replica: str, prompt_tokens: int, at: float | None) -> None:
        self._drop(call_id)
        self._calls[call_id] = (replica, prompt_tokens, at)
        if at is not None:
            self._chosen[call_id] = at
        load = self._load.setdefault(replica, [0, 0])
        load[0] += 1
        load[1] += prompt_tokens
        while len(self._calls) > self._max_entries:
            self._drop(next(iter(self._calls)))

    def _drop(self, call_id: str) -> None:
        entry = self._calls.pop(call_id, None)
        self._chosen.pop(call_id, None)
        if entry is None:
            return
        replica, tokens, _ = entry
        load = self._load[replica]
        load[0] -= 1
        load[1] -= tokens
        if load[0] <= 0:
            del self._load[replica]


def replica_load(stats: dict, in_flight: tuple[int, int]) -> tuple[float, float, float]:
    """Sort key (module docstring): queued prompt tokens, then sequences, then most free KV
    blocks; each figure at least what this router has in flight there."""
    calls, prompt_tokens = in_flight
    tokens = max(float(stats.get("queued_tokens", 0) or 0), float(prompt_tokens))
    sequences = max(float(stats.get("num_sequences", 0) or 0), float(calls))
    return tokens, sequences, -float(stats.get("num_free_blocks", 0) or 0)


def call_cost(first_arg: Any) -> int | None:
    """The prompt tokens a call makes its replica compute: a prefill call's, and a stream's
    that the replica prefills itself (`prefill_pool` None: colocated, a short prompt, or a
    request served whole); 0 for a stream prefilled elsewhere. None for control calls
    (stats, drain): only calls whose first argument describes a request are load."""
    prompt = getattr(first_arg, "prompt_token_ids", None)
    if prompt is None:
        return None
    return len(prompt) if getattr(first_arg, "prefill_pool", None) is None else 0


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
        cost = call_cost(first)
        if cost is not None:
            self.in_flight.sent(pr.metadata.internal_request_id, self.replica_id.unique_id, cost)
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

    def create_replica_wrapper(self, replica_info: RunningReplicaInfo) -> RunningReplica:
        replica = _TrackedReplica(replica_info)
        replica.in_flight = self.in_flight
        return replica

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.completed(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        placement.pool_view.update(
            self._deployment_id.name,
            [(replica_name(r), r.routing_stats or {}) for r in replicas],
        )

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

        def key(r: RunningReplica) -> tuple[tuple[float, float, float], float]:
            in_flight = self.in_flight.load(r.replica_id.unique_id)
            return replica_load(r.routing_stats, in_flight), random.random()

        ranks = [[r] for r in first + sorted(with_stats, key=key)]
        cost = call_cost(first_arg)
        if ranks and cost is not None and pending_request is not None:
            call_id = pending_request.metadata.internal_request_id
            self.in_flight.chosen(call_id, ranks[0][0].replica_id.unique_id, cost)
        if without:
            ranks.append(without)
        return ranks
