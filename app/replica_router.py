"""Replica choice inside a pool: Serve's custom `RequestRouter`, fed by replica stats.

Each prefill and decode replica reports `replica` (its name), `queued_tokens` and
`num_free_blocks` through `record_routing_stats`; this router ranks the pool's replicas by
least queued work, then most free KV (ties broken at random, so idle replicas share the
load), and lets Serve's usual queue-length probe pick among the top ranks.

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
from typing import Any

from ray.serve._private.common import RunningReplicaInfo
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# The module, not its objects: Serve pickles this router module by value into every caller
# process, and objects named here would travel as copies, not the process's shared ones.
from decode import placement


def replica_load(stats: dict) -> tuple[float, float]:
    """Sort key: fewer queued tokens first, then more free KV blocks."""
    return (float(stats.get("queued_tokens", 0)), -float(stats.get("num_free_blocks", 0)))


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
    """A replica handle that notes where each prefill call goes as it is sent. Serve's
    `on_request_routed` would be too late: it waits for the replica to accept the call."""

    def try_send_request(self, pr: PendingRequest, with_rejection: bool) -> Any:
        first: Any = pr.args[0] if pr.args else None
        if hasattr(first, "exclude_replicas"):  # a PrefillRequest
            placement.placements.record(first.request_id, replica_name(self))
        return super().try_send_request(pr, with_rejection)


class KVAwareRouter(RequestRouter):
    """Least queued tokens, then most free KV blocks; replicas without stats rank last;
    a call's excluded replicas are never offered, its probed replica first."""

    def create_replica_wrapper(self, replica_info: RunningReplicaInfo) -> RunningReplica:
        return _TrackedReplica(replica_info)

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
        allowed = [r for r in candidate_replicas if replica_name(r) not in exclude]
        first = [r for r in allowed if probe is not None and replica_name(r) == probe]
        rest = [r for r in allowed if r not in first]
        with_stats = [r for r in rest if r.routing_stats]
        without = [r for r in rest if not r.routing_stats]
        ranked = sorted(with_stats, key=lambda r: (replica_load(r.routing_stats), random.random()))
        ranks = [[r] for r in first + ranked]
        if without:
            ranks.append(without)
        return ranks
