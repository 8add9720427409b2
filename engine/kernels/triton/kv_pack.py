"""Triton KV pack/unpack: one program per (block id, chunk of the block's elements)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 1024  # elements of one block copied by one program


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr,
    v_cache_ptr,
    buffer_ptr,
    block_ids_ptr,
    v_offset,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
    PACK: tl.constexpr,
):
    """PACK: cache blocks -> contiguous buffer; else buffer -> cache blocks."""
    index = tl.program_id(0).to(tl.int64)
    elems = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = elems < BLOCK_NUMEL
    block = tl.load(block_ids_ptr + index)
    # element -> (slot, head, dim) of the block, so any cache strides work
    slot = elems // (NUM_KV_HEADS * HEAD_DIM)
    head = (elems // HEAD_DIM) % NUM_KV_HEADS
    dim = elems % HEAD_DIM
    k_ptrs = k_cache_ptr + block * stride_kb + slot * stride_ks + head * stride_kh + dim * stride_kd
    v_ptrs = v_cache_ptr + block * stride_vb + slot * stride_vs + head * stride_vh + dim * stride_vd
    k_buf = buffer_ptr + index * BLOCK_NUMEL + elems
    v_buf = k_buf + v_offset
    if PACK:
        tl.store(k_buf, tl.load(k_ptrs, mask=mask), mask=mask)
        tl.store(v_buf, tl.load(v_ptrs, mask=mask), mask=mask)
    else:
        tl.store(k_ptrs, tl.load(k_buf, mask=mask), mask=mask)
        tl.store(v_ptrs, tl.load(v_buf, mask=mask), mask=mask)


def _launch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    buffer: torch.Tensor,
    block_ids: torch.Tensor,
    pack: bool,
) -> None:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    block_numel = block_size * num_kv_heads * head_dim
    num_ids = block_ids.shape[0]
    grid = (num_ids, triton.cdiv(block_numel, _CHUNK))
    _copy_blocks_kernel[grid](
        k_cache,
        v_cache,
        buffer,
        block_ids,
        num_ids * block_numel,  # where V starts in the buffer
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_NUMEL=block_numel,
        CHUNK=_CHUNK,
        PACK=pack,
    )


def pack_kv_blocks_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor
) -> None:
    """`engine.kernels.kv_pack.pack_kv_blocks` in Triton; `out` is contiguous and checked."""
    _launch(k_cache, v_cache, out, block_ids, pack=True)


def unpack_kv_blocks_triton(
    buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor
) -> None:
    """`engine.kernels.kv_pack.unpack_kv_blocks` in Triton; arguments already checked."""
    _launch(k_cache, v_cache, buffer.contiguous(), block_ids, pack=False)
