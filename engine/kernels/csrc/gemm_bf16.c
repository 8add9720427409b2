/* C kernel source loaded by engine/kernels/gemm_bf16.py (the layout, which kernel runs):
   bfloat16 GEMMs with float32 sums for `y = x @ W (+ bias)`, on AMX tiles
   (`pd_gemm_bf16`) or AVX512-BF16 (`pd_gemm_bf16_avx512`), one packed layout for both. */
#include <immintrin.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "pd_common.h"

#define NB 32      /* output columns per packed block: two 16-column C tiles */
#define KS 32      /* k per tile step: 16 pairs */
#define TILE_ELEMS 512 /* one B tile: 16 pairs x 16 columns x 2 */
#define M_CHUNK 128    /* rows of x that stay in L2 while a thread's blocks pass over them */
#define PF_STEPS 8     /* tile steps of its block a tile row prefetches ahead (AMX) */
#define PF_STEPS_AVX512 32 /* the same without AMX, whose steps take longer on fewer rows */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands AMX's tile state to a process only once it asks. 0 when granted. */
int pd_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tiles 0-3: C (16 x 16 float32); 4, 5: A (16 rows x 32 bf16); 6, 7: B (16 pairs x 32 bf16) */
static void configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* Rows [i, i + rows) of one block's C tiles (`c`, rows x 32 float32) into y, bias added;
   bfloat16 by AVX512-BF16's rounding (to nearest even; subnormals flush to zero). */
static inline void write_rows(const float* c, int64_t i, int rows, int64_t j0, int64_t width,
                              const float* bias, void* y, int64_t ldy, int y_bf16) {
    __m512 b[2];
    __mmask16 m[2];
    for (int v = 0; v < 2; v++) {
        const int64_t n = width - 16 * v;
        m[v] = n >= 16 ? (__mmask16)0xFFFF : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
        b[v] = bias ? _mm512_maskz_loadu_ps(m[v], bias + j0 + 16 * v) : _mm512_setzero_ps();
    }
    for (int r = 0; r < rows; r++) {
        for (int v = 0; v < 2; v++) {
            if (!m[v]) continue;
            const __m512 out = _mm512_add_ps(_mm512_load_ps(c + r * NB + 16 * v), b[v]);
            if (y_bf16) {
                uint16_t* yr = (uint16_t*)y + (i + r) * ldy + j0 + 16 * v;
                _mm256_mask_storeu_epi16(yr, m[v], (__m256i)_mm512_cvtneps_pbh(out));
            } else {
                _mm512_mask_storeu_ps((float*)y + (i + r) * ldy + j0 + 16 * v, m[v], out);
            }
        }
    }
}

/* y[M, N] = x[M, K] @ W (+ bias): x bfloat16 with row stride `ldx`, W packed by
   engine/kernels/gemm_bf16.py:pack (K a multiple of 32), bias float32 or NULL, y float32 or
   (y_bf16) bfloat16 rounded to nearest even, row stride `ldy`. Returns 0, or -1 when the
   scratch for a last partial row tile could not be had (nothing written). */
int pd_gemm_bf16(int64_t M, int64_t K, int64_t N, const uint16_t* x, int64_t ldx,
                 const uint16_t* wp, const float* bias, void* y, int64_t ldy, int y_bf16,
                 int threads) {
    const int64_t nblocks = (N + NB - 1) / NB, steps = K / KS, full = M / 16 * 16;
    uint16_t* pad = NULL; /* the last rows, zero-padded to a whole tile */
    if (full < M) {
        pad = (uint16_t*)calloc((size_t)(16 * K), sizeof(uint16_t));
        if (pad == NULL) return -1;
        for (int64_t r = 0; r < M - full; r++)
            memcpy(pad + r * K, x + (full + r) * ldx, (size_t)K * sizeof(uint16_t));
    }
    #pragma omp parallel num_threads(threads)
    {
        configure();
        float c[32 * NB] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
            const int64_t m1 = m0 + M_CHUNK < M ? m0 + M_CHUNK : M;
            /* guided: long runs of blocks first (the prefetch streams through them), the
               last ones to whichever thread is free (see gemm_f32.c) */
            #pragma omp for schedule(guided)
            for (int64_t jb = 0; jb < nblocks; jb++) {
                const uint16_t* wb = wp + jb * steps * 2 * TILE_ELEMS;
                const int64_t j0 = jb * NB, width = N - j0 < NB ? N - j0 : NB;
                int64_t i = m0;
                for (; i + 32 <= m1 && i + 32 <= full; i += 32) { /* 32 x 32: 4 loads, 4 products */
                    const uint16_t* a = x + i * ldx;
                    const int64_t lda = ldx * (int64_t)sizeof(uint16_t);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t s = 0; s < steps; s++) {
                        const uint16_t* b = wb + s * 2 * TILE_ELEMS;
                        if (s + 2 < steps) { /* the step after next: x's 32 rows, W's tiles */
                            for (int r = 0; r < 32; r++)
                                _mm_prefetch((const char*)(a + r * ldx + (s + 2) * KS), _MM_HINT_T0);
                            const char* p = (const char*)(b + 4 * TILE_ELEMS);
                            for (int off = 0; off < 2 * TILE_ELEMS * 2; off += 64)
                                _mm_prefetch(p + off, _MM_HINT_T0);
                        }
                        _tile_loadd(4, a + s * KS, lda);
                        _tile_loadd(5, a + 16 * ldx + s * KS, lda);
                        _tile_loadd(6, b, 64);
                        _tile_loadd(7, b + TILE_ELEMS, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, c, NB * sizeof(float));
                    _tile_stored(1, c + 16, NB * sizeof(float));
                    _tile_stored(2, c + 16 * NB, NB * sizeof(float));
                    _tile_stored(3, c + 16 * NB + 16, NB * sizeof(float));
                    write_rows(c, i, 32, j0, width, bias, y, ldy, y_bf16);
                }
                for (; i < m1; i += 16) { /* 16 x 32 (a decode step's rows): 3 loads, 2 products */
                    const int partial = i >= full;
                    const uint16_t* a = partial ? pad : x + i * ldx;
                    const int64_t lda = (partial ? K : ldx) * (int64_t)sizeof(uint16_t);
                    _tile_zero(0);
                    _tile_zero(1);
                    for (int64_t s = 0; s < steps; s++) {
                        const uint16_t* b = wb + s * 2 * TILE_ELEMS;
                        if (s + PF_STEPS < steps) {
                            const char* p = (const char*)(b + PF_STEPS * 2 * TILE_ELEMS);
                            for (int off = 0; off < 2 * TILE_ELEMS * 2; off += 64)
                                _mm_prefetch(p + off, _MM_HINT_T0);
                        }
                        _tile_loadd(4, a + s * KS, lda);
                        _tile_loadd(6, b, 64);
                        _tile_loadd(7, b + TILE_ELEMS, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    _tile_stored(0, c, NB * sizeof(float));
                    _tile_stored(1, c + 16, NB * sizeof(float));
                    const int rows = (int)(m1 - i < 16 ? m1 - i : 16);
                    write_rows(c, i, rows, j0, width, bias, y, ldy, y_bf16);
                }
            }
        }
        _tile_release();
    }
    free(pad);
    return 0;
}

/* The same product without AMX (AVX512-BF16: AMD Zen 4 and later, Intel Cooper Lake): a
   B tile's row (one pair of k, 16 columns) is one vector of 32 bfloat16 in `vdpbf16ps`'s
   order, so the AMX layout serves as it is. R rows (at most 8) by a block's 32 columns,
   two accumulators per row; each x pair is broadcast once for both (a broadcast costs
   about what a `vdpbf16ps` does on a Zen 4: one per product halved the rate). */
static inline __attribute__((always_inline)) void dp_tile(
    const int R, int64_t steps, const uint16_t* x, int64_t ldx, const uint16_t* w, float* c) {
    __m512 acc[8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t s = 0; s < steps; s++) {
        const uint16_t* ws = w + s * 2 * TILE_ELEMS;
        for (int p = 0; p < 16; p++) {
            /* every line of the step PF_STEPS_AVX512 ahead, two per pair, into L2 (left to
               the hardware, a decode step's weights streamed 2.3x slower on a Zen 4; into
               L1, 1.3x) */
            const uint16_t* ahead = ws + PF_STEPS_AVX512 * 2 * TILE_ELEMS + p * 32;
            _mm_prefetch((const char*)ahead, _MM_HINT_T1);
            _mm_prefetch((const char*)(ahead + TILE_ELEMS), _MM_HINT_T1);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(ws + p * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(ws + TILE_ELEMS + p * 32);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, x + r * ldx + s * KS + 2 * p, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_store_ps(c + r * NB, acc[r][0]);
        _mm512_store_ps(c + r * NB + 16, acc[r][1]);
    }
}

#define DP_CASE(n) case n: dp_tile(n, steps, a, ldx, w, c); break;

/* `pd_gemm_bf16`'s arguments and result, on AVX512-BF16. */
int pd_gemm_bf16_avx512(int64_t M, int64_t K, int64_t N, const uint16_t* x, int64_t ldx,
                        const uint16_t* wp, const float* bias, void* y, int64_t ldy, int y_bf16,
                        int threads) {
    const int64_t nblocks = (N + NB - 1) / NB, steps = K / KS;
    #pragma omp parallel num_threads(threads)
    {
        float c[8 * NB] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
            const int64_t m1 = m0 + M_CHUNK < M ? m0 + M_CHUNK : M;
            #pragma omp for schedule(guided)
            for (int64_t jb = 0; jb < nblocks; jb++) {
                const uint16_t* w = wp + jb * steps * 2 * TILE_ELEMS;
                const int64_t j0 = jb * NB;
                const int64_t width = N - j0 < NB ? N - j0 : NB;
                for (int64_t i = m0; i < m1; i += 8) {
                    const int R = (int)(m1 - i < 8 ? m1 - i : 8);
                    const uint16_t* a = x + i * ldx;
                    switch (R) {
                        DP_CASE(1) DP_CASE(2) DP_CASE(3) DP_CASE(4) DP_CASE(5) DP_CASE(6)
                        DP_CASE(7) default: dp_tile(8, steps, a, ldx, w, c);
                    }
                    write_rows(c, i, R, j0, width, bias, y, ldy, y_bf16);
                }
            }
        }
    }
    return 0;
}

/* dst[i] = bfloat16(src[i]), rounded to nearest even (as torch's `.to(torch.bfloat16)`). */
void pd_f32_to_bf16_n(int64_t n, const float* src, uint16_t* dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = pd_f32_to_bf16(src[i]);
}
