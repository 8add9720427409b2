"""Helpers of the multi-process kvtransfer tests: what spawned processes run, and handles.

Child side: a `SendJob` describes what the prefill process does with one or more tickets;
`serve` runs jobs sent over a pipe (one long-lived process for many tests),
`send_then_hang` sends some layers and then stalls so a test can kill it,
`receive_then_wait` is a decode side that a test kills. Parent side: `Peer` drives a
`serve` process, `Released` records release callbacks. Spawned children inherit the
parent's sys.path, so this module and the repo import as in the test process.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import numpy as np
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import (
    KVTransferError,
    Receiver,
    TransferOptions,
    create_receiver,
    create_sender,
)
from kvtransfer.base import Ticket
from kvtransfer.datapath import LayerItem
from kvtransfer.payload import layer_crc
from kvtransfer.rowcopy import block_rows
from kvtransfer.sender import Sender
from kvtransfer.shm import ShmWriting
from kvtransfer.table import TransferRecord
from kvtransfer.tcp import TcpWriting
from kvtransfer.wire import Connection as Link
from kvtransfer.wire import Kind

BACKENDS = ["shm", "tcp"]
FAST = TransferOptions(reap_interval_s=0.02, fence_timeout_s=3.0, connect_timeout_s=5.0)


def source_cache(spec: KVCacheSpec, seed: int) -> KVCache:
    """Deterministic random K/V (the same in every process for the same spec and seed)."""
    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(spec.flat_shape, generator=generator).to(spec.torch_dtype)
    return KVCache(spec, flat)


@dataclass(frozen=True)
class SendJob:
    backend: str
    spec: KVCacheSpec
    tickets: tuple[tuple[Ticket, tuple[int, ...]], ...]  # (ticket, source block ids)
    seed: int = 0
    model_id: str = "test-model"
    options: TransferOptions = field(default_factory=TransferOptions)
    layer_delay_s: float = 0.0  # simulated compute before each layer
    # after sending these layers, tell the parent ("held", layer) and wait for its "go"
    # (`Peer.held`, `Peer.go`): the next layer is not computed before the parent looked
    hold_after_layers: frozenset[int] | set[int] = frozenset()
    abort_after_layer: int | None = None  # sender aborts every ticket after it (-1: first)
    hang_after_layer: int | None = None  # send_then_hang: stall after this layer
    finish: bool = True
    connect_first: bool = False  # call sender.connect(ticket) first and report its error
    wait_s: float = 10.0
    device: str = "cpu"  # where the source cache lives (nccl: a CUDA device)
    corrupt_layers: frozenset[int] | set[int] = frozenset()  # damaged after their checksum


class CorruptingShmWriting(ShmWriting):
    """shm data path that damages one destination byte of `layers` after checksumming them
    (as memory corrupted between the copy and the read would be)."""

    def __init__(self, spec: KVCacheSpec, layers: frozenset[int] | set[int]) -> None:
        super().__init__(spec)
        self.layers = layers

    def write(
        self, conn: Link, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        rows = conn.state["rows"]
        assert isinstance(rows, np.ndarray)
        plan, _ = self.plan(conn, record, items[0])
        for item in items:
            assert item.k_cache is not None and item.v_cache is not None
            src_k, src_v = block_rows(item.k_cache), block_rows(item.v_cache)
            with record.write_lock:
                plan.copy(src_k, rows[item.layer, 0])
                plan.copy(src_v, rows[item.layer, 1])
            crc = layer_crc(src_k, src_v, plan.src_ids) if checksum else None
            if item.layer in self.layers:
                rows[item.layer, 0, item.ticket.block_ids[0], 0] ^= 0xFF
            epoch = item.ticket.epoch
            conn.fs.send(Kind.LAYER, record.request_id, epoch=epoch, layer=item.layer, crc=crc)


class CorruptingTcpWriting(TcpWriting):
    """tcp data path that damages the first payload byte of `layers` after checksumming."""

    def __init__(self, layers: frozenset[int] | set[int]) -> None:
        super().__init__()
        self.layers = layers

    def write(
        self, conn: Link, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        for item in items:
            parts = self.payload(record, item)
            crc = zlib.crc32(b"".join(parts)) if checksum else None
            if item.layer in self.layers:
                damaged = bytearray(b"".join(parts))
                damaged[0] ^= 0xFF
                parts = [memoryview(damaged)]
            epoch, layer = item.ticket.epoch, item.layer
            conn.fs.send(
                Kind.LAYER, record.request_id, epoch=epoch, layer=layer, crc=crc, payload=parts
            )


def make_sender(job: SendJob, released: list[str], extra: dict[str, object]) -> Sender:
    """The job's sender; with `corrupt_layers`, one whose data path damages them."""
    if not job.corrupt_layers:
        return create_sender(
            job.backend,
            job.spec,
            model_id=job.model_id,
            release=released.append,
            options=job.options,
            **extra,  # type: ignore[arg-type]
        )
    writing: ShmWriting | TcpWriting = (
        CorruptingShmWriting(job.spec, job.corrupt_layers)
        if job.backend == "shm"
        else CorruptingTcpWriting(job.corrupt_layers)
    )
    return Sender(
        job.spec, writing, model_id=job.model_id, release=released.append, options=job.options
    )


def run_job(job: SendJob, conn: Connection | None = None) -> dict[str, object]:
    """Do the job; report per-ticket final states, errors and releases. Holds
    (`hold_after_layers`) talk to the parent over `conn`."""
    released: list[str] = []
    cache = source_cache(job.spec, job.seed)
    extra: dict[str, object] = {}
    if job.device != "cpu":
        cache = KVCache(job.spec, cache.flat.to(job.device))
        extra["device"] = job.device
    sender = make_sender(job, released, extra)
    result: dict[str, object] = {"pid": os.getpid()}
    try:
        if job.connect_first:
            try:
                sender.connect(job.tickets[0][0], 5.0)
                result["connect_error"] = None
            except KVTransferError as exc:
                result["connect_error"] = (type(exc).__name__, str(exc))
        if job.abort_after_layer == -1:  # before any layer (after connect, if asked)
            for ticket, _ in job.tickets:
                sender.abort(ticket.request_id)
        for layer in range(job.spec.num_layers):
            if job.layer_delay_s:
                time.sleep(job.layer_delay_s)
            for ticket, src_ids in job.tickets:
                k, v = cache.key_caches[layer], cache.value_caches[layer]
                sender.send_layer(ticket, layer, k, v, list(src_ids))
            if job.abort_after_layer == layer:
                for ticket, _ in job.tickets:
                    sender.abort(ticket.request_id)
            if layer in job.hold_after_layers:
                assert conn is not None, "a job with holds runs under `serve`"
                conn.send(("held", layer))
                assert conn.recv() == "go"
        if job.finish:
            for ticket, _ in job.tickets:
                sender.finish(ticket)
        states, errors = {}, {}
        for ticket, _ in job.tickets:
            rid = ticket.request_id
            states[rid] = sender.wait(rid, job.wait_s).value
            error = sender.error(rid)
            errors[rid] = None if error is None else (type(error).__name__, str(error))
        deadline = time.monotonic() + job.wait_s
        while len(released) < len(job.tickets) and time.monotonic() < deadline:
            time.sleep(0.005)
        result.update(states=states, errors=errors)
    finally:
        sender.close()
    result["released"] = list(released)
    return result


def serve(conn: Connection) -> None:
    """Run jobs from `conn` until None arrives."""
    while (job := conn.recv()) is not None:
        try:
            conn.send(run_job(job, conn))
        except Exception as exc:  # report, keep serving
            conn.send({"exception": repr(exc)})


def send_then_hang(job: SendJob, conn: Connection) -> None:
    """Send layers up to `hang_after_layer`, say so, then stall until killed."""
    cache = source_cache(job.spec, job.seed)
    sender = create_sender(
        job.backend, job.spec, model_id=job.model_id, release=lambda rid: None, options=job.options
    )
    assert job.hang_after_layer is not None
    for layer in range(job.hang_after_layer + 1):
        for ticket, src_ids in job.tickets:
            k, v = cache.key_caches[layer], cache.value_caches[layer]
            sender.send_layer(ticket, layer, k, v, list(src_ids))
    conn.send("hanging")
    time.sleep(600)


def receive_then_wait(
    backend: str, spec: KVCacheSpec, block_ids: tuple[int, ...], conn: Connection
) -> None:
    """Decode side in a child: open one ticket, hand it over, then idle until killed."""
    from kvtransfer import create_receiver

    receiver = create_receiver(backend, spec, model_id="test-model", release=lambda rid: None)
    conn.send(receiver.open_ticket("victim", block_ids, 60.0))
    time.sleep(600)


# ---------------------------------------------------------------------------------------
# parent side


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

    def held(self, timeout_s: float = 30.0) -> int:
        """The layer after which the running job holds (`SendJob.hold_after_layers`)."""
        assert self._pending
        if not self.conn.poll(timeout_s):
            raise TimeoutError("prefill process did not reach its hold")
        message = self.conn.recv()
        assert isinstance(message, tuple) and message[0] == "held", message
        return int(message[1])

    def go(self) -> None:
        """Let a held job compute its next layer."""
        self.conn.send("go")

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


class Released:
    """A thread-safe release callback that remembers what it freed."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, request_id: str) -> None:
        with self._lock:
            self.ids.append(request_id)

    def wait_for(self, request_id: str, timeout_s: float = 10.0) -> bool:
        return eventually(lambda: request_id in self.ids, timeout_s)


def eventually(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def make_receiver(backend: str, s: KVCacheSpec, released: Released, **endpoint: object) -> Receiver:
    return create_receiver(
        backend, s, model_id="test-model", release=released, options=FAST, **endpoint
    )


def layers_landed(receiver: Receiver, request_id: str) -> int:
    """How many layers of a transfer have landed (its record in the receiver's table)."""
    return receiver._table.require(request_id).num_layers_done


def random_ids(rng: np.random.Generator, num_blocks: int, n: int) -> tuple[int, ...]:
    return tuple(int(b) for b in rng.choice(num_blocks, size=n, replace=False))


def assert_landed(
    receiver: Receiver,
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


def reap(process: BaseProcess, conn: Connection) -> None:
    if process.is_alive():
        process.kill()
    process.join(timeout=10)
    conn.close()
