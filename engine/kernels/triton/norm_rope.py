"""Triton RMSNorm (residual add fused) and rotary embedding: one program per token
(`engine.kernels.norm_rope` has the torch forms and what each rounds where)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton import row_warps


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.kernels.norm_rope.rms_norm` in one Triton kernel; arguments already checked
    (x, residual and weight of one dtype; rows may be strided, their elements contiguous).
    One program holds a whole row: fine up to Llama-3-70B's hidden size (8,192)."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    if num_tokens == 0:
        return out, new_residual
    res = x if residual is None else residual  # unread without a residual
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        res,
        weight,
        out,
        new_residual,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        new_residual.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=row_warps(block),
    )
    return out, new_residual


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    in_half = dims < HALF
    mask = (heads < num_heads) & in_half
    row = x_ptr + token * stride_xt + heads * stride_xh + dims
    x1 = tl.load(row, mask=mask, other=0.0)  # [BLOCK_H, HALF] first halves
    x2 = tl.load(row + HALF, mask=mask, other=0.0)
    cos1 = tl.load(cos_ptr + token * stride_ct + dims, mask=in_half, other=0.0)
    cos2 = tl.load(cos_ptr + token * stride_ct + HALF + dims, mask=in_half, other=0.0)
    sin1 = tl.load(sin_ptr + token * stride_st + dims, mask=in_half, other=0.0)
    sin2 = tl.load(sin_ptr + token * stride_st + HALF + dims, mask=in_half, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch rounds them
    a1 = (x1.to(tl.float32) * cos1.to(tl.float32)).to(dtype)
    a2 = (x2.to(tl.float32) * cos2.to(tl.float32)).to(dtype)
    b1 = (-x2.to(tl.float32) * sin1.to(tl.float32)).to(dtype)
    b2 = (x1.to(tl.float32) * sin2.to(tl.float32)).to(dtype)
    out = out_ptr + token * stride_ot + heads * stride_oh + dims
    tl.store(out, (a1.to(tl.float32) + b1.to(tl.float32)).to(dtype), mask=mask)
    tl.store(out + HALF, (a2.to(tl.float32) + b2.to(tl.float32)).to(dtype), mask=mask)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`engine.kernels.norm_rope.apply_rope` in one Triton kernel, bit for bit (no fused
    multiply-add: torch multiplies and adds in separate kernels); arguments already checked."""
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    _rope_kernel[(num_tokens,)](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=False,
    )
    return out
