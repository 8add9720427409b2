"""The transfer API as decode and prefill use it, on `shm` and `tcp` over loopback, in one
process: lifecycle, aborts, expiry, refusals, caller bugs, exactly-once release."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from kvt_peers import layers_landed

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import (
    BACKENDS,
    KVLayoutMismatchError,
    PeerLostError,
    Receiver,
    Sender,
    StaleEpochError,
    TransferOptions,
    TransferState,
    UnknownTransferError,
    create_receiver,
    create_sender,
)

OPTIONS = TransferOptions(reap_interval_s=0.01, fence_timeout_s=2.0)
WAIT_S = 10.0


def settled(released: list[str], n: int) -> list[str]:
    """`released` once it holds `n` ids (callbacks run on transfer threads), else as is."""
    deadline = time.monotonic() + WAIT_S
    while len(released) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.02)  # a second, wrong call would show up here
    return released


def spec(num_blocks: int, dtype: str = "float32", num_layers: int = 3) -> KVCacheSpec:
    return KVCacheSpec(num_layers, num_blocks, 4, 2, 8, dtype)


class Pair:
    def __init__(
        self,
        backend: str,
        dtype: str = "float32",
        num_layers: int = 3,
        options: TransferOptions = OPTIONS,
    ) -> None:
        self.receiver_released: list[str] = []
        self.sender_released: list[str] = []
        self.receiver: Receiver = create_receiver(
            backend,
            spec(32, dtype, num_layers),
            model_id="m",
            release=self.receiver_released.append,
            options=options,
        )
        self.sender: Sender = create_sender(
            backend,
            spec(24, dtype, num_layers),
            model_id="m",
            release=self.sender_released.append,
            options=options,
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
def pair(backend: str) -> Iterator[Pair]:
    p = Pair(backend)
    yield p
    p.sender.close()
    p.receiver.close()


def wait_layers(p: Pair, rid: str, n: int) -> int:
    deadline = time.monotonic() + WAIT_S
    while layers_landed(p.receiver, rid) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return layers_landed(p.receiver, rid)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transfer_lands_the_blocks(backend: str, dtype: str) -> None:
    p = Pair(backend, dtype)
    dst, src = [30, 2, 17, 5], [0, 9, 3, 23]
    ticket = p.receiver.open_ticket("r", dst, 10.0)
    assert p.receiver.poll("r") is TransferState.PENDING
    p.send(ticket, src, range(2))
    assert wait_layers(p, "r", 2) == 2
    assert p.receiver.poll("r") is TransferState.TRANSFERRING
    p.send(ticket, src, range(2, 3))
    p.sender.finish(ticket)
    assert p.receiver.wait("r", WAIT_S) is TransferState.DONE
    assert p.sender.wait("r", WAIT_S) is TransferState.DONE
    for layer in range(3):
        assert torch.equal(
            p.receiver.kv_cache.key_caches[layer][dst], p.source.key_caches[layer][src]
        )
        assert torch.equal(
            p.receiver.kv_cache.value_caches[layer][dst], p.source.value_caches[layer][src]
        )
    assert p.receiver_released == [] and settled(p.sender_released, 1) == ["r"]
    p.sender.close()
    p.receiver.close()


def test_block_ids_may_be_a_long_tensor(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("t", [1, 2, 3], 10.0)
    pair.send(ticket, torch.tensor([4, 5, 6]))  # type: ignore[arg-type]
    pair.sender.finish(ticket)
    assert pair.receiver.wait("t", WAIT_S) is TransferState.DONE


def test_finish_with_missing_layers_fails_and_frees_both(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("m", [1, 2], 10.0)
    pair.send(ticket, [0, 1], range(2))
    pair.sender.finish(ticket)
    assert pair.receiver.wait("m", WAIT_S) is TransferState.FAILED
    assert "layers [2]" in str(pair.receiver.error("m"))
    assert settled(pair.receiver_released, 1) == ["m"]
    assert settled(pair.sender_released, 1) == ["m"]


def test_abort_from_decode_side(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("a", [1, 2], 10.0)
    pair.send(ticket, [0, 1], range(1))
    assert wait_layers(pair, "a", 1) == 1
    pair.receiver.abort("a")
    pair.receiver.abort("a")
    pair.send(ticket, [0, 1], range(1, 3))  # ignored
    pair.sender.finish(ticket)
    assert pair.receiver.poll("a") is TransferState.ABORTED
    assert pair.sender.wait("a", WAIT_S) is TransferState.ABORTED
    assert settled(pair.receiver_released, 1) == ["a"]
    assert settled(pair.sender_released, 1) == ["a"]


@pytest.mark.parametrize("layers_before", [0, 2])
def test_abort_from_prefill_side(pair: Pair, layers_before: int) -> None:
    ticket = pair.receiver.open_ticket("p", [3, 4], 10.0)
    pair.sender.connect(ticket, 1.0)  # registers the transfer: abort reaches the receiver
    pair.send(ticket, [0, 1], range(layers_before))
    pair.sender.abort("p")
    pair.sender.abort("p")
    assert pair.receiver.wait("p", WAIT_S) is TransferState.ABORTED
    assert settled(pair.receiver_released, 1) == ["p"]
    assert settled(pair.sender_released, 1) == ["p"]


def test_abort_of_an_unknown_request_releases_once(pair: Pair) -> None:
    pair.sender.abort("never-sent")
    pair.sender.abort("never-sent")
    assert settled(pair.sender_released, 1) == ["never-sent"]
    pair.receiver.abort("never-opened")  # nothing to free, no error
    assert settled(pair.receiver_released, 0) == []


def test_deadline_expires_on_both_sides(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("e", [5], 0.05)
    pair.send(ticket, [1], range(1))
    assert pair.receiver.wait("e", WAIT_S) is TransferState.EXPIRED
    assert pair.sender.wait("e", WAIT_S) is TransferState.EXPIRED
    assert settled(pair.receiver_released, 1) == ["e"]
    assert settled(pair.sender_released, 1) == ["e"]


def test_layout_mismatch_fails_the_transfer_and_connect_raises(pair: Pair, backend: str) -> None:
    p = pair
    other = create_sender(backend, spec(24, "bfloat16"), model_id="other", release=lambda r: None)
    ticket = p.receiver.open_ticket("x", [1], 10.0)
    with pytest.raises(KVLayoutMismatchError) as info:
        other.connect(ticket, 1.0)
    assert set(info.value.differences) == {"dtype", "model_id"}
    source = KVCache.allocate(spec(24, "bfloat16"))
    released: list[str] = []
    sender = create_sender(backend, spec(24, "bfloat16"), model_id="other", release=released.append)
    sender.send_layer(ticket, 0, source.key_caches[0], source.value_caches[0], [0])
    assert sender.poll("x") is TransferState.FAILED
    assert isinstance(sender.error("x"), KVLayoutMismatchError)
    assert settled(released, 1) == ["x"]
    other.close()
    sender.close()


def test_stale_epoch_is_refused(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("s", [1], 10.0)
    stale = dataclasses.replace(ticket, epoch=ticket.epoch + 1)
    with pytest.raises(StaleEpochError):
        pair.sender.connect(stale, 1.0)
    # connect registered it: it ended FAILED, released
    assert settled(pair.sender_released, 1) == ["s"]
    pair.send(stale, [0])
    assert pair.sender.poll("s") is TransferState.FAILED
    assert isinstance(pair.sender.error("s"), StaleEpochError)
    assert pair.receiver.poll("s") is TransferState.PENDING


def test_an_unused_connection_is_kept_open_for_the_next_transfer(backend: str) -> None:
    """Pings keep the connection past the receiver's idle timeout: the next transfer needs
    no new handshake (nor, on shm, a new mapping of the receiver's cache)."""
    # Pings go every idle_timeout_s / 4 and the sender replaces a connection unpinged for
    # half the timeout: a keepalive thread late by a quarter of it (a loaded machine) would
    # count as a failure, so the timeout is long enough for that quarter to be 0.5 s.
    idle_timeout_s = 2.0
    p = Pair(backend, options=dataclasses.replace(OPTIONS, idle_timeout_s=idle_timeout_s))
    try:
        for rid in ("before", "after"):
            ticket = p.receiver.open_ticket(rid, [1, 2], 10.0)
            p.send(ticket, [3, 4])
            p.sender.finish(ticket)
            assert p.receiver.wait(rid, WAIT_S) is TransferState.DONE
            if rid == "before":
                connections = set(p.sender.connections)
                time.sleep(1.5 * idle_timeout_s)  # past the receiver's idle timeout
        assert set(p.sender.connections) == connections and len(connections) == 1
        stats = p.receiver.endpoint_stats()
        assert stats["connections"] == 1 and "idle_timeout" not in stats, stats
    finally:
        p.sender.close()
        p.receiver.close()


def test_warm_sets_up_the_connection_before_the_first_ticket(pair: Pair, backend: str) -> None:
    pair.sender.warm(pair.receiver.endpoint, WAIT_S)
    (conn,) = pair.sender.connections
    populating = conn.state.get("populating")  # shm: the receiver's cache, mapped in full
    assert (populating is not None) == (backend == "shm")
    assert populating is None or not populating.is_alive()
    ticket = pair.receiver.open_ticket("r", [1, 2], 10.0)
    pair.send(ticket, [3, 4])
    pair.sender.finish(ticket)
    assert pair.receiver.wait("r", WAIT_S) is TransferState.DONE
    assert set(pair.sender.connections) == {conn}
    nobody = {"shm": "shm://pdkv-nobody-0", "tcp": "tcp://127.0.0.1:9"}[backend]
    with pytest.raises(PeerLostError):
        pair.sender.warm(nobody, 2.0)
    pair.sender.close()  # a closed sender connects to no one
    with pytest.raises(PeerLostError, match="closed"):
        pair.sender.warm(pair.receiver.endpoint, 2.0)


def test_caller_bugs_raise_value_errors(pair: Pair) -> None:
    ticket = pair.receiver.open_ticket("b", [1, 2], 10.0)
    k, v = pair.source.key_caches[0], pair.source.value_caches[0]
    with pytest.raises(ValueError, match="layer"):
        pair.sender.send_layer(ticket, 3, k, v, [0, 1])
    with pytest.raises(ValueError, match="source blocks"):
        pair.sender.send_layer(ticket, 0, k, v, [0])
    with pytest.raises(ValueError, match="k_cache"):
        pair.sender.send_layer(ticket, 0, k[:, :1].contiguous(), v, [0, 1])
    with pytest.raises(ValueError, match="source blocks outside"):
        pair.sender.send_layer(ticket, 0, k[:3], v[:3], [0, 3])
    with pytest.raises(ValueError):
        pair.receiver.open_ticket("bad", [1, 1], 10.0)
    with pytest.raises(ValueError):
        pair.receiver.open_ticket("bad", [32], 10.0)
    with pytest.raises(ValueError):
        pair.receiver.open_ticket("b", [3], 10.0)  # still open
    with pytest.raises(UnknownTransferError):
        pair.receiver.poll("nope")


def test_close_aborts_open_transfers_and_releases_their_blocks(backend: str) -> None:
    p = Pair(backend)
    p.receiver.open_ticket("c1", [1], 10.0)
    ticket = p.receiver.open_ticket("c2", [2], 10.0)
    p.send(ticket, [0], range(1))
    assert wait_layers(p, "c2", 1) == 1
    p.sender.close()
    p.receiver.close()
    p.receiver.close()
    assert sorted(p.receiver_released) == ["c1", "c2"] and p.sender_released == ["c2"]
    with pytest.raises(RuntimeError):
        p.receiver.open_ticket("c3", [3], 10.0)


def test_factory_knows_every_backend() -> None:
    assert BACKENDS == ("cuda_ipc", "nccl", "shm", "tcp")
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        create_receiver("carrier-pigeon", spec(4), model_id="m", release=lambda r: None)
    with pytest.raises(ValueError, match="shared memory"):
        create_receiver(
            "shm", spec(4), KVCache.allocate(spec(4)), model_id="m", release=lambda r: None
        )


def test_receiver_adopts_a_given_cache() -> None:
    cache = KVCache.allocate(spec(8))
    receiver = create_receiver("tcp", spec(8), cache, model_id="m", release=lambda r: None)
    assert receiver.kv_cache is cache
    receiver.close()
    with pytest.raises(ValueError):
        create_receiver("tcp", spec(9), cache, model_id="m", release=lambda r: None)


def test_many_requests_release_exactly_once(backend: str) -> None:
    p = Pair(backend)
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
            wait_layers(p, rid, 1)
            p.receiver.abort(rid)
        elif action == 2:
            p.sender.connect(ticket, 1.0)
            p.sender.abort(rid)
        else:
            p.send(ticket, [0, 1], range(2))
            p.sender.finish(ticket)  # missing a layer
        outcomes[rid] = p.receiver.wait(rid, WAIT_S)
    freed = [r for r, s in outcomes.items() if s is not TransferState.DONE]
    assert sorted(settled(p.receiver_released, len(freed))) == sorted(freed)
    assert sorted(settled(p.sender_released, len(outcomes))) == sorted(outcomes)
    p.sender.close()
    p.receiver.close()
