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

import torch

from engine.kernels.cpu_info import cpu_info
from engine.kernels.native import kernel_source, labelled, load_library

BLOCK_COLS = 48
KC_LEAF = 384

_SOURCE = kernel_source("gemm_f32.c")


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C kernel (built on first call), or None: no AVX-512, no compiler, not Linux."""
    if not cpu_info().avx512:
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


def available() -> bool:
    """Whether `gemm` runs here (x86-64 with AVX-512 and a C compiler)."""
    return _kernel() is not None


def packed_width(out_features: int) -> int:
    """Output columns `pack` stores for a projection: whole blocks of `BLOCK_COLS`."""
    return -(-out_features // BLOCK_COLS) * BLOCK_COLS


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """The `[in, out]` float32 weight in `gemm`'s layout: flat `[blocks, in, BLOCK_COLS]`,
    the last block's missing columns zero."""
    if weight_t.dtype != torch.float32 or weight_t.dim() != 2:
        raise TypeError(f"pack takes a 2-D float32 [in, out] weight, got {weight_t.dtype}")
    k, n = weight_t.shape
    blocks = packed_width(n) // BLOCK_COLS
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
