"""`nccl`: GPU-to-GPU transfer; control frames over TCP, block bytes over NCCL.

Per control connection one two-rank communicator (receiver rank 0, sender rank 1), kept in
the connection's state: the receiver puts a fresh NCCL unique id in its WELCOME frame, both
ends call `ncclCommInitRank`, and the communicator lives as long as the connection (aborted
with `ncclCommAbort` when it drops, so a dead peer never leaves a stream hanging).

Per layer the sender waits (on a side stream) for the event recorded when `send_layer`
was called, packs the request's blocks into a contiguous buffer (`kernels.kv_pack`),
sends a LAYER control frame carrying the byte count, then `ncclSend`s the buffer inside
`ncclGroupStart/End`. The receiver, reading frames in order, posts the matching
`ncclRecv` into a staging buffer on its side stream and unpacks it into the destination
blocks on the same stream; its fence (`NcclLanding.fence`) synchronizes that stream before
DONE and before the blocks of an ended transfer return to the pool. NCCL cannot join
two ranks on one GPU, so the pair needs two devices (two GPUs, or two hosts).
"""

from __future__ import annotations

import socket
import struct
import zlib

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import (
    BackendUnavailableError,
    ChecksumMismatchError,
    PeerLostError,
    ProtocolError,
)
from kvtransfer.nccl_lib import NcclLibrary, load_nccl
from kvtransfer.sender import LayerItem
from kvtransfer.table import TransferRecord
from kvtransfer.tcp import connect, listen_advertised
from kvtransfer.wire import Connection, Header, Kind

RECEIVER_RANK, SENDER_RANK = 0, 1
_SIZE = struct.Struct("<Q")  # a nccl LAYER frame's socket payload: the NCCL byte count


def require_cuda(device: torch.device) -> None:
    """Raise BackendUnavailableError unless `device` is a usable CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"the nccl backend needs a CUDA device (got {device}, "
            f"torch.cuda.is_available()={torch.cuda.is_available()}); use shm or tcp on CPU"
        )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device`, else the current CUDA device, else the CPU (which `require_cuda` refuses)."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _abort_comm(nccl: NcclLibrary, conn: Connection) -> None:
    """The connection dropped: `ncclCommAbort` frees its communicator and fails anything
    still queued on it, so a dead peer never leaves a stream hanging."""
    comm = conn.state.pop("comm", None)
    if isinstance(comm, int):
        nccl.comm_abort(comm)


class NcclLanding:
    """Receiving data path on a GPU; see the module docstring."""

    backend = "nccl"
    remote_writer = False  # this process's side stream lands every byte

    def __init__(
        self,
        kv_cache: KVCache,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        self.device = kv_cache.flat.device
        require_cuda(self.device)
        self._nccl = load_nccl()
        self._stream = torch.cuda.Stream(self.device)
        self.kv_cache = kv_cache
        self.listener, self.endpoint = listen_advertised(host, port, advertise_host, "nccl")

    def welcome(self, conn: Connection) -> dict[str, object]:
        unique_id = self._nccl.unique_id()
        conn.state["unique_id"] = unique_id
        return {"nccl_unique_id": unique_id.hex(), "nccl_version": self._nccl.version()}

    def connected(self, conn: Connection) -> None:
        """Join the pair's communicator (blocks until the sender joins too)."""
        unique_id = conn.state["unique_id"]
        assert isinstance(unique_id, bytes)
        with torch.cuda.device(self.device):
            conn.state["comm"] = self._nccl.comm_init_rank(2, unique_id, RECEIVER_RANK)

    def payload_bytes(self, num_blocks: int) -> int:
        return _SIZE.size  # the NCCL byte count; the bytes themselves go over NCCL

    def _recv(self, conn: Connection, nbytes: int) -> torch.Tensor:
        """Post the NCCL receive of `nbytes` into the connection's staging buffer."""
        staging = conn.state.get("staging")
        if not isinstance(staging, torch.Tensor) or staging.numel() < nbytes:
            staging = conn.state["staging"] = torch.empty(
                nbytes, dtype=torch.uint8, device=self.device
            )
        buf = staging[:nbytes]
        comm = conn.state.get("comm")
        if not isinstance(comm, int):
            raise PeerLostError("no NCCL communicator for this connection")
        with torch.cuda.stream(self._stream):
            self._nccl.group_start()
            self._nccl.recv(buf.data_ptr(), nbytes, SENDER_RANK, comm, self._stream.cuda_stream)
            self._nccl.group_end()
        return buf

    def land(self, conn: Connection, record: TransferRecord, header: Header) -> None:
        """Receive the packed layer and queue its unpack on the side stream (`fence` waits)."""
        n = len(record.block_ids)
        # a wrong size would desynchronize the NCCL queue: a protocol error, not a skip
        nbytes = _read_size(conn, limit=_packed_bytes(self.kv_cache.spec, n), exact=True)
        buf = self._recv(conn, nbytes)
        if header.has_crc:
            self._stream.synchronize()
            crc = _crc(buf)
            if crc != header.crc:
                raise ChecksumMismatchError(f"layer {header.layer}: crc32 {crc:#010x} mismatch")
        from kernels.kv_pack import unpack_kv_blocks

        ids = record.cache.get("dst_ids")
        if not isinstance(ids, torch.Tensor):
            ids = torch.tensor(record.block_ids, dtype=torch.int64, device=self.device)
            record.cache["dst_ids"] = ids
        layer = header.layer
        with record.write_lock, torch.cuda.stream(self._stream):
            if record.state.is_terminal:
                return
            packed = _packed_view(buf, self.kv_cache.spec, n)
            k, v = self.kv_cache.key_caches[layer], self.kv_cache.value_caches[layer]
            unpack_kv_blocks(packed, k, v, ids)

    def skip(self, conn: Connection, header: Header, record: TransferRecord | None) -> None:
        """Receive the layer anyway (into staging), keeping NCCL's queues matched."""
        if header.nbytes != _SIZE.size:
            raise ProtocolError(f"nccl LAYER frame with {header.nbytes} payload bytes")
        n = self.kv_cache.spec.num_blocks if record is None else len(record.block_ids)
        limit = _packed_bytes(self.kv_cache.spec, n)
        self._recv(conn, _read_size(conn, limit=limit, exact=record is not None))

    def fence(self) -> None:
        """Unpacks already queued on the side stream land before DONE, and before failed
        blocks return to the pool (where the engine would reuse them)."""
        self._stream.synchronize()

    def writer_running(self, conn: Connection) -> bool:
        return False

    def disconnected(self, conn: Connection) -> None:
        _abort_comm(self._nccl, conn)

    def close(self) -> None:
        pass


class NcclWriting:
    """Sending data path on a GPU; see the module docstring."""

    backend = "nccl"

    def __init__(self, spec: KVCacheSpec, device: str | torch.device | None = None) -> None:
        self.device = resolve_device(device)
        require_cuda(self.device)
        self._nccl = load_nccl()
        self._stream = torch.cuda.Stream(self.device)
        self.spec = spec
        self._buffers: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._next_buffer = 0

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        return connect(endpoint, timeout_s, None, scheme="nccl")

    def welcome(self, conn: Connection) -> None:
        """Join the communicator whose unique id the receiver sent."""
        raw = conn.welcome.get("nccl_unique_id")
        if not isinstance(raw, str):
            raise PeerLostError(f"receiver at {conn.name} sent no NCCL unique id")
        try:
            unique_id = bytes.fromhex(raw)
        except ValueError:
            raise PeerLostError(f"receiver at {conn.name} sent a malformed unique id") from None
        with torch.cuda.device(self.device):
            conn.state["comm"] = self._nccl.comm_init_rank(2, unique_id, SENDER_RANK)

    def ready(self, k_cache: torch.Tensor) -> object | None:
        """A CUDA event after the layer's compute: the side stream waits on it."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(k_cache.device))
        return event

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """Next buffer of a ring of two, once its previous send completed."""
        if len(self._buffers) < 2:
            empty = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._buffers.append((empty, torch.cuda.Event()))
        slot = self._next_buffer % len(self._buffers)
        self._next_buffer += 1
        buf, done = self._buffers[slot]
        done.synchronize()
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[slot] = (buf, done)
        return buf[:nbytes]

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        """Per layer: pack the blocks on the side stream, send the LAYER frame with the
        byte count, then `ncclSend` the packed buffer."""
        from kernels.kv_pack import pack_kv_blocks

        comm = conn.state.get("comm")
        if not isinstance(comm, int):
            raise PeerLostError("no NCCL communicator for this connection")
        for item in items:
            assert item.k_cache is not None and item.v_cache is not None
            assert item.src_ids is not None
            n = len(item.src_ids)
            nbytes = _packed_bytes(self.spec, n)
            buf = self._buffer(nbytes)
            ids = torch.from_numpy(item.src_ids).to(self.device, non_blocking=True)
            with torch.cuda.stream(self._stream):
                if isinstance(item.ready, torch.cuda.Event):
                    self._stream.wait_event(item.ready)
                pack_kv_blocks(item.k_cache, item.v_cache, ids, out=_packed_view(buf, self.spec, n))
                crc = _crc(buf) if checksum else None
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
                stream = self._stream.cuda_stream
                self._nccl.group_start()
                self._nccl.send(buf.data_ptr(), nbytes, RECEIVER_RANK, comm, stream)
                self._nccl.group_end()
                self._buffers[(self._next_buffer - 1) % len(self._buffers)][1].record(self._stream)

    def disconnected(self, conn: Connection) -> None:
        _abort_comm(self._nccl, conn)


def _packed_bytes(spec: KVCacheSpec, n: int) -> int:
    """Bytes of `n` blocks of one layer packed by `kv_pack`: all K blocks, then all V."""
    return 2 * n * spec.bytes_per_block_per_layer


def _packed_view(buf: torch.Tensor, spec: KVCacheSpec, n: int) -> torch.Tensor:
    """`buf` (uint8, `_packed_bytes` long) seen as `kv_pack`'s `[2, n, *block_shape]`."""
    return buf.view(spec.torch_dtype).view(2, n, *spec.block_shape)


def _crc(buf: torch.Tensor) -> int:
    """CRC32 of a packed layer, copied to the host (only with `checksum`, it syncs)."""
    return zlib.crc32(buf.cpu().numpy().data)


def _read_size(conn: Connection, *, limit: int, exact: bool) -> int:
    """The NCCL byte count a LAYER frame announces (its payload size was checked already):
    `limit` exactly, or (`exact=False`) at most `limit`, else a protocol error."""
    raw = bytearray(_SIZE.size)
    conn.fs.recv_into(memoryview(raw))
    nbytes = int(_SIZE.unpack(raw)[0])
    if nbytes > limit or (exact and nbytes != limit):
        raise ProtocolError(f"nccl layer of {nbytes} bytes, expected {limit}")
    return nbytes
