"""`cuda_ipc`: GPUs of one node; the prefill process copies into decode's CUDA cache itself.

Each WELCOME exports the receiver's cache (`_share_cuda_`: IPC handle, a fresh slot of
torch's IPC ref counter, an event after the cache's last write) with its GPU's UUID; the
sender opens it once on its index of that GPU and drops it with the connection, releasing
the slot. Per layer the sender copies the blocks on a side stream and synchronizes it under
the record's write_lock before the LAYER frame: once decode reads a LAYER or an ABORT_ACK
no copy is outstanding (no `fence` needed), so blocks never return to the pool while a copy
may write them. Control is a Unix socket, as for `shm`. The ends are two processes (CUDA
opens no handle where it was exported); across GPUs the sender needs peer access (NVLink).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import BackendUnavailableError, ProtocolError
from kvtransfer.datapath import LayerItem, Writing
from kvtransfer.nccl import layer_computed, require_cuda, resolve_device
from kvtransfer.payload import check_crc, crc32
from kvtransfer.rowcopy import matched_runs
from kvtransfer.shm import PeerProcess, UnixLanding, checked_ids, unix_connect
from kvtransfer.table import TransferRecord
from kvtransfer.wire import Connection, Header

SCHEME = "cuda_ipc://"  # after a NUL, the endpoint is the control socket's abstract name
MAX_RUNS = 8  # up to this many runs of consecutive ids: a `copy_` each; else gather + scatter


def _uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _layer_bytes(k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> memoryview:
    """One layer's blocks `ids`, K rows in order then V rows, copied to the host."""
    rows = torch.cat([c.view(torch.uint8).index_select(0, ids) for c in (k, v)])
    return rows.cpu().numpy().data


class CudaIpcLanding(UnixLanding):
    """Receiving data path: exports the CUDA KV cache to each sender; see the module docstring."""

    backend = "cuda_ipc"

    def __init__(
        self, spec: KVCacheSpec, kv_cache: KVCache | None, device: str | torch.device | None
    ) -> None:
        """Adopt `kv_cache` (on a GPU), else allocate one on `device`."""
        require_cuda(kv_cache.flat.device if kv_cache else resolve_device(device), "cuda_ipc")
        self.kv_cache = kv_cache or KVCache.allocate(spec, resolve_device(device))
        if not self.kv_cache.flat.is_contiguous():
            raise ValueError("the cuda_ipc receiver needs a contiguous KV cache")
        self.endpoint = f"{SCHEME}pdkv-ipc-{os.getpid()}-{secrets.token_hex(4)}"
        self.listen("\0" + self.endpoint)

    def welcome(self, conn: Connection) -> dict[str, object]:
        """Export the cache with a counter slot of its own, released when the sender drops
        its view (a cache freed while mapped waits in torch's IPC limbo). Each export also
        nests one small record in torch's storage."""
        flat = self.kv_cache.flat
        # device, handle, size, offset, counter, counter offset, event, event sync required
        shared = flat.untyped_storage()._share_cuda_()[1:]
        ipc = [x.hex() if isinstance(x, bytes) else x for x in shared]
        return {"cuda_ipc": [*ipc, flat.storage_offset()], "uuid": _uuid(flat.device)}

    def land(self, conn: Connection, record: TransferRecord, header: Header) -> None:
        """The sender synchronized its copies before this frame: verify a checksum if any."""
        if header.has_crc:
            ids = torch.tensor(record.block_ids, device=self.kv_cache.flat.device)
            k, v = self.kv_cache.key_caches[header.layer], self.kv_cache.value_caches[header.layer]
            check_crc(header.crc, [_layer_bytes(k, v, ids)], f"layer {header.layer}")


class CudaIpcWriting(Writing):
    """Sending data path: copies layers into a receiver's exported cache on a side stream."""

    backend = "cuda_ipc"
    ready = staticmethod(layer_computed)

    def __init__(self, spec: KVCacheSpec, device: str | torch.device | None = None) -> None:
        cuda = require_cuda(resolve_device(device), "cuda_ipc")
        self.spec, self.device = spec, torch.device("cuda", torch.cuda.device(cuda).idx)
        self._stream = torch.cuda.Stream(self.device)

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        return unix_connect("\0" + endpoint, timeout_s)

    def welcome(self, conn: Connection) -> None:
        """Open the receiver's cache, once per connection, on our index of its GPU. Until
        that succeeds the export's counter slot is ours to release (else the receiver's
        cache, once freed, would wait in torch's IPC limbo for good)."""
        spec = self.spec
        shape = (spec.num_layers, 2, conn.num_blocks, *spec.block_shape)
        numel = int(np.prod(shape))
        try:
            ipc = [str(x) for x in conn.welcome["cuda_ipc"]]  # type: ignore[attr-defined]
            handle, counter, event = (bytes.fromhex(ipc[i]) for i in (0, 3, 5))
            size, at, counter_at, offset = (int(ipc[i]) for i in (1, 2, 4, 7))
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed cuda_ipc WELCOME: {exc}") from None
        try:
            index = self._open_index(conn)
            if (offset + numel) * spec.torch_dtype.itemsize > size:
                raise ProtocolError(f"an export of {size} bytes holds no cache of {shape}")
            try:
                flat = rebuild_cuda_tensor(
                    torch.Tensor, (numel,), (1,), offset, torch.UntypedStorage, spec.torch_dtype,
                    index, handle, size, at, False, counter, counter_at, event, ipc[6] == "True",
                )  # fmt: skip
            except RuntimeError as exc:  # e.g. no shared IPC namespace between the two
                raise BackendUnavailableError(
                    f"cannot open the receiver's CUDA IPC handle on cuda:{index}: {exc}"
                ) from None
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the receiver may be gone already
                torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_at)
            raise
        torch.cuda.current_stream(index).synchronize()  # rebuilding made it wait on the event
        conn.state["rows"] = flat.view(torch.uint8).view(*shape[:3], -1)  # [L, 2, N, bytes]

    def _open_index(self, conn: Connection) -> int:
        """Our index of the receiver's GPU; BackendUnavailableError where we cannot open it."""
        uuid = conn.welcome.get("uuid")
        if PeerProcess(conn.fs.sock).pid == os.getpid():
            raise BackendUnavailableError(
                "the cuda_ipc receiver is in this process, and CUDA opens no IPC handle in "
                "the process that exported it; use shm or tcp within one process"
            )
        index = next((i for i in range(torch.cuda.device_count()) if _uuid(i) == uuid), None)
        if index is None or not (
            index == self.device.index or torch.cuda.can_device_access_peer(self.device, index)
        ):
            raise BackendUnavailableError(
                f"the receiver's GPU {uuid} is not visible here with peer access from "
                f"{self.device}; use nccl"
            )
        return index

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        """Copy the queued layers and synchronize (under the write_lock); then LAYER frames."""
        dst = conn.state["rows"]
        assert isinstance(dst, torch.Tensor)
        if not isinstance(plan := record.cache.get("ipc_plan"), tuple):  # the first layer
            ids, to = checked_ids(items[0], self.spec.num_blocks, conn.num_blocks)
            runs = matched_runs(ids, to)
            plan = record.cache["ipc_plan"] = (
                torch.tensor(ids, device=self.device),
                torch.tensor(to, device=dst.device),
                runs if len(runs) <= MAX_RUNS else None,
            )
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
            crc = crc32([_layer_bytes(item.k_cache, item.v_cache, src_ids)]) if checksum else None
            conn.send_layer(item.ticket, item.layer, crc)

    def disconnected(self, conn: Connection) -> None:
        """Let our copies finish, then drop the view (torch closes the handle with it)."""
        self._stream.synchronize()
        conn.state.pop("rows", None)
