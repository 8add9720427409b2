"""KV pack/unpack: gather one layer's blocks into a contiguous buffer and scatter them back.

KV transfer moves a request's blocks, which sit at arbitrary (unsorted, non-contiguous)
ids in the cache; packing them first turns the transfer into one contiguous send.
The buffer layout is `[2 (K, V), num_ids, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kernels._checks import as_block_ids, check_kv_caches
from engine.kernels.fp8 import as_bytes


def packed_shape(k_cache: torch.Tensor, num_ids: int) -> tuple[int, ...]:
    """Shape of the buffer that holds `num_ids` blocks of `k_cache`'s layer (K and V)."""
    return (2, num_ids, *k_cache.shape[1:])


def _check_buffer(buffer: torch.Tensor, k_cache: torch.Tensor, num_ids: int, name: str) -> None:
    expected = packed_shape(k_cache, num_ids)
    if tuple(buffer.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(buffer.shape)}")
    if buffer.dtype != k_cache.dtype:
        raise TypeError(f"{name} dtype {buffer.dtype} != cache dtype {k_cache.dtype}")
    if buffer.device != k_cache.device:
        raise ValueError(f"{name} is on {buffer.device} but the cache is on {k_cache.device}")


def pack_kv_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather blocks `block_ids` of one layer into `[2, num_ids, block_size, kvH, D]`.

    Args:
        k_cache, v_cache: one layer's `[num_blocks, block_size, num_kv_heads, head_dim]`.
        block_ids: the blocks to gather, in the order they appear in the buffer
            (a 1-D int64 tensor on the cache's device, or a list of ints).
        out: optional preallocated contiguous buffer of the packed shape to fill.

    Returns:
        The packed buffer (`out` itself when given).
    """
    check_kv_caches(k_cache, v_cache)
    ids = as_block_ids(block_ids, k_cache.device)
    if out is None:
        out = torch.empty(
            packed_shape(k_cache, ids.shape[0]), dtype=k_cache.dtype, device=k_cache.device
        )
    else:
        _check_buffer(out, k_cache, ids.shape[0], "out")
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    if ids.shape[0] == 0:
        return out
    if k_cache.is_cuda:
        from engine.kernels.triton.kv_pack import pack_kv_blocks_triton

        pack_kv_blocks_triton(as_bytes(k_cache), as_bytes(v_cache), ids, as_bytes(out))
        return out
    # index_select writes straight into the (contiguous, right-sized) halves of `out`
    torch.index_select(k_cache, 0, ids, out=out[0])
    torch.index_select(v_cache, 0, ids, out=out[1])
    return out


def unpack_kv_blocks(
    buffer: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
) -> None:
    """Scatter a packed buffer back into blocks `block_ids` of one layer, in place.

    Args:
        buffer: `[2, num_ids, block_size, num_kv_heads, head_dim]` as `pack_kv_blocks` makes.
        k_cache, v_cache: the destination layer's caches.
        block_ids: destination block of each buffer entry; distinct ids (with duplicates,
            which entry lands is unspecified).
    """
    check_kv_caches(k_cache, v_cache)
    ids = as_block_ids(block_ids, k_cache.device)
    _check_buffer(buffer, k_cache, ids.shape[0], "buffer")
    if ids.shape[0] == 0:
        return
    if k_cache.is_cuda:
        from engine.kernels.triton.kv_pack import unpack_kv_blocks_triton

        unpack_kv_blocks_triton(as_bytes(buffer), as_bytes(k_cache), as_bytes(v_cache), ids)
        return
    # FP8 moves as bytes (no FP8 index_copy_ on the CPU); the values are not touched
    as_bytes(k_cache).index_copy_(0, ids, as_bytes(buffer[0]))
    as_bytes(v_cache).index_copy_(0, ids, as_bytes(buffer[1]))


def pack_kv_blocks_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """Reference for `pack_kv_blocks`: advanced indexing, then stack K over V."""
    ids = as_block_ids(block_ids, k_cache.device)
    return torch.stack([k_cache[ids], v_cache[ids]])


def unpack_kv_blocks_ref(
    buffer: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
) -> None:
    """Reference for `unpack_kv_blocks`: one block at a time."""
    ids = as_block_ids(block_ids, k_cache.device)
    for i, block_id in enumerate(ids.tolist()):
        k_cache[block_id] = buffer[0, i]
        v_cache[block_id] = buffer[1, i]
