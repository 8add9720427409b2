"""Argument checks shared by the kernels' host wrappers.

Each check raises a `ValueError` (shapes, strides, devices) or a `TypeError` (dtypes) whose
message names the argument, so a caller wiring a kernel up wrongly sees what to fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kernels.fp8 import KV_CACHE_DTYPES

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """One layer's K and V caches: equal `[num_blocks, block_size, kvH, head_dim]` tensors."""
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    if k_cache.dtype not in KV_CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"k_cache/v_cache must share one of {KV_CACHE_DTYPES}, "
            f"got {k_cache.dtype}/{v_cache.dtype}"
        )
    if v_cache.device != k_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")


def check_slots_flattenable(cache: torch.Tensor, name: str) -> None:
    """`cache` can be viewed as `[num_blocks * block_size, kvH, D]` without a copy."""
    if cache.shape[0] > 1 and cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError(
            f"{name} must have its block_size slots packed inside each block "
            f"(stride(0) == block_size * stride(1)), got strides {cache.stride()}"
        )


def check_index(
    index: torch.Tensor, name: str, device: torch.device, length: int | None = None
) -> None:
    """A 1-D int64 index tensor on `device` (of `length` entries when given)."""
    if index.dim() != 1 or index.dtype != torch.int64:
        raise TypeError(
            f"{name} must be a 1-D int64 tensor, got {index.dtype} of shape {tuple(index.shape)}"
        )
    if index.device != device:
        raise ValueError(f"{name} is on {index.device} but the cache is on {device}")
    if length is not None and index.shape[0] != length:
        raise ValueError(f"{name} has {index.shape[0]} entries, expected {length}")


def as_block_ids(block_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as a 1-D int64 tensor on `device` (lists are converted)."""
    if isinstance(block_ids, torch.Tensor):
        check_index(block_ids, "block_ids", device)
        return block_ids
    return torch.tensor(list(block_ids), dtype=torch.int64, device=device)
