/* Helpers shared by the C kernels: bfloat16 <-> float32 and a vectorizable exp. Pasted into
   each kernel's source by engine/kernels/native.py:kernel_source (`#include "pd_common.h"`),
   so a change here rebuilds every kernel that uses it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float pd_bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t pd_f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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
