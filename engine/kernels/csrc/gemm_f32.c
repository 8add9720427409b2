/* C kernel source loaded by engine/kernels/gemm_f32.py (the order of the sums, the layout). */
#include <immintrin.h>
#include <stdint.h>

#define NB 48          /* output columns per packed block: three vectors of 16 */
#define MR 8           /* rows per register tile */
#define X_CHUNK_BYTES (1 << 20) /* rows of x that stay in L2 while a thread's blocks pass */
/* rows of its block a row tile prefetches ahead, into L2: on a Zen 4 a decode step of
   `small` (16 rows) ran 1.1x faster than 16 rows ahead into L1 (bench engine, alternated
   runs; not re-measured on a Xeon) */
#define PF_K 64

typedef struct { __m512 v[MR][3]; } Tile;

/* Sequential FMA chains from zero over k in [k0, k1): R rows, NV vectors. The
   accumulators are locals (in registers): `__m512` may alias floats, so chains kept in
   `*t` would be stored and reloaded around every load of x. */
static inline __attribute__((always_inline)) void leaf(
    const int R, const int NV, int k0, int k1, const float* x, int64_t ldx,
    const float* wb, const float* pf, Tile* t) {
  __m512 acc[MR][3];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
  for (int k = k0; k < k1; k++) {
    const float* wk = wb + (int64_t)k * NB;
    const float* pk = pf + (int64_t)k * NB;
    _mm_prefetch((const char*)pk, _MM_HINT_T1);
    _mm_prefetch((const char*)(pk + 16), _MM_HINT_T1);
    _mm_prefetch((const char*)(pk + 32), _MM_HINT_T1);
    __m512 w[3];
    for (int v = 0; v < NV; v++) w[v] = _mm512_loadu_ps(wk + 16 * v);
    for (int r = 0; r < R; r++) {
      __m512 b = _mm512_set1_ps(x[(int64_t)r * ldx + k]);
      for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(b, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < NV; v++) t->v[r][v] = acc[r][v];
}

#define LEAF_CASES(NV)                                                        \
  switch (R) {                                                                \
    case 1: leaf(1, NV, k0, k1, x, ldx, wb, pf, t); break;                        \
    case 2: leaf(2, NV, k0, k1, x, ldx, wb, pf, t); break;                        \
    case 3: leaf(3, NV, k0, k1, x, ldx, wb, pf, t); break;                        \
    case 4: leaf(4, NV, k0, k1, x, ldx, wb, pf, t); break;                        \
    case 5: leaf(5, NV, k0, k1, x, ldx, wb, pf, t); break;                        \
    case 6: leaf(6, NV, k0, k1, x, ldx, wb, pf, t); break;                        \
    case 7: leaf(7, NV, k0, k1, x, ldx, wb, pf, t); break;                        \
    default: leaf(8, NV, k0, k1, x, ldx, wb, pf, t); break;                       \
  }

static void leaf_any(int R, int nv, int k0, int k1, const float* x, int64_t ldx,
                     const float* wb, const float* pf, Tile* t) {
  if (nv == 3) { LEAF_CASES(3) }
  else if (nv == 2) { LEAF_CASES(2) }
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
      int64_t j0 = jb * NB;
      int64_t width = N - j0 < NB ? N - j0 : NB;
      int nv = (int)((width + 15) / 16);
      __mmask16 tail = (__mmask16)((width % 16) ? ((1u << (width % 16)) - 1) : 0xFFFFu);
      const float* wb = wp + j0 * K;
      __m512 b[3];
      for (int v = 0; v < nv; v++) {
        __mmask16 m = v == nv - 1 ? tail : (__mmask16)0xFFFFu;
        b[v] = bias ? _mm512_maskz_loadu_ps(m, bias + j0 + 16 * v) : _mm512_setzero_ps();
      }
      for (int64_t i = i0; i < i1; i += MR) {
        int R = (int)(i1 - i < MR ? i1 - i : MR);
        const float* xi = x + i * K;
        const float* pf = wb + PF_K * NB; /* read ahead in this block */
        Tile acc, part;
        leaf_any(R, nv, 0, ends[0], xi, K, wb, pf, &acc);
        if (bias)
          for (int r = 0; r < R; r++)
            for (int v = 0; v < nv; v++) acc.v[r][v] = _mm512_add_ps(b[v], acc.v[r][v]);
        for (int l = 1; l < nleaves; l++) {
          leaf_any(R, nv, ends[l - 1], ends[l], xi, K, wb, pf, &part);
          for (int r = 0; r < R; r++)
            for (int v = 0; v < nv; v++) acc.v[r][v] = _mm512_add_ps(acc.v[r][v], part.v[r][v]);
        }
        for (int r = 0; r < R; r++) {
          float* yr = y + (i + r) * N + j0;
          for (int v = 0; v < nv; v++)
            _mm512_mask_storeu_ps(yr + 16 * v, v == nv - 1 ? tail : (__mmask16)0xFFFFu,
                                  acc.v[r][v]);
        }
      }
    }
  }
}
