"""Child side of the fencing tests: senders whose layer writes are slow enough to be stopped
halfway through (SIGSTOP) by the parent.

`SlowShmWriting` copies a batch of layers block by block under the record's write_lock, as
`ShmWriting` does in one native call, with a pause after each block; `SlowTcpWriting` sends
each LAYER frame's payload in pieces with a pause between them. `progress` (a shared int
without a lock: the process may be stopped at any instruction) says which layer is being
written, so the parent can stop the process mid-write.
"""

from __future__ import annotations

import ctypes
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

PAUSE_S = 0.15  # after each block (shm) or payload piece (tcp)


class SlowShmWriting(ShmWriting):
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
                for src, dst in zip(item.src_ids, item.ticket.block_ids, strict=True):
                    rows[item.layer, 0, dst] = src_k[src]
                    rows[item.layer, 1, dst] = src_v[src]
                    time.sleep(PAUSE_S)
        for item in items:
            conn.fs.send(Kind.LAYER, record.request_id, epoch=item.ticket.epoch, layer=item.layer)


class SlowTcpWriting(TcpWriting):
    def __init__(self, progress: ctypes.c_int) -> None:
        super().__init__()
        self.progress = progress

    def write(
        self, conn: Link, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        for item in items:
            if record.state.is_terminal:
                return
            self._write_slowly(conn, record, item)

    def _write_slowly(self, conn: Link, record: TransferRecord, item: LayerItem) -> None:
        payload = b"".join(self.payload(record, item))
        rid = record.request_id.encode()
        head = _HEADER.pack(
            MAGIC, Kind.LAYER, 0, len(rid), item.layer, item.ticket.epoch, len(payload), 0
        )
        pieces = 4
        step = -(-len(payload) // pieces)
        with conn.fs._send_lock:  # the whole frame, as FrameSocket.send writes it
            conn.fs.sock.sendall(head + rid)
            self.progress.value = item.layer
            for start in range(0, len(payload), step):
                time.sleep(PAUSE_S)
                conn.fs.sock.sendall(payload[start : start + step])


def slow_send(
    backend: str,
    spec: KVCacheSpec,
    src_ids: tuple[int, ...],
    options: TransferOptions,
    progress: ctypes.c_int,
    conn: Connection,
) -> None:
    """Say "ready", take a ticket, send every layer slowly, then report the sender's view."""
    writing = SlowShmWriting(spec, progress) if backend == "shm" else SlowTcpWriting(progress)
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
