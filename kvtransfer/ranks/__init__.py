"""Per-rank KV transfer endpoints of tensor-parallel replicas.

Where each rank of a TP replica holds its KV shard in memory only it can address (CUDA:
its own GPU), one endpoint in rank 0 cannot move the replica's KV. Instead every rank runs
an ordinary `Receiver` or `Sender` over its own shard, and rank i of a prefill replica
writes into rank i of a decode replica of the same TP size:

    decode rank 0   GroupReceiver.open_ticket ──▶ its own receiver, and each worker's over
                    the worker's control socket ──▶ one ticket: rank 0's endpoint, and the
                    others' in `Ticket.ranks`
    prefill rank 0  GroupSender.connect(ticket) ──▶ rank i connects to decode rank i
                    each step: rank i's layer hook sends its shard's layer
                    (`engine.tp_worker.RankSends`)
                    finish ──▶ every rank

Each rank's endpoint tells rank 0 when a transfer ends and when it settles (`ObserveFn`:
nothing can write or read its blocks any more). A group transfer is DONE once every rank's
is; any other end of one rank ends it (the others are aborted); its `release` runs once,
after every rank has settled, so blocks go back to the pool only when no rank of either
side can still touch them. A worker that dies settles its ranks' transfers as FAILED: a
dead process writes nothing.

Each rank's layout is its shard's (`rank_layout`), its model id naming the rank, so a
rank can never land another rank's heads. Ranks of another TP size are not bridged here:
`GroupSender` refuses such a ticket (`KVLayoutMismatchError`).
"""

from kvtransfer.ranks.endpoints import (
    AnyReceiver,
    AnySender,
    GroupReceiver,
    GroupSender,
    open_group_receiver,
    open_group_sender,
)
from kvtransfer.ranks.link import RankHost, RankLink, RankTransfer
from kvtransfer.ranks.shards import rank_layout, rank_model_id, rank_ticket, shard_spec

__all__ = [
    "AnyReceiver",
    "AnySender",
    "GroupReceiver",
    "GroupSender",
    "RankHost",
    "RankLink",
    "RankTransfer",
    "open_group_receiver",
    "open_group_sender",
    "rank_layout",
    "rank_model_id",
    "rank_ticket",
    "shard_spec",
]
