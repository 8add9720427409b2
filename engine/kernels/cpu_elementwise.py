"""The decoder's elementwise steps on the CPU as C kernels: one pass over memory each, where
torch runs three to eight ops (each a pass, a temporary and a dispatch).

- `rope_cpu`: rotary embedding of the fused q/k heads, float32 or bfloat16. Every product
  and sum rounds as torch's `apply_rope_ref` does (no fused multiply-add, bf16 rounding
  after each op), so the result is bit for bit the torch form's.
- `add_rms_norm_cpu`: the residual add and RMSNorm of a bfloat16 row in one pass (the
  sum of squares in float32, in another order than torch's: the last bit can differ).
- `silu_mul_cpu`: `silu(gate) * up` of a bfloat16 fused gate/up output (its `exp` is a
  polynomial within ~2 ulp of float32's).

float32 norms and activations stay torch's: their float32 results must be transformers'
bit for bit (token-exact greedy output), and torch's reduction order and `exp` are not
reproducible here. Each wrapper returns None where its kernel cannot run (no compiler,
another dtype or layout) and the caller runs the torch form. Rows are split over torch's
threads when a call has enough of them to pay for the fork.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.native import kernel_source, labelled, load_library

_SOURCE = kernel_source("elementwise.c")

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_SIGNATURES = {
    "pd_rope_f32": [_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR],
    "pd_rope_bf16": [_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR],
    "pd_add_rms_norm_bf16": [
        _I64,
        _I64,
        _PTR,
        _I64,
        _PTR,
        _I64,
        _PTR,
        ctypes.c_float,
        _PTR,
        _PTR,
    ],  # fmt: skip
    "pd_silu_mul_bf16": [_I64, _I64, _PTR, _I64, _PTR],
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    # No contraction: the rotary's products and sums must round one by one, as torch's do.
    lib = load_library("elementwise", _SOURCE, extra_flags=("-ffp-contract=off",))
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    return lib


def available() -> bool:
    """Whether the C kernels are built and loaded (builds them on first call)."""
    return _library() is not None


def _rows_ok(t: torch.Tensor) -> bool:
    """A CPU matrix whose rows are contiguous (any row stride)."""
    return t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """`apply_rope_ref(x, cos, sin)` bit for bit: `x` `[T, H, D]` (heads contiguous within a
    row, rows strided), `cos`/`sin` `[T, 1, D]` in x's dtype; None where it cannot run."""
    lib = _library()
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return None
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2 or x.stride(2) != 1 or x.stride(1) != head_dim:
        return None
    cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype)
    fn = lib.pd_rope_f32 if x.dtype == torch.float32 else lib.pd_rope_bf16
    with labelled("rope"):
        fn(num_tokens, num_heads, head_dim, x.data_ptr(), x.stride(0), cos.data_ptr(),
           sin.data_ptr(), out.data_ptr())  # fmt: skip
    return out


def add_rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`rms_norm_ref(x, weight, eps, residual)` for bfloat16 rows `[T, hidden]`; None where
    it cannot run."""
    lib = _library()
    if lib is None or x.dtype != torch.bfloat16 or not _rows_ok(x):
        return None
    if weight.dtype != x.dtype or not weight.is_contiguous() or weight.shape != x.shape[1:]:
        return None
    if residual is not None and (
        residual.dtype != x.dtype or residual.shape != x.shape or not _rows_ok(residual)
    ):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = torch.empty(x.shape, dtype=x.dtype)
    res_ptr, res_stride = (
        (None, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
    )
    with labelled("add_rms_norm"):
        lib.pd_add_rms_norm_bf16(x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), res_ptr,
                                 res_stride, weight.data_ptr(), eps, out.data_ptr(),
                                 summed.data_ptr())  # fmt: skip
    return out, summed


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` of a bfloat16 `[T, 2 * inter]` gate/up output; None where it
    cannot run."""
    lib = _library()
    if lib is None or gate_up.dtype != torch.bfloat16 or not _rows_ok(gate_up):
        return None
    if gate_up.shape[1] % 2:
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    with labelled("silu_mul"):
        lib.pd_silu_mul_bf16(gate_up.shape[0], inter, gate_up.data_ptr(), gate_up.stride(0),
                             out.data_ptr())  # fmt: skip
    return out
