"""KV heads re-sharded between TP sizes: a prefill cache of TP=a into a receiver of TP=b,
over the real shm and tcp endpoints, lands byte for byte what a TP=b replica would hold."""

from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from engine.parallel import split
from kvtransfer import Sender, TransferOptions, TransferState, create_receiver, create_sender
from kvtransfer.base import KVLayout, KVLayoutMismatchError
from kvtransfer.datapath import Writing
from kvtransfer.reshard import Piece, Resharding

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 3, 8, 4
OPTIONS = TransferOptions(reap_interval_s=0.01)


def spec(size: int, num_blocks: int, dtype: str = "float32") -> KVCacheSpec:
    slots = -(-HEADS // size)
    return KVCacheSpec(LAYERS * size, num_blocks, BLOCK, slots, HEAD_DIM, dtype, size, HEADS)


def sharded(full: torch.Tensor, size: int) -> KVCache:
    """`full` (`[layers, 2, blocks, block, heads, dim]`) as a TP=`size` replica holds it:
    rank r's heads of layer l in item l * size + r, unused slots zero."""
    dtype = {torch.float32: "float32", torch.float8_e4m3fn: "float8_e4m3fn"}[full.dtype]
    cache = KVCache.allocate(spec(size, full.shape[2], dtype))
    for layer in range(LAYERS):
        for rank in range(size):
            heads = split(HEADS, rank, size)
            item, mine = layer * size + rank, slice(heads.start, heads.stop)
            cache.key_caches[item][:, :, : len(heads)] = full[layer, 0, :, :, mine]
            cache.value_caches[item][:, :, : len(heads)] = full[layer, 1, :, :, mine]
    return cache


def test_pieces_cover_each_destination_rank_once() -> None:
    resharding = Resharding(
        KVLayout.from_spec(spec(2, 1), "m"), KVLayout.from_spec(spec(3, 1), "m")
    )
    # heads: a=2 -> {0,1},{2}; b=3 -> {0},{1},{2}
    assert resharding.pieces(0) == [Piece(0, slice(0, 1), slice(0, 1))]
    assert resharding.pieces(1) == [Piece(0, slice(1, 2), slice(0, 1))]
    assert resharding.pieces(2) == [Piece(1, slice(0, 1), slice(0, 1))]
    into_one = Resharding(resharding.src, KVLayout.from_spec(spec(1, 1), "m"))
    assert into_one.pieces(0) == [
        Piece(0, slice(0, 2), slice(0, 2)),
        Piece(1, slice(0, 1), slice(2, 3)),
    ]


@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2), (2, 3), (3, 1)])
def test_resharded_transfer_lands_the_receivers_layout(
    backend: str, src_tp: int, dst_tp: int
) -> None:
    full = torch.randn(LAYERS, 2, 16, BLOCK, HEADS, HEAD_DIM)
    source = sharded(full, src_tp)
    released: list[str] = []
    receiver = create_receiver(
        backend, spec(dst_tp, 20), model_id="m", release=released.append, options=OPTIONS
    )
    sender = create_sender(
        backend, spec(src_tp, 16), model_id="m", release=released.append, options=OPTIONS
    )
    try:
        src_ids, dst_ids = [5, 6, 2], [11, 3, 7]
        ticket = receiver.open_ticket("r", dst_ids, 20.0)
        assert ticket.layout.tensor_parallel_size == dst_tp
        sender.connect(ticket, 10.0)
        resharding = Resharding(sender.layout, ticket.layout)
        rows = np.arange(len(src_ids))
        for layer in range(LAYERS):
            for item, k, v in resharding.items(source, layer, np.asarray(src_ids)):
                sender.send_layer(ticket, item, k, v, rows)
        sender.finish(ticket)
        assert sender.wait("r", 10.0) is TransferState.DONE
        assert receiver.wait("r", 10.0) is TransferState.DONE
        # what a TP=dst_tp replica holding the same KV has in those blocks
        expected = sharded(full, dst_tp)
        landed = receiver.kv_cache
        for item in range(LAYERS * dst_tp):
            for got, want in (
                (landed.key_caches[item], expected.key_caches[item]),
                (landed.value_caches[item], expected.value_caches[item]),
            ):
                assert torch.equal(got[dst_ids], want[src_ids]), item
    finally:
        sender.close()
        receiver.close()
    assert released.count("r") == 1  # the sender's release (DONE keeps the receiver's)


def test_fp8_items_move_as_bytes() -> None:
    """An fp8 KV cache re-shards as it is (per-head scales follow their heads)."""
    full = torch.randn(LAYERS, 2, 6, BLOCK, HEADS, HEAD_DIM).to(torch.float8_e4m3fn)
    source, expected = sharded(full, 2), sharded(full, 1)
    resharding = Resharding(
        KVLayout.from_spec(source.spec, "m"), KVLayout.from_spec(expected.spec, "m")
    )
    ids = np.array([4, 0, 2])
    for layer in range(LAYERS):
        for item, k, v in resharding.items(source, layer, ids):
            assert k.dtype == torch.float8_e4m3fn
            assert torch.equal(
                k.view(torch.uint8), expected.key_caches[item][ids].view(torch.uint8)
            )
            assert torch.equal(
                v.view(torch.uint8), expected.value_caches[item][ids].view(torch.uint8)
            )


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_a_ticket_disagreeing_with_its_receiver_is_refused(backend: str) -> None:
    """The data path sizes rows from the receiver's WELCOME: a ticket claiming another TP
    size than the receiver that issued it never moves a byte."""
    released: list[str] = []
    receiver = create_receiver(
        backend, spec(1, 8), model_id="m", release=released.append, options=OPTIONS
    )
    sender = create_sender(
        backend, spec(2, 8), model_id="m", release=released.append, options=OPTIONS
    )
    try:
        ticket = receiver.open_ticket("x", [1, 2], 10.0)
        forged = dataclasses.replace(
            ticket, layout=dataclasses.replace(ticket.layout, tensor_parallel_size=2)
        )
        with pytest.raises(KVLayoutMismatchError, match="tensor_parallel_size"):
            sender.connect(forged, 5.0)
        assert sender.poll("x") is TransferState.FAILED
        malformed = dataclasses.replace(
            ticket, layout=dataclasses.replace(ticket.layout, tensor_parallel_size=0)
        )
        with pytest.raises(KVLayoutMismatchError, match="tensor_parallel_size"):
            sender.connect(dataclasses.replace(malformed, request_id="y"), 5.0)
        assert receiver.poll("x") is TransferState.PENDING  # nothing landed
        receiver.abort("x")
    finally:
        sender.close()
        receiver.close()
    assert sorted(released) == ["x", "x", "y"]


def test_layout_counts_items_and_slots_per_tp_size() -> None:
    ours, theirs = KVLayout.from_spec(spec(2, 4), "m"), KVLayout.from_spec(spec(1, 4), "m")
    assert ours.differences(theirs) == {}  # bridgeable: the sender re-shards
    assert (ours.num_items, theirs.num_items) == (4, 2)
    assert (ours.head_slots, theirs.head_slots) == (2, 3)
    bytes_per_block = (ours.cache_spec(1).bytes_per_block, theirs.cache_spec(1).bytes_per_block)
    assert bytes_per_block[0] == bytes_per_block[1] + 2 * LAYERS * BLOCK * HEAD_DIM * 4


class _GpuWriting(Writing):
    """A data path of a backend that moves each rank's own GPU shard (never reached)."""

    backend = "nccl"

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        raise AssertionError("a refused ticket must not connect")


def test_a_backend_that_cannot_reshard_refuses_another_tp_size() -> None:
    """nccl and cuda_ipc move each rank's own GPU shard: without per-rank endpoints a
    different TP size is a layout mismatch, found before anything moves."""
    released: list[str] = []
    receiver = create_receiver("shm", spec(1, 8), model_id="m", release=released.append)
    sender = Sender(spec(2, 8), _GpuWriting(), model_id="m", release=released.append)
    try:
        ticket = receiver.open_ticket("g", [1], 10.0)
        with pytest.raises(KVLayoutMismatchError, match="tensor_parallel_size"):
            sender.connect(ticket, 5.0)
        assert sender.poll("g") is TransferState.FAILED
    finally:
        sender.close()
        receiver.close()
    assert released.count("g") == 2  # the sender's, then the receiver's at close
