"""Dense projections on the CPU: `y = x @ W^T + b` on a weight packed once, at load.

`packing` picks, per weight, one of three packed forms (or none):

- `"f32"`: float32 on x86-64 with AVX-512 or AVX2 and FMA, the C GEMM of
  `engine.kernels.gemm_f32`, which sums in the order of MKL's on this CPU (so float32
  greedy output stays token-identical to `transformers`) and streams a decode step's
  weights at several times MKL's rate.
- `"bf16"`: bfloat16 on x86-64 with AMX or AVX512-BF16, the C GEMM of
  `engine.kernels.gemm_bf16`, which the fused decode step calls from C (oneDNN's opaque
  layout only torch can call).
- `"onednn"`: oneDNN, below (bfloat16 where that kernel does not run).

`pack_linear_weight` reorders a weight once, at load, into oneDNN's blocked layout for this
CPU's widest instructions (AVX-512, AVX512-BF16, AMX); `linear` then runs one oneDNN
matmul per call with no reorder. oneDNN picks its kernels by instruction set, not by CPU
vendor, so Intel and AMD processors with the same instructions take the same fast path.

`uses_onednn` says where a model's projections go through it: bfloat16, where oneDNN has
bf16 kernels (AMX on Intel, AVX512-BF16 on AMD); torch's own bf16 matmul also ends in
oneDNN, but reorders the weight on every call. Never float32: oneDNN sums in another order
than MKL (a few ulps), and float32 greedy output must stay token-exact over long
generations; where the C GEMM cannot run in MKL's order, float32 stays with torch
(`linear_ref`).

Elsewhere (CUDA, float16, no oneDNN) callers use `linear_ref`.
"""

from __future__ import annotations

from typing import Literal

import torch

from engine.kernels import gemm_bf16, gemm_f32

Packing = Literal["f32", "bf16", "onednn"]

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Row count oneDNN tunes the packed layout for: a decode step's batch. Measured on a Xeon
# (AVX-512, AMX) for the `small` model's shapes, a layout packed for 16 rows runs a
# prefill's thousands of rows within a few percent of one packed for them.
PACK_ROWS_HINT = 16


def can_pack(weight_t: torch.Tensor) -> bool:
    """Whether `linear` can run this `[in, out]` weight (a CPU tensor oneDNN supports)."""
    if weight_t.device.type != "cpu" or weight_t.dim() != 2:
        return False
    if not torch.backends.mkldnn.is_available() or weight_t.dtype not in PACKABLE_DTYPES:
        return False
    return weight_t.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def uses_onednn(weight_t: torch.Tensor) -> bool:
    """Whether a model's projection with this weight should run packed by oneDNN: bfloat16
    only (see the module docstring for why float32 never does)."""
    return can_pack(weight_t) and weight_t.dtype == torch.bfloat16


def packing(weight_t: torch.Tensor) -> Packing | None:
    """How a model's projection with this `[in, out]` weight runs: `"f32"` or `"bf16"` (the
    C GEMMs), `"onednn"`, or None (`linear_ref` on the dense weight)."""
    if (
        weight_t.device.type == "cpu"
        and weight_t.dtype == torch.float32
        and weight_t.dim() == 2
        and gemm_f32.available()
    ):
        return "f32"
    if gemm_bf16.can_pack(weight_t):
        return "bf16"
    return "onednn" if uses_onednn(weight_t) else None


def pack_linear_weight(weight_t: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed copy of `weight_t` (`[in, out]`) for `linear`, or None where it cannot
    run (`can_pack`). The result is an opaque tensor of logical shape `[out, in]`."""
    if not can_pack(weight_t):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), PACK_ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W^T + bias` for `x` `[num_tokens, in]` and `packed` from `pack_linear_weight`."""
    if x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x must be [num_tokens, {packed.shape[1]}], got {tuple(x.shape)}")
    if x.dtype != packed.dtype:
        raise TypeError(f"x is {x.dtype}, the packed weight {packed.dtype}")
    if bias is not None and (bias.shape != (packed.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{packed.shape[0]}] {x.dtype}, got {tuple(bias.shape)}")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_ref(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch form of `linear` on the unpacked `[in, out]` weight."""
    if bias is None:
        return x @ weight_t
    return torch.addmm(bias, x, weight_t)
