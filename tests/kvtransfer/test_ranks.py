"""Per-rank KV transfer endpoints (`kvtransfer.ranks`): a TP=2 replica's ranks each move their
own shard over the real shm and tcp endpoints, rank 1 behind a real control socket as a
worker process has it (here a thread on the other end of a socket pair). The landed bytes
equal the sent ones on every rank; the group is DONE only once every rank is; a rank lost
mid-transfer fails the group and its blocks come back exactly once, after every rank let
go of them."""

from __future__ import annotations

import pickle
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from engine.parallel import split
from kvtransfer import KVLayoutMismatchError, TransferOptions, TransferState
from kvtransfer.base import KVLayout, Ticket
from kvtransfer.ranks import (
    GroupReceiver,
    GroupSender,
    RankHost,
    RankLink,
    RankTransfer,
    open_group_receiver,
    open_group_sender,
    rank_layout,
    rank_model_id,
    rank_ticket,
    shard_spec,
)
from kvtransfer.ranks.group import GroupTable

LAYERS, HEADS, HEAD_DIM, BLOCK, BLOCKS = 2, 3, 8, 4, 16
SIZE = 2
MODEL = "m"
OPTIONS = TransferOptions(reap_interval_s=0.01, fence_timeout_s=1.0)
WAIT_S = 10.0


def replica_spec() -> KVCacheSpec:
    slots = -(-HEADS // SIZE)
    return KVCacheSpec(LAYERS * SIZE, BLOCKS, BLOCK, slots, HEAD_DIM, "float32", SIZE, HEADS)


# ---- the group table alone ----------------------------------------------------------------


def test_group_is_done_only_when_every_rank_is_and_releases_once() -> None:
    released: Counter[str] = Counter()
    table = GroupTable(2, lambda rid: released.update([rid]), release_on_done=True)
    table.open("r", WAIT_S)
    assert table.state("r") is TransferState.PENDING
    table.observe(0, "r", TransferState.DONE, None, settled=True)
    assert table.state("r") is TransferState.TRANSFERRING  # rank 1 may still write
    assert not released
    table.observe(1, "r", TransferState.DONE, None, settled=False)
    assert table.state("r") is TransferState.DONE
    assert not released  # rank 1 has not settled
    table.observe(1, "r", TransferState.DONE, None, settled=True)
    table.observe(1, "r", TransferState.DONE, None, settled=True)  # a duplicate: ignored
    assert released == {"r": 1}


def test_one_failed_rank_fails_the_group_and_a_done_receiver_keeps_its_blocks() -> None:
    released: Counter[str] = Counter()
    receiver_side = GroupTable(2, lambda rid: released.update([rid]), release_on_done=False)
    receiver_side.open("ok", WAIT_S)
    for rank in range(2):
        receiver_side.observe(rank, "ok", TransferState.DONE, None, settled=True)
    assert receiver_side.state("ok") is TransferState.DONE and not released  # decode keeps them
    receiver_side.open("bad", WAIT_S)
    error = KVLayoutMismatchError({"x": (1, 2)})
    receiver_side.observe(1, "bad", TransferState.FAILED, error, settled=False)
    assert receiver_side.state("bad") is TransferState.FAILED  # known before rank 0 ends
    assert receiver_side.error("bad") is error
    assert receiver_side.wait("bad", 0.0) is TransferState.FAILED
    assert receiver_side.silent_ranks(-WAIT_S) == {0}  # (as if far past its deadline)
    receiver_side.observe(0, "bad", TransferState.ABORTED, None, settled=True)
    assert receiver_side.state("bad") is TransferState.FAILED  # the first end stands
    assert receiver_side.error("bad") is error
    assert not released  # rank 1 is still fenced, not silent: it ended its transfer
    assert receiver_side.silent_ranks(-WAIT_S) == set()
    receiver_side.settle_rank(1, error)  # its process is gone: nothing can write
    assert released == {"bad": 1}
    with pytest.raises(ValueError, match="ended recently"):
        receiver_side.open("bad", WAIT_S)  # a late event of it could not touch a new one


def test_a_transfer_that_never_left_releases_nothing_and_gone_ranks_settle() -> None:
    released: Counter[str] = Counter()
    table = GroupTable(3, lambda rid: released.update([rid]), release_on_done=False)
    table.open("r", WAIT_S, gone=[2])
    assert table.state("r") is TransferState.FAILED
    table.end_unsent("r", KVLayoutMismatchError({"x": (1, 2)}))
    assert not released and table.counts() == {"num_open": 0, "num_fenced": 0}
    table.observe(0, "r", TransferState.ABORTED, None, settled=True)  # late: ignored
    assert not released


# ---- shards -------------------------------------------------------------------------------


def test_rank_layouts_are_the_shards_and_never_match_each_other() -> None:
    spec = replica_spec()
    layout = KVLayout.from_spec(spec, MODEL)
    for rank in range(SIZE):
        own = KVLayout.from_spec(shard_spec(spec, rank), rank_model_id(MODEL, rank, SIZE))
        assert rank_layout(layout, rank) == own
        assert own.num_kv_heads == len(split(HEADS, rank, SIZE))  # 2, then 1
    assert rank_layout(layout, 0).differences(rank_layout(layout, 1))["model_id"]
    ticket = Ticket("r", "e0", (1, 2), layout, 7, 5.0, 1, (("e1", 8),))
    again = pickle.loads(pickle.dumps(ticket))
    assert again.ranks == (("e1", 8),) and again.num_cached_blocks == 1
    one = rank_ticket(again, 1)
    assert (one.endpoint, one.epoch, one.layout) == ("e1", 8, rank_layout(layout, 1))


# ---- two ranks over the real endpoints ------------------------------------------------------


@dataclass
class Ranks:
    receiver: GroupReceiver
    sender: GroupSender
    sender_host: RankHost
    source: list[KVCache]  # each prefill rank's cache
    landed: list[KVCache]  # each decode rank's cache
    decode_released: Counter[str]
    prefill_released: Counter[str]
    links: list[RankLink]  # rank 0's ends: decode's, prefill's
    hosts: list[RankHost]  # the workers' ends: decode's, prefill's
    gone: list[threading.Event]  # set: that worker's process has exited


def _pair(transfer: RankTransfer, rank: int, spec: KVCacheSpec, cache: KVCache | None):  # noqa: ANN202
    """A worker rank's host on one end of a socket pair, rank 0's link on the other."""
    ours, theirs = socket.socketpair()
    host, kv_cache, ready = transfer.open_host(
        rank, SIZE, Connection(theirs.detach()), spec, cache, torch.device("cpu")
    )
    gone = threading.Event()  # "the worker's process has exited": the test says when
    link = transfer.link(rank, Connection(ours.detach()), exited=gone.is_set)
    return link, host, kv_cache, ready, gone


@pytest.fixture(params=["shm", "tcp"])
def ranks(request: pytest.FixtureRequest) -> Iterator[Ranks]:
    backend = request.param
    spec = replica_spec()
    network = {"host": "127.0.0.1"} if backend == "tcp" else {}
    decode_released: Counter[str] = Counter()
    prefill_released: Counter[str] = Counter()
    own_r, recv_t, table_r = open_group_receiver(
        backend,
        spec,
        model_id=MODEL,
        options=OPTIONS,
        device="cpu",
        network=network,
        release=lambda rid: decode_released.update([rid]),
    )
    cache_1 = None if backend == "shm" else KVCache.allocate(shard_spec(spec, 1))
    link_r, host_r, landed_1, ready, gone_r = _pair(recv_t, 1, shard_spec(spec, 1), cache_1)
    receiver = GroupReceiver(own_r, [link_r], [ready], KVLayout.from_spec(spec, MODEL), table_r)
    own_s, send_t, table_s = open_group_sender(
        backend,
        spec,
        model_id=MODEL,
        options=OPTIONS,
        device="cpu",
        source_host=None,
        release=lambda rid: prefill_released.update([rid]),
    )
    source = [KVCache.allocate(shard_spec(spec, r)) for r in range(SIZE)]
    for cache in source:
        cache.flat.copy_(torch.randn(cache.flat.shape))
    link_s, host_s, _, _, gone_s = _pair(send_t, 1, shard_spec(spec, 1), source[1])
    sender = GroupSender(own_s, [link_s], KVLayout.from_spec(spec, MODEL), table_s)
    yield Ranks(
        receiver,
        sender,
        host_s,
        source,
        [own_r.kv_cache, landed_1],
        decode_released,
        prefill_released,
        [link_r, link_s],
        [host_r, host_s],
        [gone_r, gone_s],
    )
    sender.close()
    receiver.close()
    host_s.close()
    host_r.close()
    gone_s.set()  # the links' readers stop waiting for the "processes" to exit
    gone_r.set()


def _send_rank(ranks: Ranks, ticket: Ticket, rank: int, src_ids: tuple[int, ...]) -> None:
    """Rank `rank` sends every layer of its shard, as its layer hook does in a step."""
    for layer in range(LAYERS):
        if rank == 0:
            cache = ranks.source[0]
            k, v = cache.key_caches[layer], cache.value_caches[layer]
            ranks.sender.send_layer(ticket, layer, k, v, src_ids)
        else:
            ranks.sender_host.send_layers(layer, ranks.source[1], [(ticket.request_id, src_ids)])


def test_every_rank_lands_its_own_shard(ranks: Ranks) -> None:
    dst_ids, src_ids = (5, 9, 2), (1, 3, 4)
    ticket = ranks.receiver.open_ticket("r1", dst_ids, WAIT_S)
    assert len(ticket.ranks) == SIZE - 1
    ranks.sender.connect(ticket, WAIT_S)
    _send_rank(ranks, ticket, 0, src_ids)
    ranks.sender.own.finish(rank_ticket(ticket, 0))
    assert ranks.sender.own.wait("r1", WAIT_S) is TransferState.DONE
    # Rank 0 alone is not the group: rank 1 has sent nothing yet.
    assert ranks.sender.poll("r1") is TransferState.TRANSFERRING
    assert ranks.receiver.poll("r1") is TransferState.TRANSFERRING
    _send_rank(ranks, ticket, 1, src_ids)
    ranks.sender.finish(ticket)  # rank 0's ended already; rank 1's goes over its socket
    assert ranks.sender.wait("r1", WAIT_S) is TransferState.DONE
    assert ranks.receiver.wait("r1", WAIT_S) is TransferState.DONE
    for rank in range(SIZE):
        for layer in range(LAYERS):
            for src, dst in zip(src_ids, dst_ids, strict=True):
                sent, landed = ranks.source[rank], ranks.landed[rank]
                assert torch.equal(landed.key_caches[layer][dst], sent.key_caches[layer][src])
                assert torch.equal(landed.value_caches[layer][dst], sent.value_caches[layer][src])
    _wait(lambda: ranks.prefill_released == {"r1": 1}, "the source blocks released once")
    assert not ranks.decode_released  # DONE: the blocks stay with the decode request


def test_a_rank_lost_mid_transfer_fails_the_group_and_releases_once(ranks: Ranks) -> None:
    """Prefill rank 1's control socket breaks mid-transfer while its process lives on: the
    group fails, but its blocks stay held until the process has exited (it may still be
    writing); then everything comes back exactly once."""
    ticket = ranks.receiver.open_ticket("r2", (1, 2), WAIT_S)
    ranks.sender.connect(ticket, WAIT_S)
    _send_rank(ranks, ticket, 0, (3, 4))
    ranks.links[1].close()  # the control socket breaks; the worker's sender lives on
    ranks.receiver.abort("r2")  # decode, told the prefill call failed
    assert ranks.receiver.wait("r2", WAIT_S) is TransferState.ABORTED
    _wait(lambda: ranks.decode_released == {"r2": 1}, "decode's blocks released once")
    assert ranks.sender.wait("r2", WAIT_S) is not TransferState.DONE
    assert ranks.links[1].lost is not None
    assert "control link lost" in (ranks.sender.serving_problem() or "")
    assert not ranks.prefill_released  # rank 1's process may still read its blocks
    ranks.hosts[1].close()  # now it is gone, its endpoint with it
    ranks.gone[1].set()
    _wait(lambda: ranks.prefill_released == {"r2": 1}, "prefill's blocks released once")
    assert ranks.receiver.transfer_counts()["num_open"] == 0


def test_a_ticket_of_another_tp_size_is_refused(ranks: Ranks) -> None:
    ticket = ranks.receiver.open_ticket("r3", (1,), WAIT_S)
    narrow = Ticket("r3", ticket.endpoint, ticket.block_ids, rank_layout(ticket.layout, 0), 1, 5)
    with pytest.raises(KVLayoutMismatchError):
        ranks.sender.connect(narrow, WAIT_S)
    assert ranks.prefill_released == {"r3": 1}
    ranks.receiver.abort("r3")
    _wait(lambda: ranks.decode_released == {"r3": 1}, "decode's blocks released once")


def _wait(condition, what: str) -> None:  # noqa: ANN001
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            done.set()
            break
        done.wait(0.01)
    assert done.is_set(), what
