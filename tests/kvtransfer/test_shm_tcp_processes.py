"""shm and tcp between two real OS processes: this one decodes, a spawned one prefills."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import numpy as np
import pytest
import torch
from kvt_peers import SendJob, receive_then_wait, send_then_hang, serve, source_cache

from engine.kv_cache import KVCacheSpec
from kvtransfer import (
    KVReceiver,
    TransferOptions,
    TransferState,
    create_receiver,
    create_sender,
)
from kvtransfer.base import KVLayout
from kvtransfer.shm import list_segments

BACKENDS = ["shm", "tcp"]
FAST = TransferOptions(reap_interval_s=0.02, fence_timeout_s=3.0, connect_timeout_s=5.0)
pytestmark = pytest.mark.timeout(60)


def spec(
    num_layers: int = 3, num_blocks: int = 64, dtype: str = "float32", **kw: int
) -> KVCacheSpec:
    geometry = {"block_size": 4, "num_kv_heads": 2, "head_dim": 8} | kw
    return KVCacheSpec(num_layers=num_layers, num_blocks=num_blocks, dtype=dtype, **geometry)


class Peer:
    """A long-lived prefill process that runs `SendJob`s."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process: BaseProcess = ctx.Process(target=serve, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self._pending = False

    def start(self, job: SendJob) -> None:
        assert not self._pending
        self.conn.send(job)
        self._pending = True

    def result(self, timeout_s: float = 30.0) -> dict[str, object]:
        assert self._pending
        if not self.conn.poll(timeout_s):
            raise TimeoutError("prefill process did not report")
        self._pending = False
        result = self.conn.recv()
        assert "exception" not in result, result
        return result

    def run(self, job: SendJob) -> dict[str, object]:
        self.start(job)
        return self.result()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.close()


class Released:
    """A thread-safe release callback that remembers what it freed."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, request_id: str) -> None:
        with self._lock:
            self.ids.append(request_id)

    def wait_for(self, request_id: str, timeout_s: float = 10.0) -> bool:
        return _eventually(lambda: request_id in self.ids, timeout_s)


def _eventually(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_receiver(
    backend: str, s: KVCacheSpec, released: Released, **endpoint: object
) -> KVReceiver:
    return create_receiver(
        backend, s, model_id="test-model", release=released, options=FAST, **endpoint
    )


def random_ids(rng: np.random.Generator, num_blocks: int, n: int) -> tuple[int, ...]:
    return tuple(int(b) for b in rng.choice(num_blocks, size=n, replace=False))


def assert_landed(
    receiver: KVReceiver,
    src_spec: KVCacheSpec,
    seed: int,
    dst: tuple[int, ...],
    src: tuple[int, ...],
) -> None:
    source = source_cache(src_spec, seed)
    cache = receiver.kv_cache
    for layer in range(src_spec.num_layers):
        assert torch.equal(cache.key_caches[layer][list(dst)], source.key_caches[layer][list(src)])
        assert torch.equal(
            cache.value_caches[layer][list(dst)], source.value_caches[layer][list(src)]
        )


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_layers", [1, 4])
def test_destination_blocks_equal_source_blocks(
    peer: Peer, backend: str, dtype: str, num_layers: int
) -> None:
    rng = np.random.default_rng(num_layers * 7 + len(dtype))
    released = Released()
    dst_spec, src_spec = spec(num_layers, 64, dtype), spec(num_layers, 48, dtype)
    with make_receiver(backend, dst_spec, released) as receiver:
        jobs, free = [], [int(b) for b in rng.permutation(64)]
        for i, n in enumerate((5, 17, 1)):  # three requests interleaved on one connection
            dst, free = tuple(free[:n]), free[n:]
            jobs.append((receiver.open_ticket(f"r{i}", dst, 20.0), random_ids(rng, 48, n)))
        result = peer.run(SendJob(backend, src_spec, tuple(jobs), seed=3, options=FAST))
        assert result["states"] == {t.request_id: "done" for t, _ in jobs}
        for ticket, src in jobs:
            assert receiver.wait(ticket.request_id, 5.0) is TransferState.DONE
            assert receiver.num_layers_received(ticket.request_id) == num_layers
            assert_landed(receiver, src_spec, 3, ticket.block_ids, src)
        touched = {b for t, _ in jobs for b in t.block_ids}
        untouched = [b for b in range(64) if b not in touched]
        assert not receiver.kv_cache.flat[:, :, untouched].any()
        assert released.ids == []  # DONE keeps the destination blocks
        assert sorted(result["released"]) == ["r0", "r1", "r2"]  # sources freed once each


def test_checksums_pass_on_clean_data(peer: Peer, backend: str) -> None:
    released = Released()
    s = spec(2, 32, "bfloat16")
    with make_receiver(backend, s, released) as receiver:
        ticket = receiver.open_ticket("c", (3, 4, 5, 9), 20.0)
        options = dataclasses.replace(FAST, checksum=True)
        result = peer.run(SendJob(backend, s, ((ticket, (0, 1, 2, 3)),), seed=5, options=options))
        assert result["states"] == {"c": "done"}
        assert_landed(receiver, s, 5, ticket.block_ids, (0, 1, 2, 3))


def test_checksum_mismatch_fails_and_frees_both(peer: Peer, backend: str) -> None:
    released = Released()
    s = spec(3)
    with make_receiver(backend, s, released) as receiver:
        ticket = receiver.open_ticket("bad", (7, 2, 11), 20.0)
        options = dataclasses.replace(FAST, checksum=True, corrupt_layers=frozenset({1}))
        result = peer.run(SendJob(backend, s, ((ticket, (1, 2, 3)),), options=options))
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
    released = Released()
    endpoint: dict[str, object] = {"name": f"restart-{os.getpid()}"} if backend == "shm" else {}
    first = make_receiver(backend, spec(2), released, **endpoint)
    old = first.open_ticket("o", (1, 2), 20.0)
    first.close()
    if backend == "tcp":
        endpoint = {"port": int(old.endpoint.rsplit(":", 1)[1])}
    with make_receiver(backend, spec(2), released, **endpoint) as second:
        assert second.endpoint == old.endpoint and second.epoch != old.epoch
        fresh = second.open_ticket("o", (1, 2), 20.0)
        result = peer.run(SendJob(backend, spec(2), ((old, (0, 1)),)))
        assert result["errors"]["o"][0] == "StaleEpochError"
        assert second.poll("o") is TransferState.PENDING
        result = peer.run(SendJob(backend, spec(2), ((fresh, (0, 1)),), options=FAST))
        assert result["states"] == {"o": "done"}


def test_abort_from_decode_side_frees_both(peer: Peer, backend: str) -> None:
    released = Released()
    s = spec(6)
    with make_receiver(backend, s, released) as receiver:
        ticket = receiver.open_ticket("a", (9, 3, 30), 20.0)
        peer.start(SendJob(backend, s, ((ticket, (0, 1, 2)),), layer_delay_s=0.1, options=FAST))
        assert _eventually(lambda: receiver.num_layers_received("a") >= 2, 10.0)
        receiver.abort("a")
        receiver.abort("a")  # idempotent
        assert receiver.poll("a") is TransferState.ABORTED
        assert released.wait_for("a")
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
            assert _eventually(lambda: receiver.num_layers_received("k") >= 1, 10.0)
            assert process.pid is not None
            os.kill(process.pid, signal.SIGKILL)
            state = receiver.wait("k", 10.0)
            assert state in (TransferState.FAILED, TransferState.EXPIRED)
            assert released.wait_for("k")
        finally:
            _reap(process, parent)
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
        assert _eventually(lambda: sender.poll("victim") is TransferState.TRANSFERRING, 10.0)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        assert sender.wait("victim", 10.0) is TransferState.FAILED
        assert type(sender.error("victim")).__name__ == "PeerLostError"
        assert released.wait_for("victim")
    finally:
        _reap(process, parent)
        sender.close()
        if backend == "shm":  # the dead owner could not unlink its segment: do it for it
            from multiprocessing.shared_memory import SharedMemory

            for name in set(list_segments()) - segments_before:
                SharedMemory(name=name).unlink()
    assert released.ids == ["victim"]


def test_first_layer_arrives_while_later_layers_compute(peer: Peer, backend: str) -> None:
    released = Released()
    s = spec(8, 256, block_size=16, num_kv_heads=4, head_dim=64)
    with make_receiver(backend, s, released) as receiver:
        dst = tuple(range(0, 200, 2))
        ticket = receiver.open_ticket("o", dst, 30.0)
        peer.start(
            SendJob(backend, s, ((ticket, tuple(range(100))),), layer_delay_s=0.05, options=FAST)
        )
        assert _eventually(lambda: receiver.num_layers_received("o") >= 1, 20.0)
        first_arrival = time.perf_counter()
        assert receiver.wait("o", 20.0) is TransferState.DONE
        done = time.perf_counter()
        result = peer.result()
        t_first_send = float(result["t_first_send"])
        t_last_computed = float(result["t_last_computed"])
        compute = t_last_computed - t_first_send
        assert first_arrival < t_last_computed  # streaming: layer 0 landed mid-compute
        assert done - t_last_computed < compute  # the handover is far shorter than prefill


def test_segments_are_unlinked_on_close() -> None:
    before = set(list_segments())
    receiver = make_receiver("shm", spec(2), Released())
    segment = receiver.endpoint.removeprefix("shm://")
    assert segment in list_segments()
    receiver.close()
    receiver.close()
    assert set(list_segments()) <= before


def _reap(process: BaseProcess, conn: Connection) -> None:
    if process.is_alive():
        process.kill()
    process.join(timeout=10)
    conn.close()


def test_orphaned_segments_of_dead_owners_are_swept() -> None:
    ctx = mp.get_context("spawn")
    gone = ctx.Process(target=time.sleep, args=(0,))
    gone.start()
    gone.join(timeout=30)
    assert gone.pid is not None
    orphan = f"pdkv-{gone.pid}-deadbeef"
    with open(f"/dev/shm/{orphan}", "wb") as f:
        f.write(b"\0" * 4096)
    live = f"pdkv-{os.getpid()}-cafe0000"  # its owner (this process) is alive: kept
    with open(f"/dev/shm/{live}", "wb") as f:
        f.write(b"\0" * 4096)
    try:
        receiver = make_receiver("shm", spec(2), Released())
        receiver.close()
        assert orphan not in list_segments()
        assert live in list_segments()
    finally:
        for name in (orphan, live):
            if name in list_segments():
                os.unlink(f"/dev/shm/{name}")


def test_a_named_segment_in_use_is_not_taken_over() -> None:
    name = f"inuse-{os.getpid()}"
    with make_receiver("shm", spec(2), Released(), name=name) as first:
        with pytest.raises(ValueError, match="in use"):
            make_receiver("shm", spec(2), Released(), name=name)
        assert first.endpoint.endswith(name)
