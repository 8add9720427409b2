"""Copying a request's blocks between paged caches on the CPU, with few calls and no GIL.

A layer's K (or V) cache `[num_blocks, block_size, kv_heads, head_dim]` is viewed as a
numpy `[num_blocks, bytes_per_block]` uint8 matrix ("rows"). Rows are dtype-agnostic (bf16
works) and numpy copies whole rows with one memcpy each, in C, with the GIL released, so a
copy overlaps the prefill's next layer. (`torch.index_copy_` moves ~0.4 GB/s on CPU here;
this moves at memcpy speed.) Large transfers use `ntcopy`'s streaming stores instead;
CUDA tensors go through `kernels.kv_pack`.

A transfer's block ids are the same for every layer, so a `CopyPlan` is built once per
transfer: runs where source and destination ids both advance by one become slice copies
(one memcpy per run); a contiguous side becomes one fancy-index scatter or gather; ids
random on both sides are copied in cache-sized chunks (gather into a small staging block
that stays in L2, then scatter), which costs about one pass over main memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.kv_cache import KVCache

STAGING_BYTES = 256 * 1024  # chunk of the two-sided path: fits in L2 on current CPUs
MIN_MEAN_RUN = 4  # blocks per run below which per-run slice copies lose to fancy indexing


def block_rows(cache: torch.Tensor) -> np.ndarray:
    """`[num_blocks, bytes_per_block]` uint8 view (no copy) of one contiguous CPU layer cache."""
    if cache.device.type != "cpu":
        raise ValueError(f"expected a CPU tensor, got one on {cache.device}")
    if not cache.is_contiguous():
        raise ValueError("the layer cache must be contiguous")
    return cache.view(torch.uint8).reshape(cache.shape[0], -1).numpy()


def cache_rows(kv_cache: KVCache) -> np.ndarray:
    """`[layers, 2 (K, V), blocks, bytes_per_block]` uint8 view of a whole CPU cache."""
    spec = kv_cache.spec
    flat = kv_cache.flat.view(torch.uint8)
    return flat.reshape(spec.num_layers, 2, spec.num_blocks, -1).numpy()


def as_id_array(block_ids: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    """Block ids as a 1-D int64 numpy array."""
    if isinstance(block_ids, torch.Tensor):
        return block_ids.detach().to("cpu", torch.int64).numpy().reshape(-1)
    return np.asarray(block_ids, dtype=np.int64).reshape(-1)


def contiguous_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids, as `(index of the run's first id, length)`."""
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ids)]))
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def matched_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs where both sides advance by one, as `(src_start_id, dst_start_id, length)`."""
    if len(src_ids) == 0:
        return []
    step = (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)
    breaks = np.flatnonzero(step) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src_ids)]))
    return [
        (int(src_ids[s]), int(dst_ids[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)
    ]


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
        src = np.ascontiguousarray(as_id_array(src_ids))
        dst = np.ascontiguousarray(as_id_array(dst_ids))
        if src.shape != dst.shape:
            raise ValueError(f"{len(src)} source ids but {len(dst)} destination ids")
        n = len(src)
        runs = matched_runs(src, dst)
        if len(runs) * MIN_MEAN_RUN <= n or len(runs) <= 2:
            return cls("slices", slices=tuple(runs), src_ids=src, dst_ids=dst)
        src_runs = contiguous_runs(src)
        if len(src_runs) * MIN_MEAN_RUN <= n:  # source in few runs: scatter each run
            steps = tuple((int(src[i]), 0, k) for i, k in src_runs)
            return cls(
                "scatter",
                steps,
                dst_index=tuple(dst[i : i + k] for i, k in src_runs),
                src_ids=src,
                dst_ids=dst,
            )
        dst_runs = contiguous_runs(dst)
        if len(dst_runs) * MIN_MEAN_RUN <= n:  # destination in few runs: gather into each
            steps = tuple((0, int(dst[i]), k) for i, k in dst_runs)
            return cls(
                "gather",
                steps,
                src_index=tuple(src[i : i + k] for i, k in dst_runs),
                src_ids=src,
                dst_ids=dst,
            )
        chunk = max(1, STAGING_BYTES // max(1, row_bytes))
        return cls(
            "staged",
            src_index=tuple(src[i : i + chunk] for i in range(0, n, chunk)),
            dst_index=tuple(dst[i : i + chunk] for i in range(0, n, chunk)),
            src_ids=src,
            dst_ids=dst,
        )

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


def rows_crc(rows: np.ndarray, ids: np.ndarray, crc: int = 0) -> int:
    """CRC32 of rows `ids` taken in order (consecutive ids are hashed as one span)."""
    for i, k in contiguous_runs(ids):
        start = int(ids[i])
        crc = zlib.crc32(rows[start : start + k].data, crc)
    return crc


def layer_crc(k_rows: np.ndarray, v_rows: np.ndarray, ids: np.ndarray) -> int:
    """Checksum of one layer's payload: K rows of `ids` in order, then V rows."""
    return rows_crc(v_rows, ids, rows_crc(k_rows, ids))
