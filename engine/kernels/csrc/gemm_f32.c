/* C kernel source loaded by engine/kernels/gemm_f32.py (the order of the sums, the layout). */
#include <immintrin.h>
#include <stdint.h>

/* One source, two instruction sets. Each output sums over k in the same order either way,
   so both give MKL's bits; the tile and the read-ahead differ:
   - AVX-512 (16 floats a vector, 32 registers): a tile of 8 rows by a block's 48 columns,
     24 sums in registers;
   - AVX2 with FMA (8 floats, 16 registers; also what a hypervisor that hides AVX-512
     leaves): 6 rows by 16 columns, 12 sums, two vectors of weights and one of x (a 4 x 24
     tile ran the `small` shapes at 16 rows ~25% slower, 3 x 32 and 8 x 8 also slower). */
#if defined(__AVX512F__)
#define VL 16
#define MR 8
#define TV 3     /* vectors per tile row: a tile covers TV * VL columns */
#define PF_K 64  /* rows of its block a tile reads ahead, into L2 (below) */
typedef __m512 vec;
typedef __mmask16 vmask;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vbroadcast(f) _mm512_set1_ps(f)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vload_masked(m, p) _mm512_maskz_loadu_ps(m, p)
#define vstore_masked(p, m, v) _mm512_mask_storeu_ps(p, m, v)
static inline vmask first_lanes(int n) { return (vmask)(n >= VL ? 0xFFFFu : (1u << n) - 1); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
#define MR 6
#define TV 2
#define PF_K 128
typedef __m256 vec;
typedef __m256i vmask;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vbroadcast(f) _mm256_set1_ps(f)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vload_masked(m, p) _mm256_maskload_ps(p, m)
#define vstore_masked(p, m, v) _mm256_maskstore_ps(p, m, v)
static inline vmask first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#else
#error "gemm_f32 needs AVX-512, or AVX2 with FMA"
#endif

#define NB 48          /* output columns per packed block */
#define X_CHUNK_BYTES (1 << 20) /* rows of x that stay in L2 while a thread's blocks pass */
/* Read-ahead: each tile brings its own columns' rows PF_K ahead into L2. On a Zen 4 with
   AVX-512 64 rows into L2 ran a decode step of `small` (16 rows) 1.1x faster than 16 into
   L1; with AVX2 (the same Zen 4, AVX-512 hidden; 120 GEMMs of a `small` decode step, 425
   MB of weights from memory) 128 rows took ~28 ms against ~30 at 64, 36 at 32, 49 with
   none; one tile reading ahead every column of the block for the others, 39. */

typedef struct { vec v[MR][TV]; } Tile;

/* Sequential FMA chains from zero over k in [k0, k1): R rows, NV vectors of the tile's
   columns (`wb` points at its first column in the block's rows of NB). The accumulators
   are locals (in registers): a vector type may alias floats, so chains kept in `*t` would
   be stored and reloaded around every load of x. */
static inline __attribute__((always_inline)) void leaf(
    const int R, const int NV, int k0, int k1, const float* x, int64_t ldx,
    const float* wb, const float* pf, Tile* t) {
  vec acc[MR][TV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = vzero();
  for (int k = k0; k < k1; k++) {
    const float* wk = wb + (int64_t)k * NB;
    for (int c = 0; c < NV * VL; c += 16) /* a cache line of 16 floats at a time */
      _mm_prefetch((const char*)(pf + (int64_t)k * NB + c), _MM_HINT_T1);
    vec w[TV];
    for (int v = 0; v < NV; v++) w[v] = vload(wk + VL * v);
    for (int r = 0; r < R; r++) {
      vec b = vbroadcast(x[(int64_t)r * ldx + k]);
      for (int v = 0; v < NV; v++) acc[r][v] = vfma(b, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < NV; v++) t->v[r][v] = acc[r][v];
}

/* R (1 to MR, a constant in each case) unrolls the tile's rows; cases past MR never run */
#define LEAF_CASES(NV)                                                        \
  switch (R) {                                                                \
    case 1: leaf(1 < MR ? 1 : MR, NV, k0, k1, x, ldx, wb, pf, t); break;       \
    case 2: leaf(2 < MR ? 2 : MR, NV, k0, k1, x, ldx, wb, pf, t); break;       \
    case 3: leaf(3 < MR ? 3 : MR, NV, k0, k1, x, ldx, wb, pf, t); break;       \
    case 4: leaf(4 < MR ? 4 : MR, NV, k0, k1, x, ldx, wb, pf, t); break;       \
    case 5: leaf(5 < MR ? 5 : MR, NV, k0, k1, x, ldx, wb, pf, t); break;       \
    case 6: leaf(6 < MR ? 6 : MR, NV, k0, k1, x, ldx, wb, pf, t); break;       \
    case 7: leaf(7 < MR ? 7 : MR, NV, k0, k1, x, ldx, wb, pf, t); break;       \
    default: leaf(MR, NV, k0, k1, x, ldx, wb, pf, t); break;                  \
  }

static void leaf_any(int R, int nv, int k0, int k1, const float* x, int64_t ldx,
                     const float* wb, const float* pf, Tile* t) {
#if TV >= 3
  if (nv == 3) { LEAF_CASES(3) } else
#endif
  if (nv == 2) { LEAF_CASES(2) }
  else { LEAF_CASES(1) }
}

/* The order of the sums over k (MKL's, which depends on the CPU it runs on; set by
   engine/kernels/gemm_f32.py once its probe has found it): chains of at most `len` terms,
   cut in halves (the first the shorter) until short enough (`halves`, Intel) or in runs
   of `len` from k = 0 (AMD). One word, `len << 1 | halves`, read once per call, so a call
   never sees half of a change. */
static int order_word = 384 << 1 | 1;

void pd_gemm_f32_set_order(int len, int halves) {
  if (len > 0) __atomic_store_n(&order_word, len << 1 | (halves != 0), __ATOMIC_RELAXED);
}

/* Upper bound on the number of leaves of a range of K terms. */
static int max_leaves(int64_t K, int len) { return (int)(2 * K / len + 2); }

/* The leaves' ends of [k0, k1) into `ends` from index n; returns the new count. */
static int leaf_bounds(int k0, int k1, int len, int halves, int* ends, int n) {
  if (!halves) {
    for (int k = k0 + len; k < k1; k += len) ends[n++] = k;
    ends[n] = k1;
    return n + 1;
  }
  if (k1 - k0 > len) {
    int mid = k0 + (k1 - k0) / 2;
    n = leaf_bounds(k0, mid, len, halves, ends, n);
    return leaf_bounds(mid, k1, len, halves, ends, n);
  }
  ends[n] = k1;
  return n + 1;
}

/* y[M, N] = x[M, K] @ W (+ bias), W packed by column blocks of NB as [K, NB] each. MKL's
   order: the bias first (where there is one), then each leaf's chain, added in turn. */
void pd_gemm_f32(int64_t M, int64_t K, int64_t N, const float* x, const float* wp,
                 const float* bias, float* y, int threads) {
  int64_t nblocks = (N + NB - 1) / NB;
  const int word = __atomic_load_n(&order_word, __ATOMIC_RELAXED);
  const int len = word >> 1, halves = word & 1;
  int ends[max_leaves(K, len)];
  int nleaves = leaf_bounds(0, (int)K, len, halves, ends, 0);
  int64_t row_chunk = X_CHUNK_BYTES / (K * 4) / MR * MR;
  if (row_chunk < MR) row_chunk = MR;
  #pragma omp parallel num_threads(threads)
  for (int64_t i0 = 0; i0 < M; i0 += row_chunk) {
    int64_t i1 = i0 + row_chunk < M ? i0 + row_chunk : M;
    /* Blocks taken as threads come free, not split in halves up front: in a replica that
       shares its cores, a thread the OS deschedules would otherwise hold the other at the
       region's end (offline `small` job beside a process using a quarter of one core:
       ~180 tok/s against ~160; alone, the same). A block's sums do not depend on who
       computes it. */
    #pragma omp for schedule(dynamic, 1) nowait
    for (int64_t jb = 0; jb < nblocks; jb++) {
      const int64_t width = N - jb * NB < NB ? N - jb * NB : NB;
      const float* wblock = wp + jb * NB * K;
      /* the block's columns in tiles of TV vectors (one tile with AVX-512, two with AVX2) */
      for (int64_t c0 = 0; c0 < width; c0 += TV * VL) {
        const int64_t j0 = jb * NB + c0;
        const int64_t tw = width - c0 < TV * VL ? width - c0 : TV * VL;
        const int nv = (int)((tw + VL - 1) / VL);
        vmask lanes[TV];
        vec b[TV];
        for (int v = 0; v < nv; v++) {
          lanes[v] = first_lanes((int)(tw - VL * v));
          b[v] = bias ? vload_masked(lanes[v], bias + j0 + VL * v) : vzero();
        }
        const float* wb = wblock + c0;
        const float* pf = wb + PF_K * NB; /* this tile's columns, PF_K rows ahead */
        for (int64_t i = i0; i < i1; i += MR) {
          const int R = (int)(i1 - i < MR ? i1 - i : MR);
          const float* xi = x + i * K;
          Tile acc, part;
          leaf_any(R, nv, 0, ends[0], xi, K, wb, pf, &acc);
          if (bias)
            for (int r = 0; r < R; r++)
              for (int v = 0; v < nv; v++) acc.v[r][v] = vadd(b[v], acc.v[r][v]);
          for (int l = 1; l < nleaves; l++) {
            leaf_any(R, nv, ends[l - 1], ends[l], xi, K, wb, pf, &part);
            for (int r = 0; r < R; r++)
              for (int v = 0; v < nv; v++) acc.v[r][v] = vadd(acc.v[r][v], part.v[r][v]);
          }
          for (int r = 0; r < R; r++) {
            float* yr = y + (i + r) * N + j0;
            for (int v = 0; v < nv; v++) vstore_masked(yr + VL * v, lanes[v], acc.v[r][v]);
          }
        }
      }
    }
  }
}
