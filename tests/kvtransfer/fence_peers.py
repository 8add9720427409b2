"""Child side of the fencing tests: senders that stop themselves (SIGSTOP, the whole
process) in the middle of writing layer `STOP_LAYER`, for the parent to find stopped.

`StoppingShmWriting` copies a batch of layers block by block under the record's write_lock,
as `ShmWriting` does in one native call, and stops after the first block of that layer;
`StoppingTcpWriting` sends each LAYER frame's payload in pieces and stops after the first
piece of that layer. Stopping itself, rather than being stopped by the parent once it saw
the layer begin, puts the stop mid-layer however late the parent runs. `progress` (a shared
int) says which layer is being written.
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
from kvt_peers import source_cache

from engine.kv_cache import KVCacheSpec
from kvtransfer import TransferOptions
from kvtransfer.base import Ticket
from kvtransfer.datapath import LayerItem
from kvtransfer.rowcopy import block_rows
from kvtransfer.sender import Sender
from kvtransfer.shm import ShmWriting
from kvtransfer.table import TransferRecord
from kvtransfer.tcp import TcpWriting
from kvtransfer.wire import _HEADER, MAGIC, Kind
from kvtransfer.wire import Connection as Link

STOP_LAYER = 1


def stop_here() -> None:
    """Stop this process (every thread) until the parent sends SIGCONT or SIGKILL. Sent to
    this thread: a signal sent to the process may be taken by another thread, and this one
    would write on until the stop reached it."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


class StoppingShmWriting(ShmWriting):
    def __init__(self, spec: KVCacheSpec, progress: ctypes.c_int) -> None:
        super().__init__(spec)
        self.progress = progress

    def write(
        self, conn: Link, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        rows = conn.state["rows"]
        assert isinstance(rows, np.ndarray)
        with record.write_lock:
            if record.state.is_terminal:
                return
            for item in items:  # one in-flight copy: the state is not checked again
                assert item.k_cache is not None and item.v_cache is not None
                assert item.src_ids is not None
                self.progress.value = item.layer
                src_k, src_v = block_rows(item.k_cache), block_rows(item.v_cache)
                pairs = zip(item.src_ids, item.ticket.block_ids, strict=True)
                for i, (src, dst) in enumerate(pairs):
                    rows[item.layer, 0, dst] = src_k[src]
                    rows[item.layer, 1, dst] = src_v[src]
                    if item.layer == STOP_LAYER and i == 0:
                        stop_here()
        for item in items:
            conn.fs.send(Kind.LAYER, record.request_id, epoch=item.ticket.epoch, layer=item.layer)


class StoppingTcpWriting(TcpWriting):
    def __init__(self, progress: ctypes.c_int) -> None:
        super().__init__()
        self.progress = progress

    def write(
        self, conn: Link, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        for item in items:
            if record.state.is_terminal:
                return
            self._write_in_pieces(conn, record, item)

    def _write_in_pieces(self, conn: Link, record: TransferRecord, item: LayerItem) -> None:
        payload = b"".join(self.payload(record, item))
        rid = record.request_id.encode()
        head = _HEADER.pack(
            MAGIC, Kind.LAYER, 0, len(rid), item.layer, item.ticket.epoch, len(payload), 0
        )
        step = -(-len(payload) // 4)
        with conn.fs._send_lock:  # the whole frame, as FrameSocket.send writes it
            conn.fs.sock.sendall(head + rid)
            self.progress.value = item.layer
            for start in range(0, len(payload), step):
                conn.fs.sock.sendall(payload[start : start + step])
                if item.layer == STOP_LAYER and start == 0:
                    stop_here()


def stopping_send(
    backend: str,
    spec: KVCacheSpec,
    src_ids: tuple[int, ...],
    options: TransferOptions,
    progress: ctypes.c_int,
    conn: Connection,
) -> None:
    """Say "ready", take a ticket, send every layer (stopping mid-`STOP_LAYER`), then report
    the sender's view."""
    writing = (
        StoppingShmWriting(spec, progress) if backend == "shm" else StoppingTcpWriting(progress)
    )
    released: list[str] = []
    sender = Sender(spec, writing, model_id="test-model", release=released.append, options=options)
    cache = source_cache(spec, 0)
    conn.send("ready")
    ticket: Ticket = conn.recv()
    try:
        sender.connect(ticket, 5.0)
        for layer in range(spec.num_layers):
            sender.send_layer(
                ticket, layer, cache.key_caches[layer], cache.value_caches[layer], list(src_ids)
            )
        sender.finish(ticket)
        state = sender.wait(ticket.request_id, 30.0)
        deadline = time.monotonic() + 10.0
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        conn.send({"state": state.value, "released": list(released)})
    finally:
        sender.close()
