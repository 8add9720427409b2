"""The replica-wide KV cache of a tensor-parallel replica on the CPU, shared by its ranks.

Layout (see `engine.parallel`): `num_layers * size` items, item `layer * size + rank`
holding rank `rank`'s K and V of `layer`, each `[num_blocks, block_size, head_slots,
head_dim]`. Rank 0's process owns the buffer (the KV transfer endpoint lands and packs
every rank's items there); the other ranks map the same file and use their items only.

The buffer is a file in /dev/shm: either one this module creates (`allocate_shared`,
unlinked as soon as every rank has mapped it, so nothing outlives the processes) or one
someone else mapped already (the `shm` KV receiver's segment), found by address in
/proc/self/maps (`backing_file`). On CUDA every rank keeps its own shard on its own GPU;
KV transfer for that case needs per-rank endpoints (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from dataclasses import dataclass, replace

import torch

from engine.config import DTYPE_BYTES
from engine.kv_cache import KVCache, KVCacheSpec
from engine.parallel import Shard

SHM_DIR = "/dev/shm"
FILE_PREFIX = "pdtp-"  # our files: unlinked as soon as every rank has mapped them


def rank_spec(spec: KVCacheSpec, shard: Shard) -> KVCacheSpec:
    """The spec of one rank's own cache, given the replica-wide `spec`."""
    return replace(
        spec,
        num_layers=spec.num_layers // shard.size,
        num_kv_heads=len(shard.kv_heads),
        tensor_parallel_size=1,
        model_kv_heads=None,
    )


def rank_view(full: KVCache, shard: Shard) -> KVCache:
    """Rank `shard.rank`'s cache as an ordinary `KVCache` (no copy): its items of every
    layer, narrowed to its own KV heads."""
    if shard.size == 1:
        return full
    spec = full.spec
    layers = spec.num_layers // shard.size
    # [layers, size, 2, num_blocks, block_size, slots, head_dim] -> this rank's heads
    items = full.flat.view(layers, shard.size, 2, spec.num_blocks, *spec.block_shape)
    mine = items[:, shard.rank, :, :, :, : len(shard.kv_heads)]
    return KVCache(rank_spec(spec, shard), mine)


@dataclass(frozen=True, slots=True)
class BackingFile:
    """Where a CPU cache's bytes live: `nbytes` at `offset` of the file at `path`."""

    path: str
    offset: int
    nbytes: int


def allocate_shared(spec: KVCacheSpec) -> tuple[KVCache, BackingFile]:
    """A zeroed cache in a new /dev/shm file; the caller unlinks `path` once every rank
    has mapped it (`unlink_quietly`)."""
    path = os.path.join(SHM_DIR, f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    nbytes = max(spec.total_bytes, 1)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        unlink_quietly(path)
        raise
    finally:
        os.close(fd)
    return _over(mapping, 0, spec), BackingFile(path, 0, nbytes)


def allocate_for_engine(spec: KVCacheSpec, device: str, tensor_parallel_size: int) -> KVCache:
    """A zeroed cache to hand an engine: in /dev/shm when its ranks are CPU processes
    that must share it (the engine drops the file's name once they have mapped it)."""
    if tensor_parallel_size > 1 and not device.startswith("cuda"):
        return allocate_shared(spec)[0]
    return KVCache.allocate(spec, device)


def is_ours(backing: BackingFile) -> bool:
    return os.path.basename(backing.path).startswith(FILE_PREFIX)


def map_shared(backing: BackingFile, spec: KVCacheSpec) -> KVCache:
    """Another rank's view of a cache made by `allocate_shared` or found by `backing_file`."""
    fd = os.open(backing.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < backing.offset + spec.total_bytes:
            raise ValueError(f"{backing.path} holds {size} bytes, too few for the KV cache")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return _over(mapping, backing.offset, spec)


def _over(mapping: mmap.mmap, offset: int, spec: KVCacheSpec) -> KVCache:
    count = spec.total_bytes // DTYPE_BYTES[spec.dtype]
    flat = torch.frombuffer(mapping, dtype=spec.torch_dtype, count=count, offset=offset)
    return KVCache(spec, flat.view(spec.flat_shape))  # the tensor keeps the mapping alive


def backing_file(cache: KVCache) -> BackingFile | None:
    """The /dev/shm file a CPU cache is mapped from, or None (ordinary memory)."""
    if cache.flat.device.type != "cpu" or not cache.flat.is_contiguous():
        return None
    start = cache.flat.data_ptr()
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith(SHM_DIR + "/"):
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= start < high and start + cache.spec.total_bytes <= high:
                path = fields[5].rstrip("\n")
                if path.endswith(" (deleted)"):
                    return None
                offset = int(fields[2], 16) + start - low
                return BackingFile(path, offset, cache.spec.total_bytes)
    return None


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
