/* C kernel source loaded by engine/kernels/decode_attention.py (the arguments, the torch reference). */
#include <stdlib.h>

#include "pd_common.h"

typedef struct {
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    const void* q; /* [num_seqs, num_heads, head_dim], head_dim contiguous */
    int64_t q_seq_stride, q_head_stride; /* in elements */
    const void* k_cache; /* [num_blocks, block_size, num_kv_heads, head_dim], contiguous */
    const void* v_cache;
    const int64_t* block_tables; /* [num_seqs, table_stride] */
    int64_t table_stride;
    const int64_t* seq_lens; /* [num_seqs] */
    int64_t max_seq_len;
    float scale;
    void* out; /* [num_seqs, num_heads, head_dim], contiguous */
} pd_decode_args;

static inline __attribute__((always_inline)) float load(const void* p, int64_t i, int bf16) {
    return bf16 ? pd_bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline __attribute__((always_inline)) void store(void* p, int64_t i, float f, int bf16) {
    if (bf16) ((uint16_t*)p)[i] = pd_f32_to_bf16(f);
    else ((float*)p)[i] = f;
}

/* Sequence s's output rows `[H, D]` from the float32 sums `acc` (bfloat16: rounded). */
static inline __attribute__((always_inline)) void store_out(
    const pd_decode_args* a, int bf16, const int64_t head_dim, int64_t s, const float* acc) {
    const int64_t n = a->num_heads * head_dim;
    for (int64_t i = 0; i < n; i++) store(a->out, s * n + i, acc[i], bf16);
}

/* Scores `sc[0:n]` whose largest is `max` -> their softmax, in place. */
static inline void normalize(float* restrict sc, int64_t n, float max) {
    float sum = 0.f;
    for (int64_t t = 0; t < n; t++) {
        sc[t] = pd_exp(sc[t] - max);
        sum += sc[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) sc[t] *= inv;
}

static inline void prefetch_block(const void* cache, int64_t block, int64_t block_bytes) {
    const char* p = (const char*)cache + block * block_bytes;
    for (int64_t off = 0; off < block_bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* One sequence: every query head over its keys; each K/V row (all kv heads, contiguous in
   the cache) is read once. `head_dim` is a constant at the common call sites (inlined), so
   the loops over it unroll. The next block is prefetched: blocks sit at random addresses,
   where the hardware prefetcher cannot follow. */
static inline __attribute__((always_inline)) void attend(
    const pd_decode_args* a, int bf16, const int64_t head_dim, int64_t s,
    float* restrict scores /* [num_heads, seq_len] */, float* restrict acc /* [H, D] */,
    float* restrict qf /* [H, D] */) {
    const int64_t num_heads = a->num_heads;
    const int64_t group = num_heads / a->num_kv_heads;
    const int64_t kv_stride = a->num_kv_heads * head_dim;
    const int64_t block_size = a->block_size;
    const int64_t block_bytes = block_size * kv_stride * (bf16 ? 2 : 4);
    const int64_t seq_len = a->seq_lens[s];
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    const int64_t* table = a->block_tables + s * a->table_stride;
    for (int64_t h = 0; h < num_heads; h++)
        for (int64_t d = 0; d < head_dim; d++)
            qf[h * head_dim + d] =
                load(a->q, s * a->q_seq_stride + h * a->q_head_stride + d, bf16) * a->scale;
    for (int64_t b = 0; b < num_blocks; b++) {
        if (b + 1 < num_blocks) prefetch_block(a->k_cache, table[b + 1], block_bytes);
        else prefetch_block(a->v_cache, table[0], block_bytes);
        const int64_t t0 = b * block_size;
        const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        for (int64_t j = 0; j < n; j++) {
            const int64_t row = (table[b] * block_size + j) * kv_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const float* restrict qr = qf + h * head_dim;
                const int64_t k0 = row + (h / group) * head_dim;
                float dot = 0.f;
                for (int64_t d = 0; d < head_dim; d++)
                    dot += qr[d] * load(a->k_cache, k0 + d, bf16);
                scores[h * seq_len + t0 + j] = dot;
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float* restrict sc = scores + h * seq_len;
        float m = -INFINITY;
        for (int64_t t = 0; t < seq_len; t++) m = sc[t] > m ? sc[t] : m;
        normalize(sc, seq_len, m);
    }
    for (int64_t i = 0; i < num_heads * head_dim; i++) acc[i] = 0.f;
    for (int64_t b = 0; b < num_blocks; b++) {
        if (b + 1 < num_blocks) prefetch_block(a->v_cache, table[b + 1], block_bytes);
        const int64_t t0 = b * block_size;
        const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        for (int64_t j = 0; j < n; j++) {
            const int64_t row = (table[b] * block_size + j) * kv_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[h * seq_len + t0 + j];
                const int64_t v0 = row + (h / group) * head_dim;
                float* restrict ah = acc + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++)
                    ah[d] += p * load(a->v_cache, v0 + d, bf16);
            }
        }
    }
    store_out(a, bf16, head_dim, s, acc);
}

/* What every vectorized `attend_*` reads of sequence `s`, computed once; `seq_begin` also
   writes its scaled queries into `qf` `[H, D]` and brings its first two K blocks into L2
   whole (before any work to overlap: blocks sit at random addresses, where the hardware
   prefetcher cannot follow). */
typedef struct {
    int64_t num_heads, num_kv_heads, group, kv_stride, block_size, esize, block_bytes;
    int64_t seq_len, num_blocks, row_bytes; /* row_bytes: one kv head's K or V row */
    const int64_t* table;
    const char *kc, *vc;
} pd_seq;

static inline __attribute__((always_inline)) pd_seq seq_begin(
    const pd_decode_args* a, int bf16, const int64_t head_dim, int64_t s, float* restrict qf) {
    pd_seq v;
    v.num_heads = a->num_heads;
    v.num_kv_heads = a->num_kv_heads;
    v.group = v.num_heads / v.num_kv_heads;
    v.kv_stride = v.num_kv_heads * head_dim;
    v.block_size = a->block_size;
    v.esize = bf16 ? 2 : 4;
    v.block_bytes = v.block_size * v.kv_stride * v.esize;
    v.seq_len = a->seq_lens[s];
    v.num_blocks = (v.seq_len + v.block_size - 1) / v.block_size;
    v.row_bytes = head_dim * v.esize;
    v.table = a->block_tables + s * a->table_stride;
    v.kc = (const char*)a->k_cache;
    v.vc = (const char*)a->v_cache;
    for (int64_t h = 0; h < v.num_heads; h++)
        for (int64_t d = 0; d < head_dim; d++)
            qf[h * head_dim + d] =
                load(a->q, s * a->q_seq_stride + h * a->q_head_stride + d, bf16) * a->scale;
    for (int64_t b = 0; b < 2 && b < v.num_blocks; b++)
        for (int64_t off = 0; off < v.block_bytes; off += 64)
            __builtin_prefetch(v.kc + v.table[b] * v.block_bytes + off, 0, 2);
    return v;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 elements (float32 or bfloat16) as float32 */
static inline __m512 ld16(const void* p, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    return _mm512_loadu_ps((const float*)p);
}

/* lane j of the result = the sum of the 16 lanes of a[j] */
static inline __m512 reduce16(const __m512* a) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

/* The same as `attend` with AVX-512: per kv head, the scores of 16 keys at a time (one
   reduction tree for 16 dot products), and P.V with the group's accumulators in registers.
   Needs head_dim % 16 == 0 and block_size % 16 == 0. */
static inline __attribute__((always_inline)) void attend_avx512(
    const pd_decode_args* a, int bf16, const int64_t head_dim, int64_t s,
    float* restrict scores, float* restrict acc, float* restrict qf,
    float* restrict ktile /* [16, head_dim] */) {
    const pd_seq sq = seq_begin(a, bf16, head_dim, s, qf);
    const int64_t num_heads = sq.num_heads, num_kv_heads = sq.num_kv_heads, group = sq.group;
    const int64_t kv_stride = sq.kv_stride, block_size = sq.block_size, esize = sq.esize;
    const int64_t block_bytes = sq.block_bytes, seq_len = sq.seq_len;
    const int64_t num_blocks = sq.num_blocks, row_bytes = sq.row_bytes, *table = sq.table;
    const char *kc = sq.kc, *vc = sq.vc;
    const int64_t chunks = head_dim / 16;
    for (int64_t b = 0; b < num_blocks; b++) {
        /* (the first two K blocks came into L2 whole, above, before any work to overlap)
           blocks sit at random addresses, where the hardware prefetcher cannot follow. While
           this K block is scored, the same rows of the K block two ahead and of this
           position's V block come into L2, a few lines per key (a whole block at once fills
           the line-fill buffers and stalls): the P.V pass then reads V from L2 (a
           sequence's V fits there), and the memory traffic of both passes overlaps the
           scoring (1.2x the kernel's speed on a Zen 4, float32, than the next block's rows
           into L1). */
        const char* next = b + 2 < num_blocks ? kc + table[b + 2] * block_bytes : NULL;
        const char* vnext = vc + table[b] * block_bytes;
        const int64_t t0 = b * block_size;
        const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t m = n - j0 < 16 ? n - j0 : 16;
            const char* rows = kc + ((table[b] * block_size + j0) * kv_stride) * esize;
            for (int64_t hk = 0; hk < num_kv_heads; hk++) {
                for (int j = 0; j < 16; j++)
                    for (int64_t off = 0; off < row_bytes; off += 64) {
                        const int64_t at = ((j0 + j) * kv_stride + hk * head_dim) * esize + off;
                        if (next != NULL) __builtin_prefetch(next + at, 0, 2);
                        __builtin_prefetch(vnext + at, 0, 2);
                    }
#if defined(__AVX512BF16__)
                if (bf16 && head_dim % 32 == 0 && head_dim <= 256) {
                    /* bfloat16 q and K as they are: `vdpbf16ps` multiplies 32 pairs of them
                       (products exact in float32) into 16 float32 sums, no conversion of K;
                       the scale applies to each score after (1.2x the kernel, bfloat16, on a
                       Zen 4) */
                    const int64_t npairs = head_dim / 32;
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t h = hk * group + g;
                        const uint16_t* qh =
                            (const uint16_t*)a->q + s * a->q_seq_stride + h * a->q_head_stride;
                        __m512bh qv[8];
                        for (int64_t c = 0; c < npairs; c++)
                            qv[c] = (__m512bh)_mm512_loadu_si512((const void*)(qh + 32 * c));
                        __m512 dots[16];
                        for (int j = 0; j < 16; j++) {
                            const uint16_t* kr =
                                (const uint16_t*)rows + j * kv_stride + hk * head_dim;
                            __m512 d = _mm512_setzero_ps();
                            for (int64_t c = 0; c < npairs; c++)
                                d = _mm512_dpbf16_ps(
                                    d, qv[c], (__m512bh)_mm512_loadu_si512((const void*)(kr + 32 * c)));
                            dots[j] = d;
                        }
                        _mm512_mask_storeu_ps(
                            scores + h * seq_len + t0 + j0, (__mmask16)((1u << m) - 1u),
                            _mm512_mul_ps(reduce16(dots), _mm512_set1_ps(a->scale)));
                    }
                    continue;
                }
#endif
                /* the 16 keys of this kv head as float32 (bf16 converted once, not per head) */
                const float* kt;
                if (bf16) {
                    for (int j = 0; j < 16; j++)
                        for (int64_t c = 0; c < chunks; c++)
                            _mm512_storeu_ps(
                                ktile + j * head_dim + 16 * c,
                                ld16(rows + (j * kv_stride + hk * head_dim + 16 * c) * 2, 1));
                    kt = ktile;
                } else {
                    kt = (const float*)rows + hk * head_dim;
                }
                const int64_t kt_stride = bf16 ? head_dim : kv_stride;
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = hk * group + g;
                    const float* qh = qf + h * head_dim;
                    __m512 dots[16];
                    for (int j = 0; j < 16; j++) {
                        const float* kr = kt + j * kt_stride;
                        __m512 d = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kr));
                        for (int64_t c = 1; c < chunks; c++)
                            d = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c),
                                                _mm512_loadu_ps(kr + 16 * c), d);
                        dots[j] = d;
                    }
                    _mm512_mask_storeu_ps(scores + h * seq_len + t0 + j0,
                                          (__mmask16)((1u << m) - 1u), reduce16(dots));
                }
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float* restrict sc = scores + h * seq_len;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 16 <= seq_len; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sc + i));
        float mx = _mm512_reduce_max_ps(vmax);
        for (; i < seq_len; i++) mx = sc[i] > mx ? sc[i] : mx;
        normalize(sc, seq_len, mx);
    }
    for (int64_t i = 0; i < num_heads * head_dim; i++) acc[i] = 0.f;
    for (int64_t b = 0; b < num_blocks; b++) {
        const char* next = b + 1 < num_blocks ? vc + table[b + 1] * block_bytes : NULL;
        const int64_t t0 = b * block_size;
        const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        for (int64_t hk = 0; hk < num_kv_heads; hk++) {
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t gn = group - g0 < 4 ? group - g0 : 4;
                for (int64_t c = 0; c < chunks; c++) {
                    __m512 o[4];
                    for (int64_t g = 0; g < gn; g++)
                        o[g] = _mm512_loadu_ps(acc + (hk * group + g0 + g) * head_dim + 16 * c);
                    for (int64_t j = 0; j < n; j++) {
                        if (next != NULL && g0 == 0 && 64 * c < row_bytes)  /* spread */
                            __builtin_prefetch(
                                next + (j * kv_stride + hk * head_dim) * esize + 64 * c, 0, 3);
                        const char* vr =
                            vc + (((table[b] * block_size + j) * kv_stride) + hk * head_dim +
                                  16 * c) * esize;
                        const __m512 v = ld16(vr, bf16);
                        for (int64_t g = 0; g < gn; g++)
                            o[g] = _mm512_fmadd_ps(
                                _mm512_set1_ps(scores[(hk * group + g0 + g) * seq_len + t0 + j]),
                                v, o[g]);
                    }
                    for (int64_t g = 0; g < gn; g++)
                        _mm512_storeu_ps(acc + (hk * group + g0 + g) * head_dim + 16 * c, o[g]);
                }
            }
        }
    }
    store_out(a, bf16, head_dim, s, acc);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 elements (float32 or bfloat16) as float32 */
static inline __m256 ld8(const void* p, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
    return _mm256_loadu_ps((const float*)p);
}

static inline __m128i first_lanes4(int64_t n) {
    return _mm_cmpgt_epi32(_mm_set1_epi32((int)n), _mm_setr_epi32(0, 1, 2, 3));
}

/* Scores of GN query heads (consecutive, one kv head) against 4 keys: q `[GN, head_dim]`
   (scaled), keys `kt + j * kt_stride`; the first m (<= 4) go to `out + g * seq_len`. 12
   sums in registers, so each K vector loaded serves GN heads. */
static inline __attribute__((always_inline)) void score4(
    const int GN, const float* restrict q, int64_t head_dim, const float* restrict kt,
    int64_t kt_stride, float* restrict out, int64_t seq_len, int64_t m) {
    __m256 acc[3][4];
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < head_dim; c += 8) {
        __m256 k[4];
        for (int j = 0; j < 4; j++) k[j] = _mm256_loadu_ps(kt + j * kt_stride + c);
        for (int g = 0; g < GN; g++) {
            const __m256 qv = _mm256_loadu_ps(q + g * head_dim + c);
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(qv, k[j], acc[g][j]);
        }
    }
    for (int g = 0; g < GN; g++) {
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]),
                                        _mm256_hadd_ps(acc[g][2], acc[g][3]));
        const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        if (m == 4) _mm_storeu_ps(out + g * seq_len, sums);
        else _mm_maskstore_ps(out + g * seq_len, first_lanes4(m), sums);
    }
}

/* acc[g, c0 : c0 + 8 * CN] += sum over the n keys j of p[g, j] * V[j, c0 : ...] for GN
   heads: 12 sums in registers, so each V vector loaded serves GN heads. */
static inline __attribute__((always_inline)) void weigh(
    const int GN, const int CN, int bf16, const char* restrict v0, int64_t v_stride_bytes,
    int64_t n, const float* restrict p, int64_t seq_len, float* restrict acc,
    int64_t head_dim) {
    __m256 o[3][4];
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CN; c++) o[g][c] = _mm256_loadu_ps(acc + g * head_dim + 8 * c);
    for (int64_t j = 0; j < n; j++) {
        const char* vr = v0 + j * v_stride_bytes;
        __m256 v[4];
        for (int c = 0; c < CN; c++) v[c] = ld8(vr + 8 * c * (bf16 ? 2 : 4), bf16);
        for (int g = 0; g < GN; g++) {
            const __m256 pg = _mm256_set1_ps(p[g * seq_len + j]);
            for (int c = 0; c < CN; c++) o[g][c] = _mm256_fmadd_ps(pg, v[c], o[g][c]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CN; c++) _mm256_storeu_ps(acc + g * head_dim + 8 * c, o[g][c]);
}

/* `attend_avx512`'s plan with AVX2 (256-bit vectors, 16 registers; also what a hypervisor
   that hides AVX-512 leaves; where AVX-512 runs, the shapes its path does not take): per kv head, up to 3 heads of its group at a time, scores of
   4 keys per pass and P.V over 32 dimensions per pass, 12 sums in registers either way, so
   each K or V vector loaded serves up to 3 heads (30 layers of `small`, 16 sequences of
   320 positions: ~14 ms against ~17 for the plain loop `attend`; one dot product at a
   time, as `attend_avx512` scores, was no faster than the plain loop). bfloat16 K and V
   are widened to float32 as they are read. Needs head_dim % 8 == 0 and block_size % 4 ==
   0. */
static inline __attribute__((always_inline)) void attend_avx2(
    const pd_decode_args* a, int bf16, const int64_t head_dim, int64_t s,
    float* restrict scores, float* restrict acc, float* restrict qf,
    float* restrict ktile /* [4, head_dim] */) {
    const pd_seq sq = seq_begin(a, bf16, head_dim, s, qf);
    const int64_t num_heads = sq.num_heads, num_kv_heads = sq.num_kv_heads, group = sq.group;
    const int64_t kv_stride = sq.kv_stride, block_size = sq.block_size, esize = sq.esize;
    const int64_t block_bytes = sq.block_bytes, seq_len = sq.seq_len;
    const int64_t num_blocks = sq.num_blocks, row_bytes = sq.row_bytes, *table = sq.table;
    const char *kc = sq.kc, *vc = sq.vc;
    for (int64_t b = 0; b < num_blocks; b++) {
        /* the same rows of the K block two ahead come into L2 while this one is scored, a
           few lines per key; V is read ahead a block at a time in the P.V pass (also
           reading this V block ahead here, as `attend_avx512` does, took ~8% longer: 30
           layers of `small` decode attention, 16 sequences of 320 positions, 13.7-14.8
           ms against 15.0-17.1) */
        const char* next = b + 2 < num_blocks ? kc + table[b + 2] * block_bytes : NULL;
        const int64_t t0 = b * block_size;
        const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        for (int64_t j0 = 0; j0 < n; j0 += 4) {
            const int64_t m = n - j0 < 4 ? n - j0 : 4;
            const char* rows = kc + ((table[b] * block_size + j0) * kv_stride) * esize;
            for (int64_t hk = 0; hk < num_kv_heads; hk++) {
                if (next != NULL)
                    for (int j = 0; j < 4; j++)
                        for (int64_t off = 0; off < row_bytes; off += 64)
                            __builtin_prefetch(
                                next + ((j0 + j) * kv_stride + hk * head_dim) * esize + off, 0, 2);
                /* the 4 keys of this kv head as float32 (bf16 converted once, not per head) */
                const float* kt;
                if (bf16) {
                    for (int j = 0; j < 4; j++)
                        for (int64_t c = 0; c < head_dim; c += 8)
                            _mm256_storeu_ps(
                                ktile + j * head_dim + c,
                                ld8(rows + (j * kv_stride + hk * head_dim + c) * 2, 1));
                    kt = ktile;
                } else {
                    kt = (const float*)rows + hk * head_dim;
                }
                const int64_t kt_stride = bf16 ? head_dim : kv_stride;
                for (int64_t g0 = 0; g0 < group; g0 += 3) {
                    const int64_t h = hk * group + g0;
                    const float* q = qf + h * head_dim;
                    float* out = scores + h * seq_len + t0 + j0;
                    const int64_t gn = group - g0 < 3 ? group - g0 : 3;
                    if (gn == 3) score4(3, q, head_dim, kt, kt_stride, out, seq_len, m);
                    else if (gn == 2) score4(2, q, head_dim, kt, kt_stride, out, seq_len, m);
                    else score4(1, q, head_dim, kt, kt_stride, out, seq_len, m);
                }
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float* restrict sc = scores + h * seq_len;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 8 <= seq_len; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sc + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        float mx = lanes[0];
        for (int l = 1; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
        for (; i < seq_len; i++) mx = sc[i] > mx ? sc[i] : mx;
        normalize(sc, seq_len, mx);
    }
    for (int64_t i = 0; i < num_heads * head_dim; i++) acc[i] = 0.f;
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t t0 = b * block_size;
        const int64_t n = seq_len - t0 < block_size ? seq_len - t0 : block_size;
        if (b + 1 < num_blocks) prefetch_block(a->v_cache, table[b + 1], block_bytes);
        for (int64_t hk = 0; hk < num_kv_heads; hk++) {
            const char* v0 = vc + ((table[b] * block_size) * kv_stride + hk * head_dim) * esize;
            for (int64_t g0 = 0; g0 < group; g0 += 3) {
                const int64_t h = hk * group + g0;
                const float* p = scores + h * seq_len + t0;
                const int64_t gn = group - g0 < 3 ? group - g0 : 3;
                for (int64_t c0 = 0; c0 < head_dim; c0 += 32) {
                    const int64_t cn = head_dim - c0 < 32 ? (head_dim - c0) / 8 : 4;
                    const char* vcol = v0 + c0 * esize;
                    float* ah = acc + h * head_dim + c0;
                    const int64_t vs = kv_stride * esize;
#define WEIGH(GN, CN) weigh(GN, CN, bf16, vcol, vs, n, p, seq_len, ah, head_dim)
                    if (gn == 3) {
                        if (cn == 4) WEIGH(3, 4); else if (cn == 3) WEIGH(3, 3);
                        else if (cn == 2) WEIGH(3, 2); else WEIGH(3, 1);
                    } else if (gn == 2) {
                        if (cn == 4) WEIGH(2, 4); else if (cn == 3) WEIGH(2, 3);
                        else if (cn == 2) WEIGH(2, 2); else WEIGH(2, 1);
                    } else {
                        if (cn == 4) WEIGH(1, 4); else if (cn == 3) WEIGH(1, 3);
                        else if (cn == 2) WEIGH(1, 2); else WEIGH(1, 1);
                    }
#undef WEIGH
                }
            }
        }
    }
    store_out(a, bf16, head_dim, s, acc);
}
#endif

static inline __attribute__((always_inline)) int run(const pd_decode_args* a, int bf16,
                                                     int num_threads) {
    const int64_t num_heads = a->num_heads;
    const int64_t d = a->head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* scores [H, max_seq_len], acc [H, D], qf [H, D], ktile [16, D] */
        const int64_t floats = num_heads * (a->max_seq_len + 2 * d) + 16 * d;
        float* buf = (float*)malloc(sizeof(float) * floats);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < a->num_seqs; s++) {
            if (buf == NULL) continue;
            float* scores = buf;
            float* acc = buf + num_heads * a->max_seq_len;
            float* qf = acc + num_heads * d;
#if defined(__AVX512F__)
            if (d % 16 == 0 && a->block_size % 16 == 0) {
                float* ktile = qf + num_heads * d;
                if (d == 64) attend_avx512(a, bf16, 64, s, scores, acc, qf, ktile);
                else if (d == 128) attend_avx512(a, bf16, 128, s, scores, acc, qf, ktile);
                else attend_avx512(a, bf16, d, s, scores, acc, qf, ktile);
                continue;
            }
#endif
#if defined(__AVX2__) && defined(__FMA__) /* also where AVX-512 runs, for its other shapes */
            if (d % 8 == 0 && a->block_size % 4 == 0) {
                float* ktile = qf + num_heads * d;
                if (d == 64) attend_avx2(a, bf16, 64, s, scores, acc, qf, ktile);
                else if (d == 128) attend_avx2(a, bf16, 128, s, scores, acc, qf, ktile);
                else attend_avx2(a, bf16, d, s, scores, acc, qf, ktile);
                continue;
            }
#endif
            if (d == 64) attend(a, bf16, 64, s, scores, acc, qf);
            else if (d == 128) attend(a, bf16, 128, s, scores, acc, qf);
            else attend(a, bf16, d, s, scores, acc, qf);
        }
        free(buf);
    }
    return failed;
}

int pd_decode_attention_f32(const pd_decode_args* a, int num_threads) {
    return run(a, 0, num_threads);
}

int pd_decode_attention_bf16(const pd_decode_args* a, int num_threads) {
    return run(a, 1, num_threads);
}
