"""RMSNorm (with the residual add before it), rotary embedding and the SiLU gate, as the
decoder runs them.

On the CPU each runs as a C kernel (`engine.kernels.cpu_elementwise`: one pass instead of
five to eight ops; the rotary, and in float32 the norm and gate, bit for bit the torch
forms, the bfloat16 norm and gate within an ulp or two); the torch forms below are the
references. On CUDA each is one Triton kernel
(`engine.kernels.triton.norm_rope`): in an eager step the torch forms launch eight kernels
per norm and six per rotary, about half of a step's kernels, and the host time to launch
them set an eager step's pace (BENCHMARKS.md, the H200 profile).

Numerics follow `transformers`: the residual add and every product round to the model
dtype where torch's would; the norm's statistic is taken in float32. The Triton rotary is
bit for bit the torch form; the Triton norm sums in another order (and its mean's division
and rsqrt are approximate, as torch's rsqrt is), so a bf16 or fp16 value can differ in its
last bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cpu_elementwise import add_rms_norm_cpu, rope_cpu, silu_mul_cpu

LOW_PRECISION = (torch.bfloat16, torch.float16)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual) * weight, x + residual)` over the last dimension of `x`
    `[num_tokens, hidden]` (`residual` None: nothing added, and `x` itself comes back as
    the new residual)."""
    if x.is_cuda and x.dtype in LOW_PRECISION and weight.dtype == x.dtype:
        from engine.kernels.triton.norm_rope import rms_norm_triton

        _check_rows(x, weight, residual)
        return rms_norm_triton(x, weight, eps, residual)
    if x.device.type == "cpu":
        fused = add_rms_norm_cpu(x, weight, eps, residual)
        if fused is not None:
            return fused
    return rms_norm_ref(x, weight, eps, residual)


def _check_rows(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """What the Triton norm reads: `[num_tokens, hidden]` rows whose elements are contiguous,
    a contiguous weight, and a residual like `x` in `x`'s dtype."""
    if x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"x must be [num_tokens, hidden] with contiguous rows, got {x.stride()}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must be like x {tuple(x.shape)}")
    if residual is not None and residual.dtype != x.dtype:
        raise TypeError(f"residual is {residual.dtype}, x is {x.dtype}")


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of `rms_norm` (transformers' `LlamaRMSNorm` after the residual add)."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    if dtype == torch.float32:  # one fused op; same math as below when no cast is needed
        return F.rms_norm(x, weight.shape, weight, eps), x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype), x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` `[num_tokens, num_heads, head_dim]` (rows may be strided,
    as a split of the fused QKV output is) with `cos`/`sin` `[num_tokens, 1, head_dim]`
    (each half of a row holds the same frequencies); a new contiguous tensor."""
    if x.is_cuda:
        from engine.kernels.triton.norm_rope import apply_rope_triton

        if x.stride(2) != 1 or cos.stride(2) != 1 or sin.stride(2) != 1:
            raise ValueError("x, cos and sin need contiguous head_dim")
        if cos.dtype != x.dtype or sin.dtype != x.dtype:
            raise TypeError(f"cos/sin {cos.dtype}/{sin.dtype} must be x's dtype {x.dtype}")
        if x.shape[2] % 2:
            raise ValueError(f"head_dim must be even, got {x.shape[2]}")
        return apply_rope_triton(x, cos, sin)
    rotated = rope_cpu(x, cos, sin)
    return apply_rope_ref(x, cos, sin) if rotated is None else rotated


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch form of `apply_rope` (transformers' `rotate_half` form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) * up` of a fused gate/up projection `[num_tokens, 2 * inter]` (gate the
    first half); a C kernel on the CPU (into `out` where given), else the torch form."""
    if gate_up.device.type == "cpu":
        fused = silu_mul_cpu(gate_up, out)
        if fused is not None:
            return fused
    return silu_and_mul_ref(gate_up)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch form of `silu_and_mul` (transformers' `act_fn(gate) * up`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
