"""Replica choice inside a pool: Serve's custom `RequestRouter`, fed by replica stats.

Each prefill and decode replica reports `queued_tokens` and `num_free_blocks` through
`record_routing_stats`; this router ranks the pool's replicas by least queued work, then
most free KV, and lets Serve's usual queue-length probe pick among the top ranks.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def replica_load(stats: dict) -> tuple[float, float]:
    """Sort key: fewer queued tokens first, then more free KV blocks."""
    return (float(stats.get("queued_tokens", 0)), -float(stats.get("num_free_blocks", 0)))


class KVAwareRouter(FIFOMixin, RequestRouter):
    """Least queued tokens, then most free KV blocks; replicas without stats rank last."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        with_stats = [r for r in candidate_replicas if r.routing_stats]
        without = [r for r in candidate_replicas if not r.routing_stats]
        ranked = sorted(with_stats, key=lambda r: replica_load(r.routing_stats))
        ranks = [[r] for r in ranked]
        if without:
            ranks.append(without)
        return ranks
