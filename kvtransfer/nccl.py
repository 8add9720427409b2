"""`nccl`: GPU-to-GPU transfer; control frames over TCP, block bytes over NCCL.

Per (prefill, decode) pair one two-rank communicator (receiver rank 0, sender rank 1) is
created lazily on the first connection and cached: the receiver puts a fresh NCCL unique
id in its WELCOME frame, both ends call `ncclCommInitRank`, and the communicator lives as
long as the control connection (aborted with `ncclCommAbort` when it drops, so a dead peer
never leaves a stream hanging).

Per layer the sender waits (on a side stream) for the event recorded when `send_layer`
was called, packs the request's blocks into a contiguous buffer (`kernels.kv_pack`),
sends a LAYER control frame carrying the byte count, then `ncclSend`s the buffer inside
`ncclGroupStart/End`. The receiver, reading frames in order, posts the matching
`ncclRecv` into a staging buffer on its side stream and unpacks it into the destination
blocks on the same stream; FINISH synchronizes that stream before DONE. NCCL cannot join
two ranks on one GPU, so the pair needs two devices (two GPUs, or two hosts).
"""

from __future__ import annotations

import socket
import struct
import threading
import zlib
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import (
    BackendUnavailableError,
    ChecksumMismatchError,
    PeerLostError,
    ProtocolError,
    ReleaseFn,
    TransferOptions,
)
from kvtransfer.connections import LayerItem, ReceiverConnection, SenderConnection
from kvtransfer.stream_receiver import StreamReceiver
from kvtransfer.stream_sender import StreamSender
from kvtransfer.table import TransferRecord
from kvtransfer.tcp import connect_tcp, listen_advertised
from kvtransfer.wire import Header, Kind

RECEIVER_RANK, SENDER_RANK = 0, 1
_SIZE = struct.Struct("<Q")  # a nccl LAYER frame's socket payload: the NCCL byte count

T = TypeVar("T")


class CommunicatorCache(Generic[T]):
    """One communicator per peer key, created on first use (once, even under races)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, T] = {}
        self._creating: dict[str, threading.Lock] = {}

    def get_or_create(self, key: str, create: Callable[[], T]) -> T:
        with self._lock:
            if key in self._items:
                return self._items[key]
            key_lock = self._creating.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._items:
                    return self._items[key]
            item = create()
            with self._lock:
                self._items[key] = item
                self._creating.pop(key, None)
            return item

    def pop(self, key: str) -> T | None:
        with self._lock:
            return self._items.pop(key, None)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)


def require_cuda(device: torch.device) -> None:
    """Raise BackendUnavailableError unless `device` is a usable CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"the nccl backend needs a CUDA device (got {device}, "
            f"torch.cuda.is_available()={torch.cuda.is_available()}); use shm or tcp on CPU"
        )


class _NcclEnd:
    """The NCCL state both ends hold: the library, one communicator per peer, a side stream."""

    device: torch.device

    def _init_nccl(self, device: torch.device) -> None:
        """Called first by both constructors: fails fast without CUDA, then loads libnccl."""
        self.device = device
        require_cuda(device)
        from kvtransfer.nccl_lib import load_nccl

        self._nccl = load_nccl()
        self._comms: CommunicatorCache[int] = CommunicatorCache()
        self._stream = torch.cuda.Stream(device)

    def _abort_comm(self, key: str) -> None:
        """Called when the peer's connection drops or is replaced: abort its communicator
        (`ncclCommAbort` frees it and fails anything still queued on it); no-op if none."""
        comm = self._comms.pop(key)
        if comm is not None:
            self._nccl.comm_abort(comm)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class NcclReceiver(_NcclEnd, StreamReceiver):
    """Decode side on a GPU; see the module docstring."""

    backend = "nccl"

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
        device: str | torch.device | None = None,
        epoch: int | None = None,
    ) -> None:
        self._init_nccl(kv_cache.flat.device if kv_cache is not None else _resolve_device(device))
        listener, self._advertised = listen_advertised(host, port, advertise_host)
        cache = kv_cache if kv_cache is not None else KVCache.allocate(spec, self.device)
        super().__init__(
            spec,
            cache,
            model_id=model_id,
            release=release,
            options=options,
            listener=listener,
            epoch=epoch,
        )

    @property
    def endpoint(self) -> str:
        host, port = self._advertised
        return f"nccl://{host}:{port}"

    def _welcome_extra(self, conn: SenderConnection) -> dict[str, object]:
        unique_id = self._nccl.unique_id()
        conn.state["unique_id"] = unique_id
        return {"nccl_unique_id": unique_id.hex(), "nccl_version": self._nccl.version()}

    def _on_connected(self, conn: SenderConnection, hello: dict[str, object]) -> None:
        unique_id = conn.state["unique_id"]
        assert isinstance(unique_id, bytes)
        with torch.cuda.device(self.device):
            self._comms.get_or_create(
                conn.name, lambda: self._nccl.comm_init_rank(2, unique_id, RECEIVER_RANK)
            )

    def _recv_into(self, conn: SenderConnection, nbytes: int) -> torch.Tensor:
        staging = conn.state.get("staging")
        if not isinstance(staging, torch.Tensor) or staging.numel() < nbytes:
            staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            conn.state["staging"] = staging
        buf = staging[:nbytes]
        comm = self._comms.get_or_create(conn.name, _no_comm)
        with torch.cuda.stream(self._stream):
            self._nccl.group_start()
            self._nccl.recv(buf.data_ptr(), nbytes, SENDER_RANK, comm, self._stream.cuda_stream)
            self._nccl.group_end()
        return buf

    def _layer_payload_bytes(self, num_blocks: int) -> int:
        return _SIZE.size  # the NCCL byte count; the bytes themselves go over NCCL

    def _receive_layer(
        self, conn: SenderConnection, record: TransferRecord, header: Header
    ) -> None:
        n = len(record.block_ids)
        expected = _packed_bytes(self.spec, n)
        # a wrong size would desynchronize the NCCL queue: a protocol error, not a skip
        nbytes = _read_size(conn, limit=expected, exact=True)
        buf = self._recv_into(conn, nbytes)
        packed = _packed_view(buf, self.spec, n)
        if header.has_crc:
            self._stream.synchronize()
            crc = _crc(buf)
            if crc != header.crc:
                raise ChecksumMismatchError(f"layer {header.layer}: crc32 {crc:#010x} mismatch")
        from kernels.kv_pack import unpack_kv_blocks

        ids = record.memo(
            "dst_ids",
            torch.Tensor,
            lambda: torch.tensor(record.block_ids, dtype=torch.int64, device=self.device),
        )
        with record.write_lock, torch.cuda.stream(self._stream):
            if record.state.is_terminal:
                return
            layer = header.layer
            unpack_kv_blocks(
                packed, self.kv_cache.key_caches[layer], self.kv_cache.value_caches[layer], ids
            )

    def _skip_layer(self, conn: SenderConnection, header: Header) -> None:
        if header.nbytes != _SIZE.size:
            raise ProtocolError(f"nccl LAYER frame with {header.nbytes} payload bytes")
        record = self._table.get(header.request_id)
        n = self.spec.num_blocks if record is None else len(record.block_ids)
        nbytes = _read_size(conn, limit=_packed_bytes(self.spec, n), exact=record is not None)
        self._recv_into(conn, nbytes)  # keep NCCL's queues matched

    def _before_done(self, conn: SenderConnection, record: TransferRecord) -> None:
        self._stream.synchronize()

    def _release_barrier(self, record: TransferRecord) -> None:
        """Before failed blocks return to the pool: unpacks already queued on the side
        stream must have landed, or they would write into blocks the engine reuses."""
        self._stream.synchronize()

    def _on_disconnected(self, conn: SenderConnection) -> None:
        self._abort_comm(conn.name)


class NcclSender(_NcclEnd, StreamSender):
    """Prefill side on a GPU; see the module docstring."""

    backend = "nccl"

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
        device: str | torch.device | None = None,
    ) -> None:
        self._init_nccl(_resolve_device(device))
        self._buffers: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._next_buffer = 0
        super().__init__(spec, model_id=model_id, release=release, options=options)

    def _open_socket(self, endpoint: str, timeout_s: float) -> socket.socket:
        return connect_tcp(endpoint, timeout_s, scheme="nccl")

    def _on_welcome(self, conn: ReceiverConnection) -> None:
        raw = conn.welcome.get("nccl_unique_id")
        if not isinstance(raw, str):
            raise PeerLostError(f"receiver at {conn.endpoint} sent no NCCL unique id")
        try:
            unique_id = bytes.fromhex(raw)
        except ValueError:
            raise PeerLostError(f"receiver at {conn.endpoint} sent a malformed unique id") from None
        with torch.cuda.device(self.device):
            comm = self._nccl.comm_init_rank(2, unique_id, SENDER_RANK)
        self._abort_comm(conn.endpoint)
        self._comms.get_or_create(conn.endpoint, lambda: comm)

    def _item_ready(self, k_cache: torch.Tensor) -> object | None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(k_cache.device))
        return event

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """Next buffer of a ring of two, once its previous send completed."""
        if len(self._buffers) < 2:
            self._buffers.append(
                (torch.empty(0, dtype=torch.uint8, device=self.device), torch.cuda.Event())
            )
        slot = self._next_buffer % len(self._buffers)
        self._next_buffer += 1
        buf, done = self._buffers[slot]
        done.synchronize()
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[slot] = (buf, done)
        return buf[:nbytes]

    def _write_layer(
        self, conn: ReceiverConnection, record: TransferRecord, item: LayerItem
    ) -> None:
        assert item.k_cache is not None and item.v_cache is not None and item.src_ids is not None
        from kernels.kv_pack import pack_kv_blocks

        n = len(item.src_ids)
        nbytes = _packed_bytes(self.spec, n)
        buf = self._buffer(nbytes)
        packed = _packed_view(buf, self.spec, n)
        ids = torch.from_numpy(item.src_ids).to(self.device, non_blocking=True)
        comm = self._comms.get_or_create(conn.endpoint, _no_comm)
        with torch.cuda.stream(self._stream):
            if isinstance(item.ready, torch.cuda.Event):
                self._stream.wait_event(item.ready)
            pack_kv_blocks(item.k_cache, item.v_cache, ids, out=packed)
            crc = _crc(buf) if self.checksum else None
            if item.layer in self.corrupt_layers:
                buf[:1].bitwise_xor_(0xFF)
            if record.state.is_terminal:
                return
            conn.fs.send(
                Kind.LAYER,
                record.request_id,
                epoch=item.ticket.epoch,
                layer=item.layer,
                crc=crc,
                payload=(_SIZE.pack(nbytes),),
            )
            self._nccl.group_start()
            self._nccl.send(buf.data_ptr(), nbytes, RECEIVER_RANK, comm, self._stream.cuda_stream)
            self._nccl.group_end()
            self._buffers[(self._next_buffer - 1) % len(self._buffers)][1].record(self._stream)

    def _on_disconnected(self, conn: ReceiverConnection) -> None:
        self._abort_comm(conn.endpoint)


def _packed_bytes(spec: KVCacheSpec, n: int) -> int:
    """Bytes of `n` blocks of one layer packed by `kv_pack`: all K blocks, then all V."""
    return 2 * n * spec.bytes_per_block_per_layer


def _packed_view(buf: torch.Tensor, spec: KVCacheSpec, n: int) -> torch.Tensor:
    """`buf` (uint8, `_packed_bytes` long) seen as `kv_pack`'s `[2, n, *block_shape]`."""
    return buf.view(spec.torch_dtype).view(2, n, *spec.block_shape)


def _crc(buf: torch.Tensor) -> int:
    """CRC32 of a packed layer, copied to the host (only with `checksum`, it syncs)."""
    return zlib.crc32(buf.cpu().numpy().data)


def _read_size(conn: SenderConnection, *, limit: int, exact: bool) -> int:
    """The NCCL byte count a LAYER frame announces (its payload size was checked already):
    `limit` exactly, or (`exact=False`) at most `limit`, else a protocol error."""
    raw = bytearray(_SIZE.size)
    conn.fs.recv_into(memoryview(raw))
    nbytes = int(_SIZE.unpack(raw)[0])
    if nbytes > limit or (exact and nbytes != limit):
        raise ProtocolError(f"nccl layer of {nbytes} bytes, expected {limit}")
    return nbytes


def _no_comm() -> int:
    raise PeerLostError("no NCCL communicator for this connection")
