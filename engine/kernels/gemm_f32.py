"""A float32 GEMM for the CPU's projections: `y = x @ W^T (+ b)` on a weight packed once.

Why not MKL, whose GEMM torch runs: for a decode step's few rows MKL reaches a third of the
memory bandwidth on the `small` model's shapes (576 x 960 at 16 rows: ~9 GB/s against ~30
for a streaming read on a Xeon), and takes a slower path still on AMD. Why not oneDNN, which
bfloat16 uses (`engine.kernels.linear`): it sums in another order, and float32 greedy output
must stay token-identical to `transformers`, whose `F.linear` is MKL's GEMM.

So this kernel sums in MKL's order. On AVX-512 Xeons, for 16 rows and more, MKL's sum over
`k` of `x[i, k] * W[j, k]` splits the range in halves (the first half the shorter one)
until a part has at most `KC_LEAF` terms, sums each part with fused multiply-adds from
zero, in order, and adds the parts in turn onto the bias (where there is one): bit for bit
the `small` model's projections at every row count of 16 and more that was tried
(tests/kernels/test_gemm_f32.py checks it against torch where MKL runs it). Where MKL
splits one sum between its threads instead (some shapes and row counts), it adds the
parts in another order and results differ in the last bits, as oneDNN's would everywhere.

Layout (`pack`): the `[in, out]` weight is cut into blocks of `BLOCK_COLS` output columns,
each stored contiguously as `[in, BLOCK_COLS]` (the last block zero-padded), so one block's
columns stream from memory as one run, and a tile of 8 rows by 48 columns keeps its 24
accumulators in registers. Threads (OpenMP, torch's runtime) take column blocks; rows go
in chunks that stay in L2 while a thread's blocks pass over them.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

from engine.kernels.native import labelled, load_library

BLOCK_COLS = 48
KC_LEAF = 384

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

#define NB 48          /* output columns per packed block: three vectors of 16 */
#define MR 8           /* rows per register tile */
#define KC_LEAF 384    /* longest run of k summed in one chain (MKL's order) */
#define X_CHUNK_BYTES (1 << 20) /* rows of x that stay in L2 while a thread's blocks pass */
#define PF_K 16        /* rows of its block a row tile prefetches ahead */

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
    _mm_prefetch((const char*)pk, _MM_HINT_T0);
    _mm_prefetch((const char*)(pk + 16), _MM_HINT_T0);
    _mm_prefetch((const char*)(pk + 32), _MM_HINT_T0);
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

/* The leaves of [0, K): halves (the first the shorter) until at most KC_LEAF long. */
static int leaf_bounds(int k0, int k1, int* ends, int n) {
  if (k1 - k0 > KC_LEAF) {
    int mid = k0 + (k1 - k0) / 2;
    n = leaf_bounds(k0, mid, ends, n);
    return leaf_bounds(mid, k1, ends, n);
  }
  ends[n] = k1;
  return n + 1;
}

/* y[M, N] = x[M, K] @ W (+ bias), W packed by column blocks of NB as [K, NB] each. MKL's
   order: the bias first (where there is one), then each leaf's chain, added in turn. */
void pd_gemm_f32(int64_t M, int64_t K, int64_t N, const float* x, const float* wp,
                 const float* bias, float* y, int threads) {
  int64_t nblocks = (N + NB - 1) / NB;
  int ends[64];
  int nleaves = leaf_bounds(0, (int)K, ends, 0);
  int64_t row_chunk = X_CHUNK_BYTES / (K * 4) / MR * MR;
  if (row_chunk < MR) row_chunk = MR;
  #pragma omp parallel num_threads(threads)
  for (int64_t i0 = 0; i0 < M; i0 += row_chunk) {
    int64_t i1 = i0 + row_chunk < M ? i0 + row_chunk : M;
    #pragma omp for schedule(static) nowait
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
"""


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C kernel (built on first call), or None: no AVX-512, no compiler, not Linux."""
    if platform.machine() not in ("x86_64", "AMD64") or not _has_avx512():
        return None
    # the sums' order is the point: no reassociation of the pairwise adds
    lib = load_library("gemm_f32", _SOURCE, ("-fno-associative-math", "-ffp-contract=off"))
    if lib is None:
        return None
    fn = lib.pd_gemm_f32
    ptr = ctypes.c_void_p
    fn.argtypes = [ctypes.c_int64] * 3 + [ptr] * 4 + [ctypes.c_int]
    fn.restype = None
    return fn


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return False
    return " avx512f" in flags


def available() -> bool:
    """Whether `gemm` runs here (x86-64 with AVX-512 and a C compiler)."""
    return _kernel() is not None


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """The `[in, out]` float32 weight in `gemm`'s layout: flat `[blocks, in, BLOCK_COLS]`,
    the last block's missing columns zero."""
    if weight_t.dtype != torch.float32 or weight_t.dim() != 2:
        raise TypeError(f"pack takes a 2-D float32 [in, out] weight, got {weight_t.dtype}")
    k, n = weight_t.shape
    blocks = -(-n // BLOCK_COLS)
    padded = torch.zeros(k, blocks * BLOCK_COLS, dtype=torch.float32)
    padded[:, :n] = weight_t
    return padded.view(k, blocks, BLOCK_COLS).transpose(0, 1).contiguous().view(-1)


def gemm(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ W + bias` for `x` `[rows, in]` float32 and `packed` from `pack` (`W` `[in, out]`)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the float32 GEMM kernel is not available on this machine")
    rows, k = x.shape
    blocks = -(-out_features // BLOCK_COLS)
    if packed.numel() != blocks * k * BLOCK_COLS:
        raise ValueError(f"packed weight does not match [{k}, {out_features}]")
    if x.dtype != torch.float32 or packed.dtype != torch.float32:
        raise TypeError(f"gemm takes float32, got x {x.dtype}, weight {packed.dtype}")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be [{out_features}] float32, got {tuple(bias.shape)}")
    x = x.contiguous()
    y = torch.empty(rows, out_features, dtype=torch.float32)
    if rows:
        with labelled("gemm_f32"):
            kernel(
                rows,
                k,
                out_features,
                x.data_ptr(),
                packed.data_ptr(),
                None if bias is None else bias.contiguous().data_ptr(),
                y.data_ptr(),
                torch.get_num_threads(),
            )
    return y
