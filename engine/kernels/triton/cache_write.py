"""Triton cache write: one program per token copies its K and V rows into their slot
(dividing by the per-head scales and casting to FP8 for an FP8 cache)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cache_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    # [BLOCK_H, BLOCK_D] tiles of this token's K and V
    k = tl.load(
        key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
        mask=mask,
    )
    v = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
        mask=mask,
    )
    if IS_FP8:
        # [BLOCK_H, 1] per-head scales; div_rn rounds as torch does (plain / is approximate
        # on CUDA); clamp first: casting past 448 gives NaN on CUDA
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)[:, None]
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)[:, None]
        k = tl.minimum(tl.maximum(tl.div_rn(k.to(tl.float32), k_scale), -448.0), 448.0)
        v = tl.minimum(tl.maximum(tl.div_rn(v.to(tl.float32), v_scale), -448.0), 448.0)
        k = k.to(k_cache_ptr.dtype.element_ty)
        v = v.to(v_cache_ptr.dtype.element_ty)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(k_dst + heads[:, None] * stride_kch + dims[None, :] * stride_kcd, k, mask=mask)
    tl.store(v_dst + heads[:, None] * stride_vch + dims[None, :] * stride_vcd, v, mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`engine.kernels.cache_write.write_kv_cache` in Triton; arguments already checked."""
    num_tokens, num_kv_heads, head_dim = key.shape
    is_fp8 = k_scale is not None and v_scale is not None
    _cache_write_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if is_fp8 else slot_mapping,  # unread unless IS_FP8
        v_scale if is_fp8 else slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8,
    )
