"""Cache write: store the new tokens' K and V into their paged cache slots.

A token's slot is `block_id * block_size + offset`; the model runner computes them
(`AttentionMetadata.slot_mapping`) so this kernel is one scatter per tensor. An FP8 cache
(`engine.kernels.fp8`) quantizes on the way in, with one scale per KV head.
"""

from __future__ import annotations

import torch

from engine.kernels._checks import (
    FLOAT_DTYPES,
    check_index,
    check_kv_caches,
    check_slots_flattenable,
)
from engine.kernels.fp8 import as_bytes, check_kv_scales, is_fp8, quantize_per_head


def _check_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    check_kv_caches(k_cache, v_cache)
    check_kv_scales(k_cache, k_scale, v_scale)
    _, _, num_kv_heads, head_dim = k_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
            f"got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if value.dtype != key.dtype:
        raise TypeError(f"key dtype {key.dtype} != value dtype {value.dtype}")
    if is_fp8(k_cache) and key.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"key/value for an FP8 cache must be one of {FLOAT_DTYPES}, got {key.dtype}"
        )
    if not is_fp8(k_cache) and key.dtype != k_cache.dtype:
        raise TypeError(f"key/value dtype {key.dtype} != cache dtype {k_cache.dtype}")
    if key.device != k_cache.device or value.device != k_cache.device:
        raise ValueError(f"key/value on {key.device}/{value.device}, cache on {k_cache.device}")
    check_index(slot_mapping, "slot_mapping", k_cache.device, length=key.shape[0])


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K and V into its cache slot, in place.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]` on the cache's device, in the
            cache's dtype (any float dtype for an FP8 cache).
        k_cache, v_cache: one layer's `[num_blocks, block_size, num_kv_heads, head_dim]`.
        slot_mapping: `[num_tokens]` int64 flat slots (`block_id * block_size + offset`),
            distinct and in range (out-of-range slots raise on the CPU).
        k_scale, v_scale: float32 `[num_kv_heads]` for an FP8 cache (stored = value / scale,
            clamped to the FP8 range); None for any other cache.
    """
    _check_cache_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if key.shape[0] == 0:
        return
    if k_cache.is_cuda:
        from engine.kernels.triton.cache_write import write_kv_cache_triton

        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if k_scale is not None and v_scale is not None:
        key, value = quantize_per_head(key, k_scale), quantize_per_head(value, v_scale)
    check_slots_flattenable(k_cache, "k_cache")
    check_slots_flattenable(v_cache, "v_cache")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    # [num_slots, num_kv_heads, head_dim] views: one row copy per token (FP8 as bytes)
    k_slots = as_bytes(k_cache).view(num_slots, num_kv_heads, head_dim)
    v_slots = as_bytes(v_cache).view(num_slots, num_kv_heads, head_dim)
    k_slots.index_copy_(0, slot_mapping, as_bytes(key))
    v_slots.index_copy_(0, slot_mapping, as_bytes(value))


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference for `write_kv_cache`: split each slot into (block, offset) and assign
    (quantizing first for an FP8 cache)."""
    if k_scale is not None and v_scale is not None:
        key, value = quantize_per_head(key, k_scale), quantize_per_head(value, v_scale)
    block_size = k_cache.shape[1]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[block_ids, offsets] = key
    v_cache[block_ids, offsets] = value
