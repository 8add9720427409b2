"""`tcp`: transfer across hosts; each layer travels as one frame on the control connection.

Frame payload of a LAYER: `[2 (K, V), num_blocks, bytes_per_block]`, K rows in the ticket's
block order then V rows, with an optional CRC32 of exactly those bytes. Layers stream back
to back without acknowledgement (many in flight; the kernel's socket buffers and the
receiver's thread pace them). The sender sends source rows in place when they form a few
contiguous runs and otherwise gathers them into one reusable buffer; the receiver reads
each payload with `recv_into` into a reusable buffer and scatters it into the destination
blocks with one `CopyPlan` per transfer, holding the record's write_lock so an abort
releases the blocks only after the layer being written landed.
"""

from __future__ import annotations

import socket
import zlib

import numpy as np

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import ntcopy
from kvtransfer.base import ChecksumMismatchError, KVTransferError, ReleaseFn, TransferOptions
from kvtransfer.blockcopy import CopyPlan, block_rows
from kvtransfer.stream_receiver import SenderConnection, StreamReceiver
from kvtransfer.stream_sender import LayerItem, ReceiverConnection, StreamSender
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
        listener = listen_tcp(host, port)
        self._advertised = (advertise_host or host, listener.getsockname()[1])
        try:
            super().__init__(
                spec,
                kv_cache if kv_cache is not None else KVCache.allocate(spec),
                model_id=model_id,
                release=release,
                options=options,
                listener=listener,
                epoch=epoch,
            )
        except BaseException:
            listener.close()
            raise

    @property
    def endpoint(self) -> str:
        host, port = self._advertised
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def _receive_layer(
        self, conn: SenderConnection, record: TransferRecord, header: Header
    ) -> None:
        assert self._rows is not None
        n, row_bytes = len(record.block_ids), self._rows.shape[-1]
        expected = 2 * n * row_bytes
        if header.nbytes != expected:
            conn.fs.discard(header.nbytes)
            raise KVTransferError(f"layer payload of {header.nbytes} bytes, expected {expected}")
        payload = conn.staging(expected)
        conn.fs.recv_into(payload.data)
        if header.has_crc:
            crc = zlib.crc32(payload.data)
            if crc != header.crc:
                raise ChecksumMismatchError(
                    f"layer {header.layer} of {record.request_id!r}: payload crc32 {crc:#010x}, "
                    f"sender computed {header.crc:#010x}"
                )
        plan = record.cache.get("plan")
        if not isinstance(plan, CopyPlan):
            plan = record.cache["plan"] = CopyPlan.build(
                np.arange(n, dtype=np.int64), np.asarray(record.block_ids), row_bytes
            )
        streaming = ntcopy.worth_streaming(self.spec.num_layers * expected)
        halves = payload.reshape(2, n, row_bytes)
        with record.write_lock:
            if record.state.is_terminal:
                return
            plan.copy(halves[0], self._rows[header.layer, 0], streaming=streaming)
            plan.copy(halves[1], self._rows[header.layer, 1], streaming=streaming)


class TcpSender(StreamSender):
    """Streams each layer as one LAYER frame to `tcp://host:port`."""

    backend = "tcp"

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
    ) -> None:
        super().__init__(spec, model_id=model_id, release=release, options=options)
        self._pack = np.empty(0, dtype=np.uint8)

    def _open_socket(self, endpoint: str, timeout_s: float) -> socket.socket:
        return connect_tcp(endpoint, timeout_s)

    def _write_layer(
        self, conn: ReceiverConnection, record: TransferRecord, item: LayerItem
    ) -> None:
        assert item.k_cache is not None and item.v_cache is not None and item.src_ids is not None
        src_k, src_v = block_rows(item.k_cache), block_rows(item.v_cache)
        n, row_bytes = len(item.src_ids), src_k.shape[1]
        plan = record.cache.get("plan")
        if not isinstance(plan, CopyPlan):
            plan = record.cache["plan"] = CopyPlan.build(
                item.src_ids, np.arange(n, dtype=np.int64), row_bytes
            )
        corrupt = item.layer in self.corrupt_layers
        if plan.kind == "slices" and not corrupt:  # a few source runs: send them in place
            parts = [rows[s : s + k].data for rows in (src_k, src_v) for s, _, k in plan.slices]
        else:
            if self._pack.nbytes < 2 * n * row_bytes:
                self._pack = np.empty(2 * n * row_bytes, dtype=np.uint8)
            packed = self._pack[: 2 * n * row_bytes].reshape(2, n, row_bytes)
            plan.copy(src_k, packed[0])
            plan.copy(src_v, packed[1])
            parts = [packed.data]
        crc = None
        if self.checksum:
            crc = 0
            for part in parts:
                crc = zlib.crc32(part, crc)
        if corrupt:
            packed[0, 0, 0] ^= 0xFF
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
