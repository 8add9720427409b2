"""`nccl`: GPU-to-GPU transfer; control frames over TCP, block bytes over NCCL.

Each connection holds a two-rank communicator (receiver rank 0, sender rank 1), joined with
the unique id of the receiver's WELCOME, and a side stream of its own on each end. Per layer
the sender's stream waits for the event of `send_layer` and packs the blocks
(`engine.kernels.kv_pack`); the LAYER frame carrying the byte count precedes the `ncclSend`.
The receiver, reading frames in order, posts the `ncclRecv` and the unpack on its stream,
which its fence waits for before DONE and before an ended transfer's blocks return to the
pool. NCCL work with a dead or stopped peer never completes on its own: every wait on it is
bounded by `io_timeout_s`, after which the connection drops and its communicator is aborted
(`ncclCommAbort`), which ends that work. No abort runs while a post on the comm may be
under way: the receiver's reader thread both posts and aborts; the sender posts under the
transfer's write_lock, which `Sender._drop` takes before aborting. The side streams come
from torch's pool (32 per device and priority, handed out in turn to every stream the
process creates), so two live connections can share one, and a fence can then wait on the
other's stuck receive until that connection is cut (dedicated streams would end this).
The handshake's NCCL steps (joining the comm, the first exchange) have no deadline of
their own (NCCL's non-blocking communicators would give them one). NCCL cannot join two
ranks on one GPU: the pair needs two devices.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import torch

from engine.kernels.kv_pack import pack_kv_blocks, unpack_kv_blocks
from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import BackendUnavailableError, PeerLostError, ProtocolError
from kvtransfer.datapath import Landing, LayerItem, Writing
from kvtransfer.nccl_lib import load_nccl
from kvtransfer.payload import check_crc, crc32
from kvtransfer.table import TransferRecord
from kvtransfer.tcp import listen, parse_endpoint
from kvtransfer.wire import Connection, Header

RECEIVER_RANK, SENDER_RANK = 0, 1
_SIZE = struct.Struct("<Q")  # a nccl LAYER frame's socket payload: the NCCL byte count


def require_cuda(device: torch.device, backend: str = "nccl") -> torch.device:
    """`device`; BackendUnavailableError unless it is a usable CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"the {backend} backend needs a CUDA device (got {device}, "
            f"torch.cuda.is_available()={torch.cuda.is_available()}); use shm or tcp on CPU"
        )
    return device


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device`, else the current CUDA device, else the CPU (which `require_cuda` refuses)."""
    if device is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device or "cpu")


def layer_computed(k_cache: torch.Tensor) -> torch.cuda.Event:
    """`Writing.ready` of the CUDA data paths (nccl, cuda_ipc): an event after the layer's
    compute on the current stream, for their side stream to wait on."""
    return torch.cuda.current_stream(k_cache.device).record_event()


class _Nccl:
    """What both data paths share: the device, NCCL, and per connection the pair's comm and
    a side stream of its own (a stalled peer holds up only its own connection's work)."""

    def __init__(self, spec: KVCacheSpec, device: torch.device, io_timeout_s: float) -> None:
        self.spec, self.device, self.nccl = spec, require_cuda(device), load_nccl()
        self.io_timeout_s = io_timeout_s

    def join(self, conn: Connection, unique_id: bytes, rank: int) -> None:
        """Join the pair's communicator, then pass one byte over it: NCCL connects a pair
        lazily, in its first send and receive, each blocking until the other is posted;
        done here, in the handshake, no later send waits on the peer."""
        stream = conn.state["stream"] = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            comm = conn.state["comm"] = self.nccl.comm_init_rank(2, unique_id, rank)
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            with self.nccl.group():
                post = self.nccl.send if rank == SENDER_RANK else self.nccl.recv
                post(probe.data_ptr(), 1, 1 - rank, comm, stream.cuda_stream)
            self.wait(stream.record_event())

    def device_ids(self, ids: object) -> torch.Tensor:
        """Block ids on the device, copied on the current stream from pinned memory: an
        asynchronous copy, never a wait for the stream's NCCL work."""
        host = torch.as_tensor(ids, dtype=torch.int64)
        return host.pin_memory().to(self.device, non_blocking=True)

    def comm(self, conn: Connection) -> int:
        if not isinstance(comm := conn.state.get("comm"), int):
            raise PeerLostError("no NCCL communicator for this connection")
        return comm

    @staticmethod
    def stream(conn: Connection) -> torch.cuda.Stream:
        stream = conn.state.get("stream")
        assert isinstance(stream, torch.cuda.Stream)
        return stream

    def wait(self, event: torch.cuda.Event) -> None:
        """Wait for `event`, at most `io_timeout_s`, else PeerLostError: NCCL work with a
        dead or stopped peer ends only when `disconnected` aborts the comm, which the
        connection's reader thread does once it sees the error."""
        deadline = time.monotonic() + self.io_timeout_s
        while not event.query():
            if time.monotonic() >= deadline:
                raise PeerLostError(f"NCCL peer silent for {self.io_timeout_s} s")
            time.sleep(0.0002)

    def packed(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """`buf` seen as `kv_pack`'s `[2, n, *block_shape]` (all K blocks, then all V)."""
        return buf.view(self.spec.torch_dtype).view(2, n, *self.spec.block_shape)

    def packed_bytes(self, n: int) -> int:
        return 2 * n * self.spec.bytes_per_block_per_layer

    def disconnected(self, conn: Connection) -> None:
        """The connection dropped: `ncclCommAbort` frees its communicator and fails
        anything still queued on it (the stream stays: fences still wait on it)."""
        if isinstance(comm := conn.state.pop("comm", None), int):
            self.nccl.comm_abort(comm)


class NcclLanding(_Nccl, Landing):
    """Receiving data path on a GPU; see the module docstring."""

    backend = "nccl"

    def __init__(
        self,
        kv_cache: KVCache,
        host: str,
        port: int = 0,
        advertise_host: str | None = None,
        io_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(kv_cache.spec, kv_cache.flat.device, io_timeout_s)
        self.kv_cache = kv_cache
        self.listener, self.endpoint = listen(host, port, advertise_host, "nccl")

    def welcome(self, conn: Connection) -> dict[str, object]:
        unique_id = conn.state["unique_id"] = self.nccl.unique_id()
        return {"nccl_unique_id": unique_id.hex(), "nccl_version": self.nccl.version()}

    def connected(self, conn: Connection) -> None:
        """Join the pair's communicator (blocks until the sender joins too)."""
        unique_id = conn.state["unique_id"]
        assert isinstance(unique_id, bytes)
        self.join(conn, unique_id, RECEIVER_RANK)

    def payload_bytes(self, num_blocks: int) -> int:
        return _SIZE.size  # the NCCL byte count; the bytes themselves go over NCCL

    def _recv(self, conn: Connection, limit: int, exact: bool) -> torch.Tensor:
        """Read the byte count the LAYER frame announces (`limit` exactly, or at most) and
        post the NCCL receive into the connection's staging buffer."""
        raw = bytearray(_SIZE.size)
        conn.fs.recv_into(memoryview(raw))
        if (nbytes := int(_SIZE.unpack(raw)[0])) > limit or (exact and nbytes != limit):
            raise ProtocolError(f"nccl layer of {nbytes} bytes, expected {limit}")
        staging, comm, stream = conn.state.get("staging"), self.comm(conn), self.stream(conn)
        with torch.cuda.stream(stream):  # allocated there too: only that stream reuses it
            if not isinstance(staging, torch.Tensor) or staging.numel() < nbytes:
                staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                conn.state["staging"] = staging
            with self.nccl.group():
                self.nccl.recv(staging.data_ptr(), nbytes, SENDER_RANK, comm, stream.cuda_stream)
        return staging[:nbytes]

    def land(self, conn: Connection, record: TransferRecord, header: Header) -> None:
        """Receive the packed layer (a wrong size would desynchronize NCCL's queues: a
        protocol error, not a skip) and queue its unpack on the side stream (`fence`)."""
        n, stream = len(record.block_ids), self.stream(conn)
        if not isinstance(ids := record.cache.get("dst_ids"), torch.Tensor):
            with torch.cuda.stream(stream):  # ordered before the unpack that reads them
                ids = record.cache["dst_ids"] = self.device_ids(record.block_ids)
        buf = self._recv(conn, self.packed_bytes(n), exact=True)
        if header.has_crc:
            self.wait(stream.record_event())
            check_crc(header.crc, [buf.cpu().numpy().data], f"layer {header.layer}")
        k, v = self.kv_cache.key_caches[header.layer], self.kv_cache.value_caches[header.layer]
        with record.write_lock, torch.cuda.stream(stream):
            if not record.state.is_terminal:
                unpack_kv_blocks(self.packed(buf, n), k, v, ids)

    def skip(self, conn: Connection, header: Header, record: TransferRecord | None) -> None:
        """Receive the layer anyway (into staging), keeping NCCL's queues matched."""
        if header.nbytes != _SIZE.size:
            raise ProtocolError(f"nccl LAYER frame with {header.nbytes} payload bytes")
        n = self.spec.num_blocks if record is None else len(record.block_ids)
        self._recv(conn, self.packed_bytes(n), exact=record is not None)

    def fence(self, record: TransferRecord) -> bool:
        """Wait for the unpacks queued for `record`: before DONE, and before its blocks
        return to the pool (where the engine would reuse them). A receive whose sender went
        silent ends only when the comm is aborted, which only the connection's reader may do
        (it alone posts on it): every `io_timeout_s` the reader aborts it, or another thread
        closes the connection for the reader to drop it. Either way the connection ends:
        every transfer on it lost its receives. False once the comm is gone (what was
        queued may not have arrived)."""
        if not isinstance(conn := record.peer, Connection) or "stream" not in conn.state:
            return True
        done = self.stream(conn).record_event()
        while True:
            try:
                self.wait(done)
                return "comm" in conn.state
            except PeerLostError:
                if conn.thread is threading.current_thread():
                    self.disconnected(conn)
                conn.fs.close()


class NcclWriting(_Nccl, Writing):
    """Sending data path on a GPU; see the module docstring."""

    backend = "nccl"
    ready = staticmethod(layer_computed)

    def __init__(
        self,
        spec: KVCacheSpec,
        device: str | torch.device | None = None,
        io_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(spec, resolve_device(device), io_timeout_s)

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        return socket.create_connection(parse_endpoint(endpoint, "nccl"), timeout_s)

    def welcome(self, conn: Connection) -> None:
        """Join the communicator whose unique id the receiver sent; the connection packs
        into a ring of two buffers, each with the event of its last send."""
        try:
            unique_id = bytes.fromhex(str(conn.welcome["nccl_unique_id"]))
        except (KeyError, ValueError):
            raise PeerLostError(f"receiver at {conn.name} sent no valid NCCL unique id") from None
        self.join(conn, unique_id, SENDER_RANK)
        conn.state["ring"] = [(torch.empty(0, dtype=torch.uint8), torch.cuda.Event()) for _ in "ab"]

    def wait_or_drop(self, conn: Connection, event: torch.cuda.Event) -> None:
        """`wait`; past `io_timeout_s` the connection closes (its reader then aborts the
        comm, which ends the stuck work) and PeerLostError fails the transfer."""
        try:
            self.wait(event)
        except PeerLostError:
            conn.fs.close()
            raise

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        """Per layer: pack the blocks on the connection's stream into its ring's next buffer
        (once that buffer's last send is done), send the LAYER frame with the byte count,
        then `ncclSend`; if either fails, the connection (and the receiver's comm) goes."""
        comm, stream, ring = self.comm(conn), self.stream(conn), conn.state["ring"]
        assert isinstance(ring, list)
        for item in items:
            assert item.k_cache is not None and item.v_cache is not None
            assert item.src_ids is not None
            n = len(item.src_ids)
            nbytes = self.packed_bytes(n)
            ring.append(ring.pop(0))
            held, sent = ring[-1]
            self.wait_or_drop(conn, sent)  # the buffer's last send is done
            with torch.cuda.stream(stream):  # allocations and the ids' copy too
                if held.numel() < nbytes:
                    held = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                    ring[-1] = (held, sent)
                buf = held[:nbytes]
                ids = self.device_ids(item.src_ids)
                if isinstance(item.ready, torch.cuda.Event):
                    stream.wait_event(item.ready)
                pack_kv_blocks(item.k_cache, item.v_cache, ids, out=self.packed(buf, n))
                crc = None
                if checksum:  # the packed bytes, once the pack is done
                    self.wait_or_drop(conn, stream.record_event())
                    crc = crc32([buf.cpu().numpy().data])
                # Under the write_lock: `Sender._drop` aborts the comm only after taking it.
                with record.write_lock:
                    if record.state.is_terminal:
                        return
                    try:
                        conn.send_layer(item.ticket, item.layer, crc, (_SIZE.pack(nbytes),))
                        with self.nccl.group():
                            self.nccl.send(
                                buf.data_ptr(), nbytes, RECEIVER_RANK, comm, stream.cuda_stream
                            )
                    except BaseException:
                        conn.fs.close()  # the receiver may await a send that never comes: end it
                        raise
                sent.record(stream)
