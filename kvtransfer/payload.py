"""A layer's payload as every backend defines it: the request's K rows in ticket order,
then its V rows. tcp sends it as views into the cache, nccl packs it, and its CRC32 is
what `TransferOptions.checksum` compares on both ends."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from engine.kv_cache import KVCache
from kvtransfer.base import ChecksumMismatchError
from kvtransfer.rowcopy import as_id_array, contiguous_runs


def cache_rows(kv_cache: KVCache) -> np.ndarray:
    """`[layers, 2 (K, V), blocks, bytes_per_block]` uint8 view of a whole CPU cache."""
    spec = kv_cache.spec
    flat = kv_cache.flat.view(torch.uint8)
    return flat.reshape(spec.num_layers, 2, spec.num_blocks, -1).numpy()


def id_runs(block_ids: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Runs of consecutive block ids as `(first id, length)`, in order."""
    ids = as_id_array(block_ids)
    return [(int(ids[i]), k) for i, k in contiguous_runs(ids)]


def record_runs(
    cache: dict[str, object], block_ids: Sequence[int] | np.ndarray
) -> list[tuple[int, int]]:
    """`id_runs(block_ids)`, computed once per transfer and kept in its record's `cache`."""
    if not isinstance(runs := cache.get("runs"), list):
        runs = cache["runs"] = id_runs(block_ids)
    return runs


def layer_views(
    k_rows: np.ndarray, v_rows: np.ndarray, runs: list[tuple[int, int]]
) -> list[memoryview]:
    """The payload as flat byte views (no copy) of `[blocks, bytes]` K and V rows."""
    views = []
    for rows in (k_rows, v_rows):
        flat, row_bytes = rows.reshape(-1).data, rows.shape[1]
        views += [flat[start * row_bytes : (start + k) * row_bytes] for start, k in runs]
    return views


def crc32(buffers: Iterable[memoryview]) -> int:
    """CRC32 of the buffers' bytes, in order."""
    crc = 0
    for buffer in buffers:
        crc = zlib.crc32(buffer, crc)
    return crc


def check_crc(expected: int, buffers: Iterable[memoryview], what: str) -> None:
    """Raise ChecksumMismatchError unless the buffers' CRC32 is `expected` (the sender's)."""
    if (crc := crc32(buffers)) != expected:
        raise ChecksumMismatchError(f"{what}: crc32 {crc:#010x}, sender computed {expected:#010x}")


def layer_crc(k_rows: np.ndarray, v_rows: np.ndarray, block_ids: Sequence[int]) -> int:
    """Checksum of one layer's payload for `block_ids` (benchmarks, tests)."""
    return crc32(layer_views(k_rows, v_rows, id_runs(block_ids)))
