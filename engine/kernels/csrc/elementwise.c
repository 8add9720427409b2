/* C kernel source loaded by engine/kernels/cpu_elementwise.py (what each computes, the torch references). */
#include "pd_common.h"

/* Split rows over threads only for calls big enough to pay for the parallel region. */
#define PD_PARALLEL_MIN_ELEMENTS 65536

#define bf pd_bf16_to_f32
#define to_bf pd_f32_to_bf16
static inline float rb(float f) { return bf(to_bf(f)); } /* round through bf16 */

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
