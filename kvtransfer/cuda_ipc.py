"""`cuda_ipc`: GPUs of one node; the prefill process copies into decode's CUDA cache itself.

Each WELCOME exports the receiver's cache (`_share_cuda_`: IPC handle and offset, a fresh
slot of torch's IPC ref counter, an event after the cache's last write) with its GPU's UUID;
the sender opens it once on its index of that GPU and drops it with the connection, which
releases the slot (a cache freed while mapped waits in torch's IPC limbo). Per layer the
sender copies the blocks on a side stream (`copy_` per run of consecutive ids when few, else
gather + `index_copy_`) and synchronizes it, under the record's write_lock, before the LAYER
frame: once decode reads a LAYER or an ABORT_ACK nothing is outstanding on the receiver side
(no `fence` needed), so blocks never return to the pool while a copy can still write them.
As with `shm`, control is an abstract Unix socket whose peer pid (SO_PEERCRED) tells when a
silent writer is gone. The ends are two processes (CUDA opens no handle where it exported
it); across GPUs the sender must see both, with peer access (NVLink). `nccl` stays the
default between GPUs.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import zlib

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from engine.kernels.rowcopy import matched_runs
from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import base
from kvtransfer.datapath import Landing, LayerItem, Writing
from kvtransfer.nccl import layer_computed, resolve_device
from kvtransfer.shm import PeerProcess
from kvtransfer.table import TransferRecord
from kvtransfer.wire import Connection, Header, Kind

SCHEME = "cuda_ipc://"  # after a NUL, the endpoint is the control socket's abstract name
MAX_RUNS = 8  # more runs of consecutive ids than this: one gather + one scatter instead


def require_cuda(device: torch.device) -> None:
    """Raise BackendUnavailableError unless `device` is a usable CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise base.BackendUnavailableError(
            f"the cuda_ipc backend needs a CUDA device (got {device}, torch.cuda."
            f"is_available()={torch.cuda.is_available()}); use shm or tcp on CPU"
        )


def _uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _crc(k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> int:
    """CRC32 of one layer's blocks `ids`, K rows in order then V rows (copied to the host)."""
    rows = torch.cat([c.view(torch.uint8).index_select(0, ids) for c in (k, v)])
    return zlib.crc32(rows.cpu().numpy().tobytes())


class CudaIpcLanding(Landing):
    """Receiving data path: exports the CUDA KV cache to each sender; see the module docstring."""

    backend = "cuda_ipc"
    remote_writer = True  # the sender process writes our memory itself

    def __init__(
        self, spec: KVCacheSpec, kv_cache: KVCache | None, device: str | torch.device | None
    ) -> None:
        """Adopt `kv_cache` (on a GPU), else allocate one on `device`."""
        require_cuda(resolve_device(device) if kv_cache is None else kv_cache.flat.device)
        self.kv_cache = kv_cache or KVCache.allocate(spec, resolve_device(device))
        if not self.kv_cache.flat.is_contiguous():
            raise ValueError("the cuda_ipc receiver needs a contiguous KV cache")
        self.endpoint = f"{SCHEME}pdkv-ipc-{os.getpid()}-{secrets.token_hex(4)}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.endpoint)
        self.listener.listen(64)

    def welcome(self, conn: Connection) -> dict[str, object]:
        """Export the cache to this connection: its own counter slot, released when the
        sender drops its view (each export nests one small record in torch's storage)."""
        flat = self.kv_cache.flat
        _, handle, size, at, counter, counter_at, event, sync = (
            flat.untyped_storage()._share_cuda_()
        )
        offset = flat.storage_offset()
        ipc = [handle.hex(), size, at, counter.hex(), counter_at, event.hex(), sync, offset]
        return {"cuda_ipc": ipc, "uuid": _uuid(flat.device)}

    def connected(self, conn: Connection) -> None:
        conn.state["process"] = PeerProcess(conn.fs.sock)

    def land(self, conn: Connection, record: TransferRecord, header: Header) -> None:
        """The sender synchronized its copies before this frame: verify a checksum if any."""
        if header.has_crc:
            ids = torch.tensor(record.block_ids, device=self.kv_cache.flat.device)
            cache, layer = self.kv_cache, header.layer
            crc = _crc(cache.key_caches[layer], cache.value_caches[layer], ids)
            if crc != header.crc:
                raise base.ChecksumMismatchError(f"layer {layer}: crc32 {crc} != {header.crc}")

    def writer_running(self, conn: Connection) -> bool:
        process = conn.state.get("process")
        return isinstance(process, PeerProcess) and process.is_running()


class CudaIpcWriting(Writing):
    """Sending data path: copies layers into a receiver's exported cache on a side stream."""

    backend = "cuda_ipc"

    def __init__(self, spec: KVCacheSpec, device: str | torch.device | None = None) -> None:
        require_cuda(resolve_device(device))
        self.device = torch.device("cuda", torch.cuda.device(resolve_device(device)).idx)
        self.spec = spec
        self._stream = torch.cuda.Stream(self.device)

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect("\0" + endpoint)  # on failure the socket closes when collected
        return sock

    def welcome(self, conn: Connection) -> None:
        """Open the receiver's cache, once per connection, on our index of its GPU.

        Until the open succeeds the export's counter slot is ours to release (else the
        receiver's cache, once freed, would wait in torch's IPC limbo for good)."""
        uuid, spec = conn.welcome.get("uuid"), self.spec
        shape = (spec.num_layers, 2, conn.num_blocks, *spec.block_shape)
        numel = int(np.prod(shape))
        try:
            ipc = [str(x) for x in conn.welcome["cuda_ipc"]]  # type: ignore[attr-defined]
            handle, counter, event = (bytes.fromhex(ipc[i]) for i in (0, 3, 5))
            size, at, counter_at, offset = (int(ipc[i]) for i in (1, 2, 4, 7))
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise base.ProtocolError(f"malformed cuda_ipc WELCOME: {exc}") from None
        try:
            index = self._open_index(conn, uuid)
            if (offset + numel) * spec.torch_dtype.itemsize > size:
                raise base.ProtocolError(f"an export of {size} bytes holds no cache of {shape}")
            try:
                flat = rebuild_cuda_tensor(
                    torch.Tensor, (numel,), (1,), offset, torch.UntypedStorage, spec.torch_dtype,
                    index, handle, size, at, False, counter, counter_at, event, ipc[6] == "True",
                )  # fmt: skip
            except RuntimeError as exc:  # e.g. no shared IPC namespace between the two
                raise base.BackendUnavailableError(
                    f"cannot open the receiver's CUDA IPC handle on cuda:{index}: {exc}"
                ) from None
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the receiver may be gone already
                torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_at)
            raise
        torch.cuda.current_stream(index).synchronize()  # rebuilding made it wait on the event
        conn.state["rows"] = flat.view(torch.uint8).view(*shape[:3], -1)  # [L, 2, N, bytes]

    def _open_index(self, conn: Connection, uuid: object) -> int:
        """Our index of the receiver's GPU; BackendUnavailableError where we cannot open it."""
        if PeerProcess(conn.fs.sock).pid == os.getpid():
            raise base.BackendUnavailableError(
                "the cuda_ipc receiver is in this process, and CUDA opens no IPC handle in "
                "the process that exported it; use shm or tcp within one process"
            )
        index = next((i for i in range(torch.cuda.device_count()) if _uuid(i) == uuid), None)
        if index is None or not (
            index == self.device.index or torch.cuda.can_device_access_peer(self.device, index)
        ):
            raise base.BackendUnavailableError(
                f"the receiver's GPU {uuid} is not visible here with peer access from "
                f"{self.device}; use nccl"
            )
        return index

    def ready(self, k_cache: torch.Tensor) -> object | None:
        return layer_computed(k_cache)

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        """Copy the queued layers and synchronize (under the write_lock); then LAYER frames."""
        dst, first = conn.state["rows"], items[0]
        assert isinstance(dst, torch.Tensor) and first.src_ids is not None
        if "ipc_plan" not in record.cache:  # the transfer's first layer: check and place ids
            ids, to = first.src_ids, np.asarray(first.ticket.block_ids, dtype=np.int64)
            if min(ids.min(), to.min()) < 0 or ids.max() >= self.spec.num_blocks:
                raise base.KVTransferError(f"block ids outside [0, {self.spec.num_blocks})")
            if to.max() >= conn.num_blocks:
                raise base.KVTransferError(f"destination ids outside [0, {conn.num_blocks})")
            runs = matched_runs(ids, to)
            record.cache["ipc_plan"] = (
                torch.tensor(ids, device=self.device),
                torch.tensor(to, device=dst.device),
                runs if len(runs) <= MAX_RUNS else None,
            )
        plan = record.cache["ipc_plan"]
        assert isinstance(plan, tuple)
        src_ids, dst_ids, runs = plan
        with record.write_lock:
            if record.state.is_terminal:
                return
            with torch.cuda.stream(self._stream):
                for item in items:
                    if isinstance(item.ready, torch.cuda.Event):
                        self._stream.wait_event(item.ready)
                    for kv, cache in enumerate((item.k_cache, item.v_cache)):
                        assert cache is not None
                        out, src = dst[item.layer, kv], cache.view(torch.uint8).flatten(1)
                        for s, d, n in runs or ():
                            out[d : d + n].copy_(src[s : s + n], non_blocking=True)
                        if runs is None:
                            rows = src.index_select(0, src_ids).to(out.device, non_blocking=True)
                            out.index_copy_(0, dst_ids, rows)
            self._stream.synchronize()
            if dst.device != self.device:  # the scatter ran on that GPU's current stream
                torch.cuda.current_stream(dst.device).synchronize()
        for item in items:
            assert item.k_cache is not None and item.v_cache is not None
            crc = _crc(item.k_cache, item.v_cache, src_ids) if checksum else None
            epoch = item.ticket.epoch
            conn.fs.send(Kind.LAYER, record.request_id, epoch=epoch, layer=item.layer, crc=crc)

    def disconnected(self, conn: Connection) -> None:
        """Let our copies finish, then drop the view (torch closes the handle with it)."""
        self._stream.synchronize()
        conn.state.pop("rows", None)
