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
        if (residual != NULL) {
            const uint16_t* rr = residual + t * ldr;
            for (int64_t i = 0; i < n; i++) sr[i] = to_bf(bf(xr[i]) + bf(rr[i]));
        } else {
            memcpy(sr, xr, (size_t)n * sizeof(uint16_t));
        }
        /* 16 running sums (vectorizable without reassociating), then joined in order */
        float part[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) part[j] += bf(sr[i + j]) * bf(sr[i + j]);
        float ss = 0.f;
        for (; i < n; i++) ss += bf(sr[i]) * bf(sr[i]);
        for (int j = 0; j < 16; j++) ss += part[j];
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

/* float32 forms of the two kernels above: transformers' float32 norm and gate. */

static inline int64_t pd_ceil_log2(int64_t x) { /* torch's CeilLog2 */
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v != 0; v >>= 1) bits++;
    return bits;
}

/* sum(v * v) over a row as torch sums `v.pow(2)` over a contiguous last dimension on x86,
   op for op (its CPU sum kernel: vectorized_inner_sum -> row_sum -> multi_row_sum): 8-lane
   vectors (the sum kernel's width at every x86 dispatch level, AVX-512 included, checked
   against torch in tests/engine/kernels), taken four at a time into four accumulators with
   a cascade of levels every 16 groups, the leftover vectors into the first accumulator,
   the four joined, then the scalar leftover and the 8 lanes added in order. */
#define PD_SUM_LANES 8
static float pd_torch_sum_squares(const float* v, int64_t n) {
    const int W = PD_SUM_LANES;
    float acc[4][4][PD_SUM_LANES]; /* [level][accumulator][lane] */
    memset(acc, 0, sizeof acc);
    const int64_t num_vecs = n / W, rows = num_vecs / 4;
    int64_t power = pd_ceil_log2(rows) / 4;
    power = power < 4 ? 4 : power;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < W; l++) {
                    const float x = v[(i * 4 + k) * W + l];
                    acc[0][k][l] += x * x;
                }
        for (int level = 1; level < 4; level++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < W; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.f;
                }
            if ((i & (mask << (level * power))) != 0) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < W; l++) {
                const float x = v[(i * 4 + k) * W + l];
                acc[0][k][l] += x * x;
            }
    for (int level = 1; level < 4; level++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < W; l++) acc[0][k][l] += acc[level][k][l];
    for (int64_t q = rows * 4; q < num_vecs; q++)
        for (int l = 0; l < W; l++) {
            const float x = v[q * W + l];
            acc[0][0][l] += x * x;
        }
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < W; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.f;
    for (int64_t q = num_vecs * W; q < n; q++) total += v[q] * v[q];
    for (int l = 0; l < W; l++) total += acc[0][0][l];
    return total;
}

/* sum = x + residual (written to sum_out), out = (sum * rsqrt(mean(sum^2) + eps)) * weight:
   bit for bit torch's float32 `rms_norm` (pow, mean as a sum and a division, add, rsqrt,
   two products). */
void pd_add_rms_norm_f32(int64_t T, int64_t n, const float* x, int64_t ldx,
                                     const float* residual, int64_t ldr, const float* weight,
                                     float eps, float* out, float* sum_out) {
#pragma omp parallel for if (T * n >= PD_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float* xr = x + t * ldx;
        float* sr = sum_out + t * n;
        if (residual != NULL) {
            const float* rr = residual + t * ldr;
            for (int64_t i = 0; i < n; i++) sr[i] = xr[i] + rr[i];
        } else {
            memcpy(sr, xr, (size_t)n * sizeof(float));
        }
        const float mean = pd_torch_sum_squares(sr, n) / (float)n;
        const float inv = 1.0f / sqrtf(mean + eps);
        float* o = out + t * n;
        for (int64_t i = 0; i < n; i++) o[i] = (sr[i] * inv) * weight[i];
    }
}

static inline float pd_pow2i(int32_t e) { /* 2^e for a normal exponent */
    const int32_t bits = (e + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* exp(d) as torch's vectorized float `exp` computes it on x86 (SLEEF's expf_u10: a degree-6
   polynomial with fused multiply-adds, then two scalings by powers of two), bit for bit. */
static inline float pd_torch_expf(float d) {
    const int32_t q = (int32_t)rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    const float qf = (float)q;
    float s = fmaf(qf, -0.693145751953125f, d);
    s = fmaf(qf, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    u = u * pd_pow2i(q >> 1);
    u = u * pd_pow2i(q - (q >> 1));
    if (d < -104.f) u = 0.f;
    if (d > 100.f) u = INFINITY;
    return u;
}

/* out[t, i] = silu(g) * u, silu(g) = g / (1 + exp(-g)), g and u as in pd_silu_mul_bf16:
   bit for bit torch's `F.silu(gate) * up` (its vectorized silu; `inter` a multiple of 16,
   so no element takes its scalar tail). */
void pd_silu_mul_f32(int64_t T, int64_t inter, const float* gate_up, int64_t ld,
                                 float* out) {
#pragma omp parallel for if (T * inter >= PD_PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float* g = gate_up + t * ld;
        const float* u = g + inter;
        float* o = out + t * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float silu = g[i] / (1.0f + pd_torch_expf(-g[i]));
            o[i] = silu * u[i];
        }
    }
}
