"""The decoder's elementwise steps on the CPU as C kernels: one pass over memory each, where
torch runs three to eight ops (each a pass, a temporary and a dispatch).

- `rope_cpu`: rotary embedding of the fused q/k heads, float32 or bfloat16. Every product
  and sum rounds as torch's `apply_rope_ref` does (no fused multiply-add, bf16 rounding
  after each op), so the result is bit for bit the torch form's.
- `add_rms_norm_cpu`: the residual add and RMSNorm of a float32 or bfloat16 row in one
  pass. In float32 the sum of squares follows torch's x86 sum kernel op for op (8-lane
  vectors, four accumulators, its cascade), so the norm is bit for bit `F.rms_norm`; in
  bfloat16 it sums in another order (the last bit can differ).
- `silu_mul_cpu`: `silu(gate) * up` of a fused gate/up output. In float32 its `exp` is
  the one torch's vectorized silu uses (SLEEF's expf_u10, fused multiply-adds and all), so
  the result is bit for bit torch's; in bfloat16 a polynomial within ~2 ulp.

float32 output must stay transformers' token for token; keeping each float32 kernel bit for
bit the torch form (as `engine.kernels.gemm_f32` keeps torch's sum order) makes that hold by
construction rather than by luck at near-ties (a 1-ulp norm, tried first, flipped one of
sixteen `bench engine` rows at token 104). The torch forms took ~5 ms of a ~51 ms float32
decode step (about ten dispatches per norm). Where the exact form cannot be promised (not
x86, a row under 8 floats, a gate width not a multiple of 16) the wrappers return None.
Each wrapper returns None where its kernel cannot run (no compiler, another dtype or
layout) and the caller runs the torch form. Rows are split over torch's threads when a
call has enough of them to pay for the fork.
"""

from __future__ import annotations

import ctypes
import functools
import platform

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
_SIGNATURES["pd_add_rms_norm_f32"] = _SIGNATURES["pd_add_rms_norm_bf16"]
_SIGNATURES["pd_silu_mul_f32"] = _SIGNATURES["pd_silu_mul_bf16"]
_FLOATS = (torch.float32, torch.bfloat16)
_X86 = platform.machine().lower() in ("x86_64", "amd64")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.cache
def _library() -> ctypes.CDLL | None:
    # No contraction or reassociation: products and sums round one by one, in the order
    # written (torch's, for the rotary and the float32 norm and gate).
    lib = load_library(
        "elementwise", _SOURCE, extra_flags=("-ffp-contract=off", "-fno-associative-math")
    )
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
    """`rms_norm_ref(x, weight, eps, residual)` for float32 or bfloat16 rows `[T, hidden]`;
    None where it cannot run."""
    lib = _library()
    if lib is None or x.dtype not in _FLOATS or not _rows_ok(x):
        return None
    if x.dtype == torch.float32 and not exact_float32_norm(x.shape[1]):
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
    args = (x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), res_ptr, res_stride,
            weight.data_ptr(), eps, out.data_ptr(), summed.data_ptr())  # fmt: skip
    with labelled("add_rms_norm"):
        fn = lib.pd_add_rms_norm_f32 if x.dtype == torch.float32 else lib.pd_add_rms_norm_bf16
        fn(*args)
    return out, summed


def exact_float32_norm(hidden: int) -> bool:
    """Whether the float32 norm of `hidden`-wide rows runs here bit for bit torch's: on x86,
    with at least one 8-lane vector (narrower rows take torch's scalar sum)."""
    return _X86 and hidden >= 8


def exact_float32_gate(inter: int) -> bool:
    """Whether the float32 gate of `inter` columns runs here bit for bit torch's: on x86,
    with no element in torch's scalar tail (`inter` a multiple of the widest vector)."""
    return _X86 and inter % 16 == 0


def silu_mul_cpu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """`silu(gate) * up` of a float32 or bfloat16 `[T, 2 * inter]` gate/up output (into
    `out`, contiguous `[T, inter]` of its dtype, where given); None where it cannot run."""
    lib = _library()
    if lib is None or gate_up.dtype not in _FLOATS or not _rows_ok(gate_up):
        return None
    if gate_up.shape[1] % 2 or (
        gate_up.dtype == torch.float32 and not exact_float32_gate(gate_up.shape[1] // 2)
    ):
        return None
    inter = gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    elif out.shape != (gate_up.shape[0], inter) or out.dtype != gate_up.dtype:
        raise ValueError(f"out must be [{gate_up.shape[0]}, {inter}] {gate_up.dtype}")
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    fn = getattr(lib, f"pd_silu_mul_{_SUFFIX[gate_up.dtype]}")
    with labelled("silu_mul"):
        fn(gate_up.shape[0], inter, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr())
    return out
