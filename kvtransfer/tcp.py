"""`tcp`: transfer across hosts; each layer travels as one frame on the control connection.

Frame payload of a LAYER: `[2 (K, V), num_blocks, bytes_per_block]`, K rows in the ticket's
block order then V rows, with an optional CRC32 of exactly those bytes. Layers stream back
to back without acknowledgement (many in flight; the kernel's socket buffers and the
receiver's thread pace them). Neither end copies in user space: the sender gathers the
source rows with `sendmsg` (one buffer per run of consecutive blocks), the receiver
scatters the payload with `recvmsg_into` straight into the destination blocks. It does so
holding the record's write_lock, and an ended transfer's blocks stay fenced until the
sender's ABORT_ACK is read after any frame in flight (see `stream_receiver`).
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Sequence

import numpy as np

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import ChecksumMismatchError, KVTransferError, ReleaseFn, TransferOptions
from kvtransfer.blockcopy import block_rows, contiguous_runs
from kvtransfer.connections import LayerItem, ReceiverConnection, SenderConnection
from kvtransfer.stream_receiver import StreamReceiver
from kvtransfer.stream_sender import StreamSender
from kvtransfer.table import TransferRecord
from kvtransfer.wire import Header, Kind


def parse_endpoint(endpoint: str, scheme: str = "tcp") -> tuple[str, int]:
    """`"tcp://host:port"` -> `(host, port)`."""
    prefix = f"{scheme}://"
    if not endpoint.startswith(prefix):
        raise ValueError(f"not a {scheme} endpoint: {endpoint!r}")
    host, _, port = endpoint.removeprefix(prefix).rpartition(":")
    return host.strip("[]"), int(port)


def listen_tcp(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port); SO_REUSEADDR so a restart can rebind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(64)
    return listener


def listen_advertised(
    host: str, port: int, advertise_host: str | None
) -> tuple[socket.socket, tuple[str, int]]:
    """Called by the tcp and nccl receivers: their listener and the `(host, port)` tickets
    name (`advertise_host` or `host`, and the port actually bound)."""
    listener = listen_tcp(host, port)
    return listener, (advertise_host or host, listener.getsockname()[1])


def connect_tcp(endpoint: str, timeout_s: float, scheme: str = "tcp") -> socket.socket:
    host, port = parse_endpoint(endpoint, scheme)
    return socket.create_connection((host, port), timeout=timeout_s)


class TcpReceiver(StreamReceiver):
    """Listens on `host:port` and lands LAYER payloads into its cache."""

    backend = "tcp"

    def __init__(
        self,
        spec: KVCacheSpec,
        kv_cache: KVCache | None = None,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        epoch: int | None = None,
    ) -> None:
        listener, self._advertised = listen_advertised(host, port, advertise_host)
        super().__init__(
            spec,
            kv_cache,
            model_id=model_id,
            release=release,
            options=options,
            listener=listener,
            epoch=epoch,
        )

    @property
    def endpoint(self) -> str:
        host, port = self._advertised
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def _layer_payload_bytes(self, num_blocks: int) -> int:
        return 2 * num_blocks * self.spec.bytes_per_block_per_layer

    def _receive_layer(
        self, conn: SenderConnection, record: TransferRecord, header: Header
    ) -> None:
        assert self._rows is not None
        n, row_bytes = len(record.block_ids), self._rows.shape[-1]
        expected = 2 * n * row_bytes
        if header.nbytes != expected:
            conn.fs.discard(header.nbytes)
            raise KVTransferError(f"layer payload of {header.nbytes} bytes, expected {expected}")
        runs = record.memo("runs", list, lambda: _id_runs(record.block_ids))
        layer = header.layer
        with record.write_lock:
            if record.state.is_terminal:
                conn.fs.discard(expected)
                return
            views = _layer_views(self._rows[layer, 0], self._rows[layer, 1], runs)
            conn.fs.recv_views(views)
            if header.has_crc:
                crc = _crc(views)
                if crc != header.crc:
                    raise ChecksumMismatchError(
                        f"layer {layer} of {record.request_id!r}: payload crc32 {crc:#010x}, "
                        f"sender computed {header.crc:#010x}"
                    )


class TcpSender(StreamSender):
    """Streams each layer as one LAYER frame to `tcp://host:port`."""

    backend = "tcp"

    def _open_socket(self, endpoint: str, timeout_s: float) -> socket.socket:
        return connect_tcp(endpoint, timeout_s)

    def _write_layer(
        self, conn: ReceiverConnection, record: TransferRecord, item: LayerItem
    ) -> None:
        assert item.k_cache is not None and item.v_cache is not None and item.src_ids is not None
        src_ids = item.src_ids
        runs = record.memo("runs", list, lambda: _id_runs(src_ids))
        parts = _layer_views(block_rows(item.k_cache), block_rows(item.v_cache), runs)
        crc = _crc(parts) if self.checksum else None
        if item.layer in self.corrupt_layers:  # test hook: damage a copy, never the cache
            damaged = bytearray(b"".join(parts))
            damaged[0] ^= 0xFF
            parts = [memoryview(damaged)]
        if record.state.is_terminal:
            return
        conn.fs.send(
            Kind.LAYER,
            record.request_id,
            epoch=item.ticket.epoch,
            layer=item.layer,
            crc=crc,
            payload=parts,
        )


def _id_runs(block_ids: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Runs of consecutive block ids as `(first id, length)`, in order."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return [(int(ids[i]), k) for i, k in contiguous_runs(ids)]


def _layer_views(
    k_rows: np.ndarray, v_rows: np.ndarray, runs: list[tuple[int, int]]
) -> list[memoryview]:
    """A layer's payload in wire order: the K views of `_run_views`, then the V views."""
    return _run_views(k_rows, runs) + _run_views(v_rows, runs)


def _run_views(rows: np.ndarray, runs: list[tuple[int, int]]) -> list[memoryview]:
    """One flat byte view per run of rows of a `[blocks, bytes]` matrix (no copies)."""
    flat, row_bytes = rows.reshape(-1).data, rows.shape[1]
    return [flat[start * row_bytes : (start + k) * row_bytes] for start, k in runs]


def _crc(views: list[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return crc
