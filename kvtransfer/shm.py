"""`shm`: same-host transfer; the prefill process writes straight into decode's KV cache.

The receiver creates its cache in a POSIX shared-memory segment (`/dev/shm/pdkv-*`, unlinked
at close, by its resource tracker if it dies, by the next receiver's sweep of dead owners,
or by the driver that stops the cluster: `app/driver_exit.py`; Ray kills a stopping
replica's tracker with it). The sender maps it (`map_segment`: never creates one) and
copies each layer's blocks there (`kvtransfer.rowcopy`: one native call with streaming
stores for large transfers).
Control frames, without payload, go over an abstract Unix socket. As the sender writes our
memory itself, an ended transfer's blocks stay fenced until its ABORT_ACK or the connection
drops, and past the fence timeout quarantined until the ABORT_ACK or until its process
(SO_PEERCRED) is gone: a cut connection does not stop a SIGSTOPped process mid-copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import secrets
import socket
import struct
import threading
from multiprocessing.shared_memory import SharedMemory
from stat import S_ISREG

import numpy as np
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import base, rowcopy
from kvtransfer.datapath import Landing, LayerItem, Writing
from kvtransfer.payload import cache_rows, check_crc, crc32, layer_views, record_runs
from kvtransfer.rowcopy import CopyPlan, as_id_array, block_rows
from kvtransfer.table import TransferRecord
from kvtransfer.wire import Connection, Header

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdkv-"
_SEGMENT_NAME = re.compile(r"pdkv-[A-Za-z0-9._-]{1,200}")
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: map pages writable without touching their bytes
PREFAULT_CHUNK_BYTES = 8 * 1024**2  # ~3 ms of populating at a time


def _require_shm() -> None:
    if not os.path.isdir(SHM_DIR):
        raise base.BackendUnavailableError(f"the shm backend needs POSIX shared memory ({SHM_DIR})")


def _control_socket(endpoint_or_segment: str) -> str:
    return f"\0{endpoint_or_segment.removeprefix('shm://')}.ctl"


def unix_connect(name: str, timeout_s: float) -> socket.socket:
    """`Writing.open` of shm and cuda_ipc: a connection to the abstract Unix socket `name`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(name)
    except BaseException:
        sock.close()
        raise
    return sock


def _is_served(segment: str) -> bool:
    """Whether a live receiver listens on the segment's control socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(_control_socket(segment)) == 0


def list_segments() -> list[str]:
    """Names of pdserve KV segments currently in /dev/shm (leak checks in tests/ops)."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX))
    return []


def segment_owner(segment: str) -> int | None:
    """The pid of the receiver that created `segment` (named `pdkv-<pid>-<random>`)."""
    pid = segment.removeprefix(SEGMENT_PREFIX).split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def sweep_orphans() -> None:
    """Unlink default-named segments whose owner pid is gone and that nobody serves."""
    for segment in list_segments():
        pid = segment_owner(segment)
        if pid is not None and _start_time(pid) is None and not _is_served(segment):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, segment))


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat; None once the process exited (a zombie writes nothing)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class PeerProcess:
    """The process at the other end of a Unix socket, as the kernel names it (SO_PEERCRED),
    with its start time, so a recycled pid does not pass for the peer."""

    def __init__(self, sock: socket.socket) -> None:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        self.pid = struct.unpack("3i", creds)[0]
        # pid 0: the peer lives in a pid namespace we cannot see; nothing to watch then
        self._start_time = _start_time(self.pid) if self.pid > 0 else None

    def is_running(self) -> bool:
        """Whether the peer process may still execute (a stopped process counts as running)."""
        return self._start_time is not None and _start_time(self.pid) == self._start_time


def checked_ids(item: LayerItem, num_src: int, num_dst: int) -> tuple[np.ndarray, np.ndarray]:
    """The source and destination block ids of a transfer whose data path writes the peer's
    cache (shm, cuda_ipc); KVTransferError unless within `[0, num_src)`, `[0, num_dst)`."""
    src_ids, dst_ids = item.src_ids, as_id_array(item.ticket.block_ids)
    assert src_ids is not None
    for ids, limit, which in ((src_ids, num_src, "source"), (dst_ids, num_dst, "destination")):
        if int(ids.min()) < 0 or int(ids.max()) >= limit:
            raise base.KVTransferError(f"{which} block ids outside [0, {limit})")
    return src_ids, dst_ids


def map_segment(segment: str, nbytes: int) -> torch.Tensor:
    """Map an existing segment as a flat uint8 tensor; the mapping dies with the tensor.
    Never creates one (a sender writing into a file nobody reads would report DONE):
    FileNotFoundError if it is missing, ValueError unless a regular file of this user of
    exactly `nbytes` bytes."""
    if not _SEGMENT_NAME.fullmatch(segment):
        raise ValueError(f"{segment!r} is not a pdserve KV segment name")
    path = os.path.join(SHM_DIR, segment)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ValueError(f"{path} is not a shared-memory segment of this user")
        if info.st_size != nbytes:
            raise ValueError(f"{path} holds {info.st_size} bytes, expected {nbytes}")
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until freed


def prefault_writable(flat: torch.Tensor) -> None:
    """Map every page of a shared mapping writable now, without changing a byte: copies run
    ~1.5x faster into pages populated so than into pages first mapped by reading them (the
    fallback before Linux 5.14). In chunks: populating holds the process's memory-map lock,
    which every new thread's stack and every large allocation waits for."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start, end = flat.data_ptr() & ~4095, flat.data_ptr() + flat.numel()
    for at in range(start, end, PREFAULT_CHUNK_BYTES):
        if libc.madvise(at, min(PREFAULT_CHUNK_BYTES, end - at), MADV_POPULATE_WRITE) != 0:
            offset = max(at - flat.data_ptr(), 0)
            int(flat[offset : offset + PREFAULT_CHUNK_BYTES : 4096].sum())


class UnixLanding(Landing):
    """What the shm and cuda_ipc landings share (the reason for a second level of classes):
    a control socket on an abstract Unix name, and a sender process that writes our memory
    itself, known from the kernel when it connects so that fences can tell it is gone."""

    remote_writer = True

    def listen(self, name: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(name)
            self.listener.listen(64)
        except BaseException:
            self.listener.close()
            raise

    def connected(self, conn: Connection) -> None:
        conn.state["process"] = PeerProcess(conn.fs.sock)

    def writer_running(self, conn: Connection) -> bool:
        """Whether the sender process that connected still runs."""
        process = conn.state.get("process")
        return isinstance(process, PeerProcess) and process.is_running()


class ShmLanding(UnixLanding):
    """Receiving data path: owns the shared-memory KV cache; see the module docstring."""

    backend = "shm"

    def __init__(self, spec: KVCacheSpec) -> None:
        _require_shm()
        sweep_orphans()
        self.segment = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.endpoint = f"shm://{self.segment}"
        owner = SharedMemory(self.segment, create=True, size=spec.total_bytes)
        owner.close()  # keeps the name (and the tracker's registration); torch maps it below
        self._owner: SharedMemory | None = owner
        try:
            flat = map_segment(self.segment, spec.total_bytes)
            flat.zero_()  # fault every page in now, not during the first transfer
            self.kv_cache = KVCache(spec, flat.view(spec.torch_dtype).view(spec.flat_shape))
            self._rows = cache_rows(self.kv_cache)
            self.listen(_control_socket(self.segment))
        except BaseException:
            self.close()
            raise

    def welcome(self, conn: Connection) -> dict[str, object]:
        return {"segment": self.segment, "total_bytes": self.kv_cache.spec.total_bytes}

    def land(self, conn: Connection, record: TransferRecord, header: Header) -> None:
        """The layer is in place; with checksums on, verify what the blocks now hold."""
        if header.has_crc:
            rows, runs = self._rows[header.layer], record_runs(record.cache, record.block_ids)
            where = f"layer {header.layer} of {record.request_id!r} in the destination blocks"
            check_crc(header.crc, layer_views(rows[0], rows[1], runs), where)

    def close(self) -> None:
        """Unlink the segment; the memory itself goes when the last mapping does."""
        owner, self._owner = self._owner, None
        if owner is not None:
            with contextlib.suppress(FileNotFoundError):
                owner.unlink()


class ShmWriting(Writing):
    """Sending data path: copies layers into a receiver's mapped segment."""

    backend = "shm"

    def __init__(self, spec: KVCacheSpec) -> None:
        _require_shm()
        self.spec = spec
        rowcopy.available()  # build the streaming-copy helper now, not in the first transfer

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        return unix_connect(_control_socket(endpoint), timeout_s)

    def welcome(self, conn: Connection) -> None:
        """Map the receiver's segment (checked: ours, of the size its WELCOME implies) and
        populate it on a thread (~0.1 s per 256 MiB of cache, once per connection), so the
        first transfer waits only for the pages it writes."""
        segment, nbytes = conn.welcome.get("segment"), conn.welcome.get("total_bytes")
        assert conn.layout is not None, "set by the handshake"
        # the receiver's geometry: another TP size than ours is re-sharded
        dst = conn.layout.cache_spec(conn.num_blocks)
        expected = dst.total_bytes
        if f"shm://{segment}" != conn.name or not isinstance(nbytes, int) or nbytes != expected:
            raise base.PeerLostError(f"{conn.name} offers segment {segment!r} of {nbytes} bytes")
        try:
            flat = map_segment(str(segment), nbytes)
        except FileNotFoundError:
            raise base.PeerLostError(
                f"receiver {conn.name} has no shm segment {segment!r}"
            ) from None
        except (OSError, ValueError) as exc:
            raise base.PeerLostError(f"cannot map {segment}: {exc}") from exc
        populate = conn.state["populating"] = threading.Thread(
            target=prefault_writable, args=(flat,), name="kv-shm-populate", daemon=True
        )
        populate.start()
        conn.state["rows"] = flat.numpy().reshape(dst.num_layers, 2, conn.num_blocks, -1)

    def settle(self, conn: Connection, timeout_s: float) -> None:
        """Wait until the receiver's cache is populated in our page tables."""
        if isinstance(populate := conn.state.get("populating"), threading.Thread):
            populate.join(timeout_s)
            if populate.is_alive():
                raise base.PeerTimeoutError(f"mapping {conn.name} took over {timeout_s} s")

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        """Copy every queued layer (K and V) into the destination blocks, in one native call
        for transfers large enough to stream; then send their LAYER frames."""
        rows, (plan, streaming) = conn.state["rows"], self.plan(conn, record, items[0])
        assert isinstance(rows, np.ndarray)
        sources = [(block_rows(i.k_cache), block_rows(i.v_cache), i.layer) for i in items]  # type: ignore[arg-type]
        if any(k.shape[1] != rows.shape[-1] or v.shape[1] != rows.shape[-1] for k, v, _ in sources):
            raise base.KVTransferError("source rows do not match the receiver's block size")
        copies = [(s, rows[layer, kv]) for k, v, layer in sources for kv, s in enumerate((k, v))]
        with record.write_lock:
            if record.state.is_terminal:
                return
            if streaming:
                rowcopy.copy_rows_many(
                    [(src.ctypes.data, dst.ctypes.data) for src, dst in copies],
                    plan.src_ids,
                    plan.dst_ids,
                    row_bytes=rows.shape[-1],
                    src_num_rows=items[0].k_cache.shape[0],  # type: ignore[union-attr]
                    dst_num_rows=conn.num_blocks,
                )
            else:
                for src, dst in copies:
                    plan.copy(src, dst)
        for k, v, layer in sources:
            crc = None
            if checksum:  # the source blocks' runs, found once per transfer
                crc = crc32(layer_views(k, v, record_runs(record.cache, plan.src_ids)))
            conn.send_layer(items[0].ticket, layer, crc)

    def plan(
        self, conn: Connection, record: TransferRecord, item: LayerItem
    ) -> tuple[CopyPlan, bool]:
        """The transfer's copy plan (built on its first layer, ids checked) and whether to
        copy with streaming stores."""
        assert conn.layout is not None and item.k_cache is not None
        dst = conn.layout.cache_spec(conn.num_blocks)
        if not isinstance(plan := record.cache.get("plan"), CopyPlan):
            src_ids, dst_ids = checked_ids(item, item.k_cache.shape[0], conn.num_blocks)
            plan = CopyPlan.build(src_ids, dst_ids, dst.bytes_per_block_per_layer)
            record.cache["plan"] = plan
        return plan, rowcopy.worth_streaming(len(plan.dst_ids) * dst.bytes_per_block)

    def disconnected(self, conn: Connection) -> None:
        conn.state.pop("rows", None)  # unmapped once in-flight copies drop their views
