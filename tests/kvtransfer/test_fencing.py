"""KV ownership is fenced: a sender process stopped (SIGSTOP) or killed mid-write never
writes into blocks that were released and handed to another request.

Each test runs a real sender process (`fence_peers.stopping_send`) that stops itself in the
middle of writing layer 1 and stays stopped past the ticket's deadline and the fence timeout.
The release callback plays the decode engine: it records the blocks' bytes, then hands them
to "another request" by filling them with a sentinel; the sentinel must survive everything
the sender does later.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from fence_peers import STOP_LAYER, stopping_send
from kvt_peers import FAST, eventually, reap, source_cache, spec

from engine.kv_cache import KVCacheSpec
from kvtransfer import Receiver, TransferState, create_receiver

pytestmark = pytest.mark.timeout(120)

SPEC = spec(num_layers=4, num_blocks=32)
SRC, DST = (1, 2, 3), (20, 9, 14)
OPTIONS = dataclasses.replace(FAST, fence_timeout_s=0.5)
DEADLINE_S = 5.0  # from opening the ticket: time to connect and reach layer 1, then stopped
SENTINEL = 7.0
LATER_S = 0.5  # once the fence timed out: many reaper ticks in which nothing may happen


@dataclass
class Handover:
    """The release callback: snapshot the blocks, then give them to another request."""

    receiver: Receiver | None = None
    ids: list[str] = field(default_factory=list)
    at_release: list[torch.Tensor] = field(default_factory=list)  # per layer [K/V, blocks, ...]
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, request_id: str) -> None:
        assert self.receiver is not None
        cache = self.receiver.kv_cache
        with self._lock:
            self.at_release = [layer_blocks(cache, i).clone() for i in range(SPEC.num_layers)]
            for layer in range(SPEC.num_layers):
                cache.key_caches[layer][list(DST)] = SENTINEL
                cache.value_caches[layer][list(DST)] = SENTINEL
            self.ids.append(request_id)


def layer_blocks(cache: object, layer: int) -> torch.Tensor:
    """`[2, len(DST), ...]`: the destination blocks of one layer, K then V."""
    k = cache.key_caches[layer][list(DST)]  # type: ignore[attr-defined]
    v = cache.value_caches[layer][list(DST)]  # type: ignore[attr-defined]
    return torch.stack([k, v])


def source_blocks(s: KVCacheSpec, layer: int) -> torch.Tensor:
    source = source_cache(s, 0)
    return torch.stack([source.key_caches[layer][list(SRC)], source.value_caches[layer][list(SRC)]])


def is_stopped(pid: int) -> bool:
    """The process is stopped by a signal (state T in /proc)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def all_sentinel(receiver: Receiver) -> bool:
    cache = receiver.kv_cache
    return all(bool((layer_blocks(cache, i) == SENTINEL).all()) for i in range(SPEC.num_layers))


@dataclass
class StoppedSender:
    """A sender process stopped while writing layer 1 of the ticket "t" (it stopped itself
    there: `fence_peers.stop_here`)."""

    receiver: Receiver
    handover: Handover
    process: mp.process.BaseProcess
    conn: mp.connection.Connection
    at_stop: torch.Tensor  # layer 1's destination blocks right after SIGSTOP

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid


@pytest.fixture()
def stopped(request: pytest.FixtureRequest) -> Iterator[StoppedSender]:
    backend = str(request.param)
    ctx = mp.get_context("spawn")
    handover = Handover()
    receiver = create_receiver(
        backend, SPEC, model_id="test-model", release=handover, options=OPTIONS
    )
    handover.receiver = receiver
    progress = ctx.RawValue("i", -1)
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=stopping_send, args=(backend, SPEC, SRC, OPTIONS, progress, child), daemon=True
    )
    process.start()
    try:
        assert parent.poll(60.0) and parent.recv() == "ready"
        parent.send(receiver.open_ticket("t", DST, DEADLINE_S))
        pid = process.pid
        assert pid is not None
        assert eventually(lambda: is_stopped(pid), 30.0), "it never stopped in layer 1"
        assert progress.value == STOP_LAYER
        at_stop = layer_blocks(receiver.kv_cache, STOP_LAYER).clone()
        yield StoppedSender(receiver, handover, process, parent, at_stop)
    finally:
        if process.pid is not None and process.is_alive():
            os.kill(process.pid, signal.SIGCONT)
        reap(process, parent)
        receiver.close()


def outlast_the_fence(receiver: Receiver) -> None:
    """Wait until the fence of the ended transfer timed out (its blocks quarantined: the
    writer still runs), then through many reaper ticks in which nothing may change."""

    def quarantined() -> bool:
        return receiver.transfer_counts()["num_quarantined"] == 1

    assert eventually(quarantined, 10.0), receiver.transfer_counts()
    time.sleep(LATER_S)
    assert quarantined()


@pytest.mark.parametrize("stopped", ["shm"], indirect=True)
def test_stopped_shm_sender_keeps_its_blocks_quarantined_until_it_acknowledges(
    stopped: StoppedSender,
) -> None:
    receiver, handover = stopped.receiver, stopped.handover
    assert receiver.wait("t", 30.0) is TransferState.EXPIRED
    outlast_the_fence(receiver)
    assert handover.ids == [], "released while the writer was stopped mid-copy"
    counts = receiver.transfer_counts
    assert counts()["num_quarantined"] == 1
    # the stopped copy left layer 1 unfinished in the (still reserved) blocks
    assert not torch.equal(stopped.at_stop, source_blocks(SPEC, 1))

    os.kill(stopped.pid, signal.SIGCONT)
    assert eventually(lambda: handover.ids == ["t"], 20.0)
    assert counts()["num_quarantined"] == 0
    # the copy in flight finished after SIGCONT, into the quarantined blocks only
    assert torch.equal(handover.at_release[1], source_blocks(SPEC, 1))
    assert stopped.conn.poll(30.0)
    report = stopped.conn.recv()
    assert report == {"state": "expired", "released": ["t"]}
    stopped.process.join(30.0)
    assert all_sentinel(receiver), "the sender wrote into blocks handed to another request"
    assert handover.ids == ["t"]


@pytest.mark.parametrize("stopped", ["shm"], indirect=True)
def test_killed_stopped_shm_sender_releases_its_blocks_once_dead(stopped: StoppedSender) -> None:
    receiver, handover = stopped.receiver, stopped.handover
    assert receiver.wait("t", 30.0) is TransferState.EXPIRED
    outlast_the_fence(receiver)
    assert handover.ids == [], "released while the writer was stopped mid-copy"
    counts = receiver.transfer_counts
    assert counts()["num_quarantined"] == 1
    os.kill(stopped.pid, signal.SIGKILL)  # not reaped yet: a zombie writes nothing either
    assert eventually(lambda: handover.ids == ["t"], 20.0)
    assert counts() == {"num_open": 0, "num_fenced": 0, "num_quarantined": 0}
    stopped.process.join(30.0)
    assert all_sentinel(receiver)


@pytest.mark.parametrize("stopped", ["shm"], indirect=True)
def test_connection_cut_by_the_receiver_keeps_a_live_writers_blocks(
    stopped: StoppedSender,
) -> None:
    """The receiver's side of the connection ends (a send of its failed) while the sender
    process runs: nothing says its copy stopped, so the blocks are kept until it is gone."""
    receiver, handover = stopped.receiver, stopped.handover
    for conn in list(receiver.connections):
        conn.fs.close()
    assert receiver.wait("t", 10.0) is TransferState.FAILED
    outlast_the_fence(receiver)
    assert handover.ids == [], "released while the writer was stopped mid-copy"
    assert receiver.transfer_counts()["num_quarantined"] == 1
    os.kill(stopped.pid, signal.SIGCONT)  # its copy goes on, then it sees the EOF and exits
    assert stopped.conn.poll(30.0)
    report = stopped.conn.recv()
    assert report["state"] in ("expired", "failed") and report["released"] == ["t"]
    stopped.process.join(30.0)
    assert eventually(lambda: handover.ids == ["t"], 20.0)
    assert receiver.transfer_counts() == {"num_open": 0, "num_fenced": 0, "num_quarantined": 0}
    assert all_sentinel(receiver), "the sender wrote into blocks handed to another request"


@pytest.mark.parametrize("stopped", ["tcp"], indirect=True)
def test_stopped_tcp_sender_is_cut_off_and_never_lands_later(stopped: StoppedSender) -> None:
    receiver, handover = stopped.receiver, stopped.handover
    assert receiver.wait("t", 30.0) is TransferState.EXPIRED
    # the receiving thread was mid-frame; cutting the connection stops it, then release
    assert eventually(lambda: handover.ids == ["t"], 20.0)
    counts = receiver.transfer_counts
    assert counts() == {"num_open": 0, "num_fenced": 0, "num_quarantined": 0}
    os.kill(stopped.pid, signal.SIGCONT)
    assert stopped.conn.poll(30.0)
    report = stopped.conn.recv()
    assert report["state"] in ("expired", "failed") and report["released"] == ["t"]
    stopped.process.join(30.0)
    assert all_sentinel(receiver), "bytes of the cut-off sender landed after release"
    assert handover.ids == ["t"]
