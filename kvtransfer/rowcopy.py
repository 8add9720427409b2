"""Copying rows of byte matrices (KV blocks) between caches on the CPU: few calls, no GIL.

A layer's K (or V) cache `[num_blocks, block_size, kv_heads, head_dim]` is viewed as a numpy
`[num_blocks, bytes_per_block]` uint8 matrix (`block_rows`, any dtype). Two ways to copy
rows `src_ids[i] -> dst_ids[i]`:

- `CopyPlan` (the reference, plain numpy: one memcpy per row or run, GIL released; built
  once per id pair since a transfer's ids are the same for every layer): runs where both
  ids advance by one become slice copies, a contiguous side one fancy-index scatter or
  gather, ids random on both sides go through L2-sized chunks;
- `copy_rows_many` (the optimized kernel): a ~40-line C helper with non-temporal stores
  (AVX-512, SSE2, plain memcpy off x86) that copies several matrices in one call. glibc's
  memcpy streams only copies of tens of MiB; a KV block written for another process is
  not read again by this core, so ordinary stores waste half the bandwidth on
  read-for-ownership. Large transfers use it (`worth_streaming`).

The helper (`engine/kernels/csrc/ntcopy.c`) is built and loaded as the engine's C kernels
are (`engine.kernels.native.load_library`: a private directory, the library's hash checked
before it is loaded). Where it cannot be (no compiler, a failed check; logged once)
`available()` is False and callers use `CopyPlan`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.kernels.native import kernel_source, load_library

STAGING_BYTES = 256 * 1024  # chunk of the two-sided path: fits in L2 on current CPUs
MIN_MEAN_RUN = 4  # blocks per run below which per-run slice copies lose to fancy indexing
# Below this many bytes per transfer the blocks may still be in the last-level cache when
# decode reads them, and per-call overhead dominates. Measured: 512-token transfers of a
# 135M model (24 MB) copy ~1.7x faster with streaming stores.
STREAMING_MIN_BYTES = 4 * 1024 * 1024


def block_rows(cache: torch.Tensor) -> np.ndarray:
    """`[num_blocks, bytes_per_block]` uint8 view (no copy) of one contiguous CPU layer cache."""
    if cache.device.type != "cpu" or not cache.is_contiguous():
        raise ValueError(f"expected a contiguous CPU layer cache, got one on {cache.device}")
    return cache.view(torch.uint8).reshape(cache.shape[0], -1).numpy()


def as_id_array(block_ids: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    """Block ids as a contiguous 1-D int64 numpy array."""
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().to("cpu", torch.int64).numpy()
    return np.ascontiguousarray(np.asarray(block_ids, dtype=np.int64).reshape(-1))


def contiguous_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids, as `(index of the run's first id, length)`."""
    return [(s, k) for s, _, k in _runs(ids, ids)]


def matched_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs where both sides advance by one, as `(src_start_id, dst_start_id, length)`."""
    return [(int(src_ids[s]), int(dst_ids[s]), k) for s, _, k in _runs(src_ids, dst_ids)]


def _runs(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int, int]]:
    """`(start index, end index, length)` of the maximal runs where both advance by one."""
    if len(a) == 0:
        return []
    breaks = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    bounds = np.concatenate(([0], breaks, [len(a)])).tolist()
    return [(s, e, e - s) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """How to copy rows `src_ids[i] -> dst_ids[i]` for every i; see the module docstring."""

    kind: str  # "slices" | "scatter" | "gather" | "staged"
    slices: tuple[tuple[int, int, int], ...] = ()  # (src_start, dst_start, length)
    src_index: tuple[np.ndarray, ...] = ()  # per step: source ids (gather/staged)
    dst_index: tuple[np.ndarray, ...] = ()  # per step: destination ids (scatter/staged)
    src_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    dst_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    @classmethod
    def build(
        cls,
        src_ids: Sequence[int] | torch.Tensor | np.ndarray,
        dst_ids: Sequence[int] | torch.Tensor | np.ndarray,
        row_bytes: int,
    ) -> CopyPlan:
        src, dst = as_id_array(src_ids), as_id_array(dst_ids)
        if src.shape != dst.shape:
            raise ValueError(f"{len(src)} source ids but {len(dst)} destination ids")
        n, runs = len(src), matched_runs(src, dst)
        slices: tuple[tuple[int, int, int], ...] = ()
        src_index: tuple[np.ndarray, ...] = ()
        dst_index: tuple[np.ndarray, ...] = ()
        if len(runs) * MIN_MEAN_RUN <= n or len(runs) <= 2:
            kind, slices = "slices", tuple(runs)
        elif len(src_runs := contiguous_runs(src)) * MIN_MEAN_RUN <= n:  # scatter each run
            kind, slices = "scatter", tuple((int(src[i]), 0, k) for i, k in src_runs)
            dst_index = tuple(dst[i : i + k] for i, k in src_runs)
        elif len(dst_runs := contiguous_runs(dst)) * MIN_MEAN_RUN <= n:  # gather into each
            kind, slices = "gather", tuple((0, int(dst[i]), k) for i, k in dst_runs)
            src_index = tuple(src[i : i + k] for i, k in dst_runs)
        else:
            kind, step = "staged", max(1, STAGING_BYTES // max(1, row_bytes))
            src_index = tuple(src[i : i + step] for i in range(0, n, step))
            dst_index = tuple(dst[i : i + step] for i in range(0, n, step))
        return cls(kind, slices, src_index, dst_index, src, dst)

    def copy(self, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
        """Copy the planned rows from `src_rows` into `dst_rows` (both `[blocks, bytes]`)."""
        if self.kind == "slices":
            for s, d, k in self.slices:
                dst_rows[d : d + k] = src_rows[s : s + k]
        elif self.kind == "scatter":
            for (s, _, k), index in zip(self.slices, self.dst_index, strict=True):
                dst_rows[index] = src_rows[s : s + k]
        elif self.kind == "gather":
            for (_, d, k), index in zip(self.slices, self.src_index, strict=True):
                dst_rows[d : d + k] = src_rows[index]
        else:
            for s_index, d_index in zip(self.src_index, self.dst_index, strict=True):
                dst_rows[d_index] = src_rows[s_index]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded helper, or None (no compiler, a failed build or check: logged once)."""
    lib = load_library("ntcopy", kernel_source("ntcopy.c"))
    if lib is not None:
        fn = lib.pd_copy_rows
        fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
        fn.restype = None
    return lib


def available() -> bool:
    """Whether streaming copies are available (builds the helper on first call)."""
    return _library() is not None


def worth_streaming(transfer_bytes: int) -> bool:
    """Whether a transfer of `transfer_bytes` (all layers) should use streaming stores."""
    return transfer_bytes >= STREAMING_MIN_BYTES and available()


def copy_rows_many(
    pairs: list[tuple[int, int]],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    *,
    row_bytes: int,
    src_num_rows: int,
    dst_num_rows: int,
) -> None:
    """`dst[dst_ids] = src[src_ids]` with streaming stores, for several (source address,
    destination address) row matrices at once (e.g. K and V of every queued layer), the
    GIL released throughout. Each source has `src_num_rows` rows of `row_bytes` at its
    address, each destination `dst_num_rows` (the caller guarantees those; the contiguous
    int64 ids are checked against them)."""
    lib = _library()
    assert lib is not None, "check available() first"
    n = len(src_ids)
    if n != len(dst_ids):
        raise ValueError(f"{n} source ids but {len(dst_ids)} destination ids")
    for ids, limit in ((src_ids, src_num_rows), (dst_ids, dst_num_rows)):
        if ids.dtype != np.int64 or not ids.flags.c_contiguous:
            raise ValueError("ids must be a contiguous int64 vector")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise IndexError(f"block id out of range [0, {limit})")
    if n == 0 or not pairs:
        return
    addresses = np.asarray(pairs, dtype=np.int64)  # [pairs, 2]: source, destination
    srcs = np.ascontiguousarray(addresses[:, 0])
    dsts = np.ascontiguousarray(addresses[:, 1])
    args = (dsts.ctypes.data, srcs.ctypes.data, dst_ids.ctypes.data, src_ids.ctypes.data)
    lib.pd_copy_rows(len(pairs), *args, n, row_bytes)
