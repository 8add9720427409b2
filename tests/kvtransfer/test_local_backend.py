"""The in-process `local` backend, and the behaviour every backend shares through it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import (
    KVLayoutMismatchError,
    KVReceiver,
    KVSender,
    StaleEpochError,
    TransferOptions,
    TransferState,
    UnknownTransferError,
    available_backends,
    create_receiver,
    create_sender,
)

OPTIONS = TransferOptions(reap_interval_s=0.01)


def spec(num_blocks: int, dtype: str = "float32", num_layers: int = 3) -> KVCacheSpec:
    return KVCacheSpec(num_layers, num_blocks, 4, 2, 8, dtype)


class Pair:
    def __init__(self, dtype: str = "float32", num_layers: int = 3) -> None:
        self.receiver_released: list[str] = []
        self.sender_released: list[str] = []
        self.receiver: KVReceiver = create_receiver(
            "local",
            spec(32, dtype, num_layers),
            model_id="m",
            release=self.receiver_released.append,
            options=OPTIONS,
        )
        self.sender: KVSender = create_sender(
            "local",
            spec(24, dtype, num_layers),
            model_id="m",
            release=self.sender_released.append,
            options=OPTIONS,
        )
        self.source = KVCache.allocate(spec(24, dtype, num_layers))
        self.source.flat.copy_(torch.randn(self.source.flat.shape))

    def send(self, ticket: object, src: list[int], layers: range | None = None) -> None:
        from kvtransfer.base import Ticket

        assert isinstance(ticket, Ticket)
        for layer in layers if layers is not None else range(self.source.num_layers):
            self.sender.send_layer(
                ticket, layer, self.source.key_caches[layer], self.source.value_caches[layer], src
            )


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.sender.close()
    p.receiver.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transfer_completes_instantly_and_lands_the_blocks(dtype: str) -> None:
    p = Pair(dtype)
    dst, src = [30, 2, 17, 5], [0, 9, 3, 23]
    ticket = p.receiver.open_ticket("r", dst, 10.0)
    assert p.receiver.poll("r") is TransferState.PENDING
    p.send(ticket, src, range(2))
    assert p.receiver.poll("r") is TransferState.TRANSFERRING
    assert p.receiver.num_layers_received("r") == 2
    p.send(ticket, src, range(2, 3))
    p.sender.finish(ticket)
    assert p.receiver.poll("r") is TransferState.DONE and p.sender.poll("r") is TransferState.DONE
    for layer in range(3):
        assert torch.equal(
            p.receiver.kv_cache.key_caches[layer][dst], p.source.key_caches[layer][src]
        )
        assert torch.equal(
            p.receiver.kv_cache.value_caches[layer][dst], p.source.value_caches[layer][src]
        )
    assert p.receiver_released == [] and p.sender_released == ["r"]


def test_block_ids_may_be_a_long_tensor(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("t", [1, 2, 3], 10.0)
    pair.send(ticket, torch.tensor([4, 5, 6]))  # type: ignore[arg-type]
    pair.sender.finish(ticket)
    assert pair.receiver.poll("t") is TransferState.DONE


def test_finish_with_missing_layers_fails_and_frees_both(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("m", [1, 2], 10.0)
    pair.send(ticket, [0, 1], range(2))
    pair.sender.finish(ticket)
    assert pair.receiver.poll("m") is TransferState.FAILED
    assert "layers [2]" in str(pair.receiver.error("m"))
    assert pair.receiver_released == ["m"] and pair.sender_released == ["m"]


def test_abort_from_decode_side(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("a", [1, 2], 10.0)
    pair.send(ticket, [0, 1], range(1))
    pair.receiver.abort("a")
    pair.receiver.abort("a")
    pair.send(ticket, [0, 1], range(1, 3))  # ignored
    pair.sender.finish(ticket)
    assert pair.receiver.poll("a") is TransferState.ABORTED
    assert pair.sender.poll("a") is TransferState.ABORTED
    assert pair.receiver_released == ["a"] and pair.sender_released == ["a"]


@pytest.mark.parametrize("layers_before", [0, 2])
def test_abort_from_prefill_side(pair: Pair, layers_before: int) -> None:
    ticket = pair.receiver.open_ticket("p", [3, 4], 10.0)
    pair.sender.connect(ticket, 1.0)  # registers the transfer: abort reaches the receiver
    pair.send(ticket, [0, 1], range(layers_before))
    pair.sender.abort("p")
    pair.sender.abort("p")
    assert pair.receiver.poll("p") is TransferState.ABORTED
    assert pair.receiver_released == ["p"] and pair.sender_released == ["p"]


def test_abort_of_an_unknown_request_releases_once(pair: Pair) -> None:
    pair.sender.abort("never-sent")
    pair.sender.abort("never-sent")
    assert pair.sender_released == ["never-sent"]
    pair.receiver.abort("never-opened")  # nothing to free, no error
    assert pair.receiver_released == []


def test_deadline_expires_on_both_sides(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("e", [5], 0.05)
    pair.send(ticket, [1], range(1))
    assert pair.receiver.wait("e", 2.0) is TransferState.EXPIRED
    assert pair.sender.wait("e", 2.0) is TransferState.EXPIRED
    deadline = time.monotonic() + 2.0
    while not pair.sender_released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pair.receiver_released == ["e"] and pair.sender_released == ["e"]


def test_layout_mismatch_fails_the_transfer_and_connect_raises() -> None:
    p = Pair()
    other = create_sender("local", spec(24, "bfloat16"), model_id="other", release=lambda r: None)
    ticket = p.receiver.open_ticket("x", [1], 10.0)
    with pytest.raises(KVLayoutMismatchError) as info:
        other.connect(ticket, 1.0)
    assert set(info.value.differences) == {"dtype", "model_id"}
    source = KVCache.allocate(spec(24, "bfloat16"))
    released: list[str] = []
    sender = create_sender("local", spec(24, "bfloat16"), model_id="other", release=released.append)
    sender.send_layer(ticket, 0, source.key_caches[0], source.value_caches[0], [0])
    assert sender.poll("x") is TransferState.FAILED
    assert isinstance(sender.error("x"), KVLayoutMismatchError)
    assert released == ["x"]


def test_stale_epoch_is_refused(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("s", [1], 10.0)
    stale = dataclasses.replace(ticket, epoch=ticket.epoch + 1)
    with pytest.raises(StaleEpochError):
        pair.sender.connect(stale, 1.0)
    assert pair.sender_released == ["s"]  # connect registered it: it ended FAILED, released
    pair.send(stale, [0])
    assert pair.sender.poll("s") is TransferState.FAILED
    assert isinstance(pair.sender.error("s"), StaleEpochError)
    assert pair.receiver.poll("s") is TransferState.PENDING


def test_caller_bugs_raise_value_errors(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("b", [1, 2], 10.0)
    k, v = pair.source.key_caches[0], pair.source.value_caches[0]
    with pytest.raises(ValueError, match="layer"):
        pair.sender.send_layer(ticket, 3, k, v, [0, 1])
    with pytest.raises(ValueError, match="source blocks"):
        pair.sender.send_layer(ticket, 0, k, v, [0])
    with pytest.raises(ValueError, match="k_cache"):
        pair.sender.send_layer(ticket, 0, k[:3], v, [0, 1])
    with pytest.raises(ValueError):
        pair.receiver.open_ticket("bad", [1, 1], 10.0)
    with pytest.raises(ValueError):
        pair.receiver.open_ticket("bad", [32], 10.0)
    with pytest.raises(ValueError):
        pair.receiver.open_ticket("b", [3], 10.0)  # still open
    with pytest.raises(UnknownTransferError):
        pair.receiver.poll("nope")


def test_close_aborts_open_transfers_and_releases_their_blocks() -> None:
    p = Pair()
    p.receiver.open_ticket("c1", [1], 10.0)
    ticket = p.receiver.open_ticket("c2", [2], 10.0)
    p.send(ticket, [0], range(1))
    p.sender.close()
    p.receiver.close()
    p.receiver.close()
    assert sorted(p.receiver_released) == ["c1", "c2"] and p.sender_released == ["c2"]
    with pytest.raises(RuntimeError):
        p.receiver.open_ticket("c3", [3], 10.0)


def test_factory_knows_every_backend() -> None:
    assert available_backends() == ["local", "nccl", "shm", "tcp"]
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        create_receiver("carrier-pigeon", spec(4), model_id="m", release=lambda r: None)
    with pytest.raises(ValueError, match="shared memory"):
        create_receiver(
            "shm", spec(4), KVCache.allocate(spec(4)), model_id="m", release=lambda r: None
        )


def test_receiver_adopts_a_given_cache() -> None:
    cache = KVCache.allocate(spec(8))
    receiver = create_receiver("local", spec(8), cache, model_id="m", release=lambda r: None)
    assert receiver.kv_cache is cache
    receiver.close()
    with pytest.raises(ValueError):
        create_receiver("local", spec(9), cache, model_id="m", release=lambda r: None)


def test_many_requests_release_exactly_once() -> None:
    p = Pair()
    rng = np.random.default_rng(0)
    outcomes = {}
    for i in range(40):
        rid = f"q{i}"
        dst = [int(b) for b in rng.choice(32, 2, replace=False)]
        ticket = p.receiver.open_ticket(rid, dst, 10.0)
        action = i % 4
        if action == 0:
            p.send(ticket, [0, 1])
            p.sender.finish(ticket)
        elif action == 1:
            p.send(ticket, [0, 1], range(1))
            p.receiver.abort(rid)
        elif action == 2:
            p.sender.connect(ticket, 1.0)
            p.sender.abort(rid)
        else:
            p.send(ticket, [0, 1], range(2))
            p.sender.finish(ticket)  # missing a layer
        outcomes[rid] = p.receiver.poll(rid)
    freed = [r for r, s in outcomes.items() if s is not TransferState.DONE]
    assert sorted(p.receiver_released) == sorted(freed)
    touched = [r for i, r in enumerate(outcomes)]
    assert sorted(p.sender_released) == sorted(touched)
    p.sender.close()
    p.receiver.close()
