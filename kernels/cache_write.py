"""Cache write: store the new tokens' K and V into their paged cache slots.

A token's slot is `block_id * block_size + offset`; the model runner computes them
(`AttentionMetadata.slot_mapping`) so this kernel is one scatter per tensor.
"""

from __future__ import annotations

import torch

from kernels._checks import check_index, check_kv_caches, check_slots_flattenable


def _check_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_kv_caches(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
            f"got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise TypeError(f"key/value dtype {key.dtype}/{value.dtype} != cache dtype {k_cache.dtype}")
    if key.device != k_cache.device or value.device != k_cache.device:
        raise ValueError(f"key/value on {key.device}/{value.device}, cache on {k_cache.device}")
    check_index(slot_mapping, "slot_mapping", k_cache.device, length=key.shape[0])


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V into its cache slot, in place.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, the cache's dtype and device.
        k_cache, v_cache: one layer's `[num_blocks, block_size, num_kv_heads, head_dim]`.
        slot_mapping: `[num_tokens]` int64 flat slots (`block_id * block_size + offset`),
            distinct and in range (out-of-range slots raise on the CPU).
    """
    _check_cache_write(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    if k_cache.is_cuda:
        from kernels.triton.cache_write import write_kv_cache_triton

        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    check_slots_flattenable(k_cache, "k_cache")
    check_slots_flattenable(v_cache, "v_cache")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    # [num_slots, num_kv_heads, head_dim] views: one row copy per token
    k_cache.view(num_slots, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(num_slots, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference for `write_kv_cache`: split each slot into (block, offset) and assign."""
    block_size = k_cache.shape[1]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[block_ids, offsets] = key
    v_cache[block_ids, offsets] = value
