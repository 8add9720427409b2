"""Moving KV blocks from a prefill replica into a decode replica's paged cache.

Pick a backend by name; backends load lazily, so `nccl` is selectable (and fails with a
clear `BackendUnavailableError` when used) on a machine without CUDA:

    receiver = create_receiver("shm", spec, model_id="llama-3-8b", release=pool.free_request)
    ticket = receiver.open_ticket("req-1", block_ids, deadline_s=30)      # decode side
    sender = create_sender("shm", spec, model_id="llama-3-8b", release=pool.free_request)
    sender.send_layer(ticket, layer, k_cache, v_cache, src_block_ids)     # prefill side
    sender.finish(ticket); receiver.poll("req-1")  # -> TransferState.DONE

| backend | where | data path |
| --- | --- | --- |
| `local` | one process | direct copies, completes synchronously (engine tests) |
| `shm` | one host | sender writes into decode's cache in /dev/shm (one copy) |
| `tcp` | across hosts | one frame per layer, gathered from / scattered into the caches |
| `nccl` | GPUs | NCCL send/recv, control frames over TCP |
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.base import (
    BackendUnavailableError,
    ChecksumMismatchError,
    KVLayout,
    KVLayoutMismatchError,
    KVReceiver,
    KVSender,
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

# name -> (module, receiver class, sender class)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "local": ("kvtransfer.local", "LocalReceiver", "LocalSender"),
    "shm": ("kvtransfer.shm", "ShmReceiver", "ShmSender"),
    "tcp": ("kvtransfer.tcp", "TcpReceiver", "TcpSender"),
    "nccl": ("kvtransfer.nccl", "NcclReceiver", "NcclSender"),
}


def available_backends() -> list[str]:
    """Names `create_receiver`/`create_sender` accept (whether usable here or not)."""
    return sorted(_BACKENDS)


def _classes(backend: str) -> tuple[Callable[..., KVReceiver], Callable[..., KVSender]]:
    if backend not in _BACKENDS:
        raise ValueError(
            f"unknown KV transfer backend {backend!r}; choose from {available_backends()}"
        )
    module_name, receiver_name, sender_name = _BACKENDS[backend]
    module = importlib.import_module(module_name)
    return getattr(module, receiver_name), getattr(module, sender_name)


def create_receiver(
    backend: str,
    spec: KVCacheSpec,
    kv_cache: KVCache | None = None,
    *,
    model_id: str,
    release: ReleaseFn,
    options: TransferOptions = TransferOptions(),
    **endpoint: object,
) -> KVReceiver:
    """Called once per decode replica at startup. The receiver owns or adopts the cache.

    `kv_cache=None` allocates one (for `shm` it must be None: the cache is created in shared
    memory; read it back from `receiver.kv_cache`). `release(request_id)` frees a request's
    destination blocks when its transfer ends other than DONE. `endpoint` holds the
    backend's address settings: `host`, `port`, `advertise_host` (tcp, nccl), `name` (shm),
    `device` (nccl), `epoch` (tests).
    """
    receiver_cls, _ = _classes(backend)
    if backend == "shm":
        if kv_cache is not None:
            raise ValueError("the shm receiver creates its cache in shared memory; pass None")
        return receiver_cls(spec, model_id=model_id, release=release, options=options, **endpoint)
    return receiver_cls(
        spec, kv_cache, model_id=model_id, release=release, options=options, **endpoint
    )


def create_sender(
    backend: str,
    spec: KVCacheSpec,
    *,
    model_id: str,
    release: ReleaseFn,
    options: TransferOptions = TransferOptions(),
    **endpoint: object,
) -> KVSender:
    """Called once per prefill replica at startup. `spec` describes the sender's own cache;
    `release(request_id)` frees a request's source blocks once its transfer ended.
    `options.checksum` adds a CRC32 per layer; `endpoint` may hold `device` (nccl)."""
    _, sender_cls = _classes(backend)
    return sender_cls(spec, model_id=model_id, release=release, options=options, **endpoint)


__all__ = [
    "BackendUnavailableError",
    "ChecksumMismatchError",
    "KVLayout",
    "KVLayoutMismatchError",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "PeerLostError",
    "StaleEpochError",
    "Ticket",
    "TransferAbortedError",
    "TransferExpiredError",
    "TransferOptions",
    "TransferState",
    "UnknownTransferError",
    "available_backends",
    "create_receiver",
    "create_sender",
]
