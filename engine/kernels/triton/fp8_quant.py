"""Triton per-token FP8 quantization of activations: one program per row computes the
row's absolute maximum, its scale and the FP8 values in one pass (the torch form,
`engine.kernels.fp8.quantize_per_token`, takes eight kernels, run before every FP8
projection of a step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_TOKEN_SCALE
from engine.kernels.triton import row_warps


@triton.jit
def _per_token_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_q,
    num_cols,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # A NaN makes the row's scale NaN, hence the whole row NaN, as torch's amax does
    # (Triton's max skips NaNs): a numerical blow-up stays visible.
    amax = tl.max(tl.abs(x), axis=0)
    amax = tl.where(tl.sum((x != x).to(tl.int32), axis=0) > 0, float("nan"), amax)
    # div_rn rounds as torch does (plain / is approximate on CUDA); clamp before the
    # cast: past 448 it gives NaN on CUDA
    # (the NaN policy is named in each call: the compiler takes no local enum value)
    scale = tl.maximum(tl.div_rn(amax, FP8_MAX), MIN_SCALE, propagate_nan=tl.PropagateNan.ALL)
    q = tl.maximum(tl.div_rn(x, scale), -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    q = tl.minimum(q, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.kernels.fp8.quantize_per_token` in one Triton kernel: `x` `[rows, cols]`
    (each row's elements contiguous) to FP8 values and float32 scales `[rows, 1]`, bit for
    bit for finite rows; a row holding a NaN comes out all NaN, as there. One program holds
    a whole row: fine up to Llama-3-70B's widest input (28,672)."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"each row of x must be contiguous, got strides {x.stride()}")
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = triton.next_power_of_2(cols)
    _per_token_quant_kernel[(rows,)](
        x,
        q,
        scale,
        x.stride(0),
        q.stride(0),
        cols,
        FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_TOKEN_SCALE,
        BLOCK=block,
        num_warps=row_warps(block),
    )
    return q, scale
