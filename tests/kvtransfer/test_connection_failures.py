"""Failures around the connections: an accept that fails for want of file descriptors, an
abort that overtakes its BEGIN or meets a send stuck on a stalled receiver, and the order in
which a dropped connection's data path is torn down and its blocks are fenced."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import resource
import socket
import threading
from multiprocessing.connection import Connection as Pipe

import pytest
from kvt_peers import FAST, Released, eventually, make_receiver, source_cache, spec

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import KVTransferError, TransferState, create_sender
from kvtransfer.datapath import LayerItem
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender
from kvtransfer.table import TransferRecord
from kvtransfer.tcp import TcpLanding, TcpWriting, parse_endpoint
from kvtransfer.wire import Connection, FrameSocket, Kind

pytestmark = pytest.mark.timeout(60)


def accept_without_descriptors(report: Pipe) -> None:
    """Child: a peer connects while this process has no file descriptor left; once some
    are free again the receiver takes it (and later ones) as if nothing happened."""
    receiver = make_receiver("tcp", spec(2), Released())
    client = socket.socket()  # its descriptor exists before the process runs out
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hog = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        try:
            while True:
                hog.append(open("/dev/null"))  # noqa: SIM115 - held open on purpose
        except OSError:
            pass
        client.connect(parse_endpoint(receiver.endpoint))  # the accept now fails: EMFILE
        failed = eventually(lambda: receiver.endpoint_stats().get("accept_failed", 0) >= 1, 10.0)
    finally:
        for f in hog:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    client.settimeout(10.0)
    challenge = FrameSocket(client, 10.0).recv_header()  # accepted once descriptors are back
    report.send(
        {
            "accept_failed": failed,
            "challenged": challenge is not None and challenge.kind is Kind.CHALLENGE,
            "problem": receiver.serving_problem(),
        }
    )
    client.close()
    receiver.close()


def test_the_accept_thread_outlives_running_out_of_file_descriptors() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=accept_without_descriptors, args=(child,), daemon=True)
    process.start()
    try:
        assert parent.poll(45.0), "the child reported nothing"
        assert parent.recv() == {"accept_failed": True, "challenged": True, "problem": None}
    finally:
        process.join(10.0)
        if process.is_alive():
            process.kill()


def test_an_abort_that_overtakes_begin_ends_the_transfer_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill aborts between binding the transfer and sending BEGIN: the ABORT reaches the
    receiver first, names the ticket's epoch, and ends the transfer there (not its deadline)."""
    released, sender_released = Released(), Released()
    with make_receiver("tcp", spec(2), released) as receiver:
        sender = create_sender(
            "tcp", spec(2), model_id="test-model", release=sender_released, options=FAST
        )
        send = FrameSocket.send

        def abort_before_begin(
            fs: FrameSocket, kind: Kind, request_id: str = "", **kw: object
        ) -> None:
            if kind is Kind.BEGIN:
                sender.abort(request_id)
            send(fs, kind, request_id, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(FrameSocket, "send", abort_before_begin)
        ticket = receiver.open_ticket("early", (0, 1), 30.0)
        with pytest.raises(KVTransferError):
            sender.connect(ticket, 10.0)
        assert receiver.wait("early", 5.0) is TransferState.ABORTED
        assert released.wait_for("early") and sender_released.wait_for("early")
        sender.close()
    assert released.ids == ["early"] and sender_released.ids == ["early"]


class RecordingLanding(TcpLanding):
    """tcp with nccl's hazard: a fence that cannot finish until `disconnected` ran (an NCCL
    receive whose sender died completes only once its communicator is aborted)."""

    def __init__(self, kv_cache: KVCache) -> None:
        super().__init__(kv_cache, "127.0.0.1")
        self.events: list[str] = []
        self.aborted = threading.Event()

    def fence(self, record: TransferRecord) -> bool:
        self.events.append("fence" if self.aborted.wait(5.0) else "fence stuck")
        return True

    def disconnected(self, conn: Connection) -> None:
        self.events.append("disconnected")
        self.aborted.set()


def test_a_dropped_connection_tears_its_data_path_down_before_any_fence() -> None:
    s, released = spec(2), Released()
    landing = RecordingLanding(KVCache.allocate(s))
    receiver = Receiver(s, landing, model_id="test-model", release=released, options=FAST)
    sender = create_sender("tcp", s, model_id="test-model", release=Released(), options=FAST)
    try:
        ticket = receiver.open_ticket("d", (0, 1), 30.0)
        sender.connect(ticket, 10.0)
        cache = source_cache(s, 0)
        sender.send_layer(ticket, 0, cache.key_caches[0], cache.value_caches[0], (2, 3))
        assert eventually(lambda: receiver.poll("d") is TransferState.TRANSFERRING, 10.0)
        for conn in list(sender.connections):
            conn.fs.close()  # the prefill side dies mid-transfer
        assert receiver.wait("d", 10.0) is TransferState.FAILED
        assert released.wait_for("d")
        assert landing.events == ["disconnected", "fence"]
    finally:
        sender.close()
        receiver.close()


class StalledLanding(TcpLanding):
    """A receiver that stops reading in the middle of a LAYER frame until `resume` is set.
    `stalled` is set once its reader thread is blocked there (the header read, the payload
    not), so no frame after that one on the connection is read before `resume`."""

    def __init__(self, kv_cache: KVCache) -> None:
        super().__init__(kv_cache, "127.0.0.1")
        self.stalled, self.resume = threading.Event(), threading.Event()

    def land(self, conn: Connection, record: TransferRecord, header: object) -> None:
        self.stalled.set()
        self.resume.wait(120.0)  # the test sets it, in a `finally` too
        super().land(conn, record, header)  # type: ignore[arg-type]


class TrackedWriting(TcpWriting):
    """tcp's sending data path, noting when a write of layers returned."""

    def __init__(self) -> None:
        super().__init__()
        self.written = threading.Event()

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        super().write(conn, record, items, checksum)
        self.written.set()


def test_abort_returns_while_a_layer_is_stuck_on_a_stalled_receiver() -> None:
    """The sender's worker is blocked sending a layer far larger than the socket buffers;
    prefill's abort (on its event loop) must not wait for that send: the ABORT follows it
    from a thread of its own, and the receiver ends the transfer once it reads again."""
    s = KVCacheSpec(2, 300, 16, 8, 128, "float32")  # 256 blocks: 32 MiB a layer
    blocks = tuple(range(256))
    released, sender_released = Released(), Released()
    options = dataclasses.replace(FAST, io_timeout_s=40.0)
    landing, writing = StalledLanding(KVCache.allocate(s)), TrackedWriting()
    receiver = Receiver(s, landing, model_id="test-model", release=released, options=options)
    sender = Sender(s, writing, model_id="test-model", release=sender_released, options=options)
    try:
        ticket = receiver.open_ticket("stuck", blocks, 60.0)
        sender.connect(ticket, 10.0)
        cache = KVCache.allocate(s)
        sender.send_layer(ticket, 0, cache.key_caches[0], cache.value_caches[0], blocks)
        # Wait until the receiver holds the layer's header: the send is under way (the
        # payload cannot all fit in the socket buffers) and the receiver reads nothing more.
        assert landing.stalled.wait(10.0), "the layer never reached the receiver"
        aborting = threading.Thread(target=sender.abort, args=("stuck",))
        aborting.start()
        aborting.join(10.0)
        assert not aborting.is_alive(), "abort waited for a send stuck on a stalled receiver"
        assert not writing.written.is_set()  # the layer was still going out
        assert sender.poll("stuck") is TransferState.ABORTED and sender_released.ids == ["stuck"]
        # Its reader is held in `land` until `resume`: the ABORT behind the layer is unread.
        assert receiver.poll("stuck") is TransferState.TRANSFERRING and released.ids == []
        landing.resume.set()
        assert receiver.wait("stuck", 20.0) is TransferState.ABORTED
        assert released.wait_for("stuck")
    finally:
        landing.resume.set()
        sender.close()
        receiver.close()
    assert released.ids == ["stuck"] and sender_released.ids == ["stuck"]
