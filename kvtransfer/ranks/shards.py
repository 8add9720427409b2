"""The shards of a tensor-parallel replica as KV transfer sees them: each rank's model id,
layout, ticket and cache geometry (rank r of N holds the KV heads `engine.parallel.split`
gives it, every layer)."""

from __future__ import annotations

from dataclasses import replace

from engine.kv_cache import KVCacheSpec
from engine.parallel import split
from kvtransfer.base import KVLayout, Ticket


def rank_model_id(model_id: str, rank: int, size: int) -> str:
    """The model id rank `rank` of `size` transfers under: ranks never match each other."""
    return f"{model_id}@rank{rank}of{size}"


def rank_layout(layout: KVLayout, rank: int) -> KVLayout:
    """Rank `rank`'s own layout, given a replica's: its shard of the KV heads, one rank."""
    size = layout.tensor_parallel_size
    return replace(
        layout,
        model_id=rank_model_id(layout.model_id, rank, size),
        num_kv_heads=len(split(layout.num_kv_heads, rank, size)),
        tensor_parallel_size=1,
    )


def rank_ticket(ticket: Ticket, rank: int) -> Ticket:
    """The ordinary ticket rank `rank` of the sender serves: rank `rank` of the receiver."""
    endpoint, epoch = (ticket.endpoint, ticket.epoch) if rank == 0 else ticket.ranks[rank - 1]
    return Ticket(
        ticket.request_id,
        endpoint,
        ticket.block_ids,
        rank_layout(ticket.layout, rank),
        epoch,
        ticket.seconds_left(),
        ticket.num_cached_blocks,
    )


def shard_spec(spec: KVCacheSpec, rank: int) -> KVCacheSpec:
    """Rank `rank`'s own cache, given a replica's spec (`engine.tp_kv.rank_spec`)."""
    size = spec.tensor_parallel_size
    return replace(
        spec,
        num_layers=spec.num_model_layers,
        num_kv_heads=len(split(spec.num_model_kv_heads, rank, size)),
        tensor_parallel_size=1,
        model_kv_heads=None,
    )
