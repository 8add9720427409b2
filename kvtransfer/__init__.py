"""Moving KV blocks from a prefill replica into a decode replica's paged cache.

One `Receiver` (decode side) and one `Sender` (prefill side), each holding the transfer
table and a backend's data path; backends load lazily, so `nccl` is selectable (and fails
with a clear `BackendUnavailableError` when used) on a machine without CUDA:

    receiver = create_receiver("shm", spec, model_id="llama-3-8b", release=pool.free_request)
    ticket = receiver.open_ticket("req-1", block_ids, deadline_s=30)      # decode side
    sender = create_sender("shm", spec, model_id="llama-3-8b", release=pool.free_request)
    sender.send_layer(ticket, layer, k_cache, v_cache, src_block_ids)     # prefill side
    sender.finish(ticket); sender.wait("req-1", 5.0)  # -> TransferState.DONE

`shm` (one host), `tcp` (across hosts), `nccl` and `cuda_ipc` (GPUs): each one's data path
is drawn in docs/architecture.md and described in its module.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import (
    BackendUnavailableError,
    ChecksumMismatchError,
    KVLayout,
    KVLayoutMismatchError,
    KVTransferError,
    PeerLostError,
    ReleaseFn,
    StaleEpochError,
    Ticket,
    TransferAbortedError,
    TransferExpiredError,
    TransferOptions,
    TransferState,
    UnknownTransferError,
)
from kvtransfer.datapath import Landing, Writing
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender
from kvtransfer.table import ObserveFn
from kvtransfer.tcp import is_loopback

BACKENDS = ("cuda_ipc", "nccl", "shm", "tcp")  # what the factories accept, usable here or not


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {backend!r}; choose from {list(BACKENDS)}")


def create_receiver(
    backend: str,
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
    observe: ObserveFn | None = None,
) -> Receiver:
    """Called once per decode replica at startup. The receiver owns or adopts the cache.

    `kv_cache=None` allocates one (on `device` for nccl and cuda_ipc; for `shm` it must be
    None: the cache is created in shared memory; read it back from `receiver.kv_cache`).
    `release(request_id)` frees a request's destination blocks when its transfer ends other
    than DONE. tcp and nccl listen on `host:port` and name `advertise_host` (else `host`)
    in tickets; without `options.secret` they listen on loopback addresses only. shm and
    cuda_ipc listen on a local Unix socket.
    """
    _check(backend)
    if backend == "shm" and kv_cache is not None:
        raise ValueError("the shm receiver creates its cache in shared memory; pass None")
    if backend in ("tcp", "nccl") and options.secret is None and not is_loopback(host):
        raise ValueError(
            f"a receiver on {host!r} needs TransferOptions.secret: without it any host "
            "could write into the KV cache (bind a loopback address for tests)"
        )
    landing: Landing
    if backend == "shm":
        from kvtransfer.shm import ShmLanding

        landing = ShmLanding(spec)
    elif backend == "cuda_ipc":
        from kvtransfer.cuda_ipc import CudaIpcLanding

        landing = CudaIpcLanding(spec, kv_cache, device)
    elif backend == "tcp":
        from kvtransfer.tcp import TcpLanding

        landing = TcpLanding(kv_cache or KVCache.allocate(spec), host, port, advertise_host)
    else:
        from kvtransfer.nccl import NcclLanding, require_cuda, resolve_device

        if kv_cache is None:
            kv_cache = KVCache.allocate(spec, require_cuda(resolve_device(device)))
        landing = NcclLanding(kv_cache, host, port, advertise_host, options.io_timeout_s)
    try:
        return Receiver(
            spec, landing, model_id=model_id, release=release, options=options, observe=observe
        )
    except BaseException:
        landing.listener.close()
        landing.close()
        raise


def create_sender(
    backend: str,
    spec: KVCacheSpec,
    *,
    model_id: str,
    release: ReleaseFn,
    options: TransferOptions = TransferOptions(),
    host: str | None = None,
    device: str | torch.device | None = None,
    observe: ObserveFn | None = None,
) -> Sender:
    """Called once per prefill replica at startup. `spec` describes the sender's own cache;
    `release(request_id)` frees a request's source blocks once its transfer ended.
    `options.checksum` adds a CRC32 per layer; tcp connections leave from `host` when given;
    nccl runs on `device`. `observe`: told each transfer's end and settling."""
    _check(backend)
    writing: Writing
    if backend == "shm":
        from kvtransfer.shm import ShmWriting

        writing = ShmWriting(spec)
    elif backend == "tcp":
        from kvtransfer.tcp import TcpWriting

        writing = TcpWriting(host)
    elif backend == "cuda_ipc":
        from kvtransfer.cuda_ipc import CudaIpcWriting

        writing = CudaIpcWriting(spec, device)
    else:
        from kvtransfer.nccl import NcclWriting

        writing = NcclWriting(spec, device, options.io_timeout_s)
    return Sender(
        spec, writing, model_id=model_id, release=release, options=options, observe=observe
    )


__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "ChecksumMismatchError",
    "KVLayout",
    "KVLayoutMismatchError",
    "KVTransferError",
    "PeerLostError",
    "Receiver",
    "Sender",
    "StaleEpochError",
    "Ticket",
    "TransferAbortedError",
    "TransferExpiredError",
    "TransferOptions",
    "TransferState",
    "UnknownTransferError",
    "create_receiver",
    "create_sender",
]
