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

from engine.kernels.native import labelled, load_library

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Split rows over threads only for calls big enough to pay for the parallel region. */
#define PD_PARALLEL_MIN_ELEMENTS 65536

static inline float bf(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float rb(float f) { return bf(to_bf(f)); } /* round through bf16 */

/* exp(x): Cephes' polynomial (~2 ulp), vectorizable; x clamped to float's range. */
static inline float pd_exp(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

/* out[t, h, :] = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
   x: [T, H, D] with row stride ldx (elements), head stride D; cos/sin: [T, D]; out: [T, H, D]. */
void pd_rope_f32(int64_t T, int64_t H, int64_t D, const float* x, int64_t ldx,
                 const float* cs, const float* sn, float* out) {
    const int64_t half = D / 2;
#pragma omp parallel for if (T * H * D >= PD_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cs + t * D;
        const float* s = sn + t * D;
        for (int64_t h = 0; h < H; h++) {
            const float* xr = x + t * ldx + h * D;
            float* o = out + (t * H + h) * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i] * c[i];
                const float b = -xr[i + half] * s[i];
                o[i] = a + b;
            }
            for (int64_t i = half; i < D; i++) {
                const float a = xr[i] * c[i];
                const float b = xr[i - half] * s[i];
                o[i] = a + b;
            }
        }
    }
}

void pd_rope_bf16(int64_t T, int64_t H, int64_t D, const uint16_t* x, int64_t ldx,
                  const uint16_t* cs, const uint16_t* sn, uint16_t* out) {
    const int64_t half = D / 2;
#pragma omp parallel for if (T * H * D >= PD_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* c = cs + t * D;
        const uint16_t* s = sn + t * D;
        for (int64_t h = 0; h < H; h++) {
            const uint16_t* xr = x + t * ldx + h * D;
            uint16_t* o = out + (t * H + h) * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = rb(bf(xr[i]) * bf(c[i]));
                const float b = rb(-bf(xr[i + half]) * bf(s[i]));
                o[i] = to_bf(a + b);
            }
            for (int64_t i = half; i < D; i++) {
                const float a = rb(bf(xr[i]) * bf(c[i]));
                const float b = rb(bf(xr[i - half]) * bf(s[i]));
                o[i] = to_bf(a + b);
            }
        }
    }
}

/* sum = x + residual (bf16, written to sum_out), out = weight * bf16(sum * rsqrt(mean(sum^2)
   + eps)). residual may be NULL (sum = x). Rows: [T, n], row strides in elements. */
void pd_add_rms_norm_bf16(int64_t T, int64_t n, const uint16_t* x, int64_t ldx,
                          const uint16_t* residual, int64_t ldr, const uint16_t* weight,
                          float eps, uint16_t* out, uint16_t* sum_out) {
#pragma omp parallel for if (T * n >= PD_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* xr = x + t * ldx;
        uint16_t* sr = sum_out + t * n;
        float ss = 0.f;
        if (residual != NULL) {
            const uint16_t* rr = residual + t * ldr;
            for (int64_t i = 0; i < n; i++) {
                const uint16_t v = to_bf(bf(xr[i]) + bf(rr[i]));
                sr[i] = v;
                ss += bf(v) * bf(v);
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                sr[i] = xr[i];
                ss += bf(xr[i]) * bf(xr[i]);
            }
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        uint16_t* o = out + t * n;
        for (int64_t i = 0; i < n; i++) o[i] = to_bf(bf(weight[i]) * rb(bf(sr[i]) * inv));
    }
}

/* out[t, i] = bf16(bf16(silu(g)) * u), g = gate_up[t, i], u = gate_up[t, inter + i]. */
void pd_silu_mul_bf16(int64_t T, int64_t inter, const uint16_t* gate_up, int64_t ld,
                      uint16_t* out) {
#pragma omp parallel for if (T * inter >= PD_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* g = gate_up + t * ld;
        const uint16_t* u = g + inter;
        uint16_t* o = out + t * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float v = bf(g[i]);
            o[i] = to_bf(rb(v / (1.0f + pd_exp(-v))) * bf(u[i]));
        }
    }
}
"""

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
