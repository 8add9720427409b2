"""shm and tcp failure paths across real processes: refusals, aborts, expiry, killed peers."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal

import pytest
from kvt_peers import (
    FAST,
    Peer,
    Released,
    SendJob,
    eventually,
    layers_landed,
    make_receiver,
    reap,
    receive_then_wait,
    send_then_hang,
    source_cache,
    spec,
)

from kvtransfer import TransferState, create_sender
from kvtransfer.base import KVLayout
from kvtransfer.shm import list_segments

pytestmark = pytest.mark.timeout(60)


def test_checksum_mismatch_fails_and_frees_both(peer: Peer, backend: str) -> None:
    released = Released()
    s = spec(3)
    with make_receiver(backend, s, released) as receiver:
        ticket = receiver.open_ticket("bad", (7, 2, 11), 20.0)
        options = dataclasses.replace(FAST, checksum=True)
        job = SendJob(backend, s, ((ticket, (1, 2, 3)),), options=options, corrupt_layers={1})
        result = peer.run(job)
        assert receiver.wait("bad", 5.0) is TransferState.FAILED
        assert type(receiver.error("bad")).__name__ == "ChecksumMismatchError"
        assert released.wait_for("bad")
        assert result["states"] == {"bad": "failed"}
        assert result["released"] == ["bad"]
    assert released.ids == ["bad"]


def test_mismatched_layout_is_rejected(peer: Peer, backend: str) -> None:
    released = Released()
    with make_receiver(backend, spec(3, dtype="float32"), released) as receiver:
        ticket = receiver.open_ticket("m", (1, 2), 20.0)
        other = spec(3, dtype="bfloat16", block_size=8)
        # the ticket's own layout already disagrees with the sender: refused before connecting
        result = peer.run(SendJob(backend, other, ((ticket, (0, 1)),), connect_first=True))
        assert result["connect_error"][0] == "KVLayoutMismatchError"
        assert "dtype" in result["connect_error"][1] and "block_size" in result["connect_error"][1]
        assert result["states"] == {"m": "failed"}
        assert result["errors"]["m"][0] == "KVLayoutMismatchError"
        assert result["released"] == ["m"]
        # a ticket claiming the sender's layout: the receiver's handshake refuses it
        forged = dataclasses.replace(ticket, layout=KVLayout.from_spec(other, "test-model"))
        result = peer.run(SendJob(backend, other, ((forged, (0, 1)),), connect_first=True))
        kind, message = result["connect_error"]
        assert kind == "KVLayoutMismatchError"
        assert "receiver" in message and "dtype" in message and "block_size" in message
        assert result["states"] == {"m": "failed"}
        assert receiver.poll("m") is TransferState.PENDING  # nothing was written
        receiver.abort("m")
        assert released.wait_for("m")


def test_stale_epoch_is_refused(peer: Peer, backend: str) -> None:
    released = Released()
    with make_receiver(backend, spec(2), released) as receiver:
        ticket = receiver.open_ticket("s", (4, 5), 20.0)
        stale = dataclasses.replace(ticket, epoch=ticket.epoch - 1)
        result = peer.run(SendJob(backend, spec(2), ((stale, (0, 1)),), connect_first=True))
        assert result["connect_error"][0] == "StaleEpochError"
        assert result["states"] == {"s": "failed"}
        assert result["errors"]["s"][0] == "StaleEpochError"
        assert receiver.poll("s") is TransferState.PENDING  # the live ticket is unaffected
        result = peer.run(SendJob(backend, spec(2), ((ticket, (0, 1)),), options=FAST))
        assert result["states"] == {"s": "done"}


def test_ticket_from_before_a_receiver_restart_is_refused(peer: Peer, backend: str) -> None:
    """tcp: the restarted receiver listens on the same port, and its new epoch refuses the
    old ticket; shm: it serves a new segment, which the old ticket cannot even reach."""
    released = Released()
    first = make_receiver(backend, spec(2), released)
    old = first.open_ticket("o", (1, 2), 20.0)
    first.close()
    endpoint = {"port": int(old.endpoint.rsplit(":", 1)[1])} if backend == "tcp" else {}
    with make_receiver(backend, spec(2), released, **endpoint) as second:
        assert (second.endpoint == old.endpoint) is (backend == "tcp")
        assert second.epoch != old.epoch
        fresh = second.open_ticket("o", (1, 2), 20.0)
        result = peer.run(SendJob(backend, spec(2), ((old, (0, 1)),)))
        refused = "StaleEpochError" if backend == "tcp" else "PeerLostError"
        assert result["errors"]["o"][0] == refused
        assert result["released"] == ["o"]
        assert second.poll("o") is TransferState.PENDING
        result = peer.run(SendJob(backend, spec(2), ((fresh, (0, 1)),), options=FAST))
        assert result["states"] == {"o": "done"}


def test_abort_from_decode_side_frees_both(peer: Peer, backend: str) -> None:
    released = Released()
    s = spec(6)
    with make_receiver(backend, s, released) as receiver:
        ticket = receiver.open_ticket("a", (9, 3, 30), 20.0)
        # held mid-transfer: two of three layers sent, no FINISH yet
        job = SendJob(backend, s, ((ticket, (0, 1, 2)),), hold_after_layers={1}, options=FAST)
        peer.start(job)
        assert peer.held() == 1
        assert eventually(lambda: layers_landed(receiver, "a") == 2, 10.0)
        receiver.abort("a")
        receiver.abort("a")  # idempotent
        assert receiver.poll("a") is TransferState.ABORTED
        assert released.wait_for("a")
        peer.go()  # the prefill goes on sending what nobody takes any more
        result = peer.result()
        assert result["states"] == {"a": "aborted"}
        assert result["released"] == ["a"]
    assert released.ids == ["a"]


@pytest.mark.parametrize("abort_after_layer", [-1, 1])
def test_abort_from_prefill_side_frees_both(
    peer: Peer, backend: str, abort_after_layer: int
) -> None:
    released = Released()
    s = spec(5)
    with make_receiver(backend, s, released) as receiver:
        ticket = receiver.open_ticket("p", (8, 6), 20.0)
        job = SendJob(
            backend,
            s,
            ((ticket, (2, 3)),),
            abort_after_layer=abort_after_layer,
            connect_first=True,
            options=FAST,
        )
        result = peer.run(job)
        assert result["states"] == {"p": "aborted"}
        assert result["released"] == ["p"]
        assert receiver.wait("p", 5.0) is TransferState.ABORTED
        assert released.wait_for("p")
    assert released.ids == ["p"]


def test_deadline_expires_a_stalled_transfer_on_both_sides(peer: Peer, backend: str) -> None:
    released = Released()
    s = spec(4)
    with make_receiver(backend, s, released) as receiver:
        ticket = receiver.open_ticket("e", (1, 5), 0.6)
        job = SendJob(backend, s, ((ticket, (0, 1)),), layer_delay_s=0.4, options=FAST)
        peer.start(job)
        assert receiver.wait("e", 5.0) is TransferState.EXPIRED
        assert released.wait_for("e")
        result = peer.result()
        assert result["states"] == {"e": "expired"}
        assert result["released"] == ["e"]


def test_killed_sender_fails_the_transfer_and_frees_blocks(backend: str) -> None:
    released = Released()
    s = spec(6)
    ctx = mp.get_context("spawn")
    with make_receiver(backend, s, released) as receiver:
        ticket = receiver.open_ticket("k", (2, 4, 6), 8.0)
        parent, child = ctx.Pipe()
        job = SendJob(backend, s, ((ticket, (0, 1, 2)),), hang_after_layer=1, options=FAST)
        process = ctx.Process(target=send_then_hang, args=(job, child), daemon=True)
        process.start()
        try:
            assert parent.poll(30.0) and parent.recv() == "hanging"
            assert eventually(lambda: layers_landed(receiver, "k") >= 1, 10.0)
            assert process.pid is not None
            os.kill(process.pid, signal.SIGKILL)
            state = receiver.wait("k", 10.0)
            assert state in (TransferState.FAILED, TransferState.EXPIRED)
            assert released.wait_for("k")
        finally:
            reap(process, parent)
    assert released.ids == ["k"]


def test_killed_receiver_fails_the_transfer_and_frees_source_blocks(backend: str) -> None:
    s = spec(4)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    segments_before = set(list_segments())
    process = ctx.Process(target=receive_then_wait, args=(backend, s, (3, 1), child), daemon=True)
    process.start()
    released = Released()
    sender = create_sender(backend, s, model_id="test-model", release=released, options=FAST)
    try:
        assert parent.poll(30.0)
        ticket = parent.recv()
        source = source_cache(s, 0)
        sender.send_layer(ticket, 0, source.key_caches[0], source.value_caches[0], [0, 1])
        assert eventually(lambda: sender.poll("victim") is TransferState.TRANSFERRING, 10.0)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        assert sender.wait("victim", 10.0) is TransferState.FAILED
        assert type(sender.error("victim")).__name__ == "PeerLostError"
        assert released.wait_for("victim")
    finally:
        reap(process, parent)
        sender.close()
        if backend == "shm":  # the dead owner could not unlink its segment: do it for it
            from multiprocessing.shared_memory import SharedMemory

            for name in set(list_segments()) - segments_before:
                SharedMemory(name=name).unlink()
    assert released.ids == ["victim"]
