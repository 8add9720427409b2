"""A float32 GEMM for the CPU's projections: `y = x @ W^T (+ b)` on a weight packed once.

Why not MKL, whose GEMM torch runs: for a decode step's few rows MKL reaches a third of the
memory bandwidth on the `small` model's shapes (576 x 960 at 16 rows: ~9 GB/s against ~30
for a streaming read on a Xeon), and takes a slower path still on AMD. Why not oneDNN, which
bfloat16 uses (`engine.kernels.linear`): it sums in another order, and float32 greedy output
must stay token-identical to `transformers`, whose `F.linear` is MKL's GEMM.

So this kernel sums in MKL's order, which depends on the processor MKL runs on. MKL's sum
over `k` of `x[i, k] * W[j, k]` (for 4 rows and more) is a sequence of chains, each summed
with fused multiply-adds from zero, in order, and added in turn onto the bias (where there
is one). Where the chains fall differs (`ORDERS`):

- Intel (AVX-512 Xeons): the range is cut in halves (the first half the shorter one) until
  a part has at most 384 terms;
- AMD (Zen 4, with AVX-512 or with it hidden by a hypervisor, MKL's AVX2 path): runs of
  192 terms from `k = 0`.

At load the kernel finds which: it runs torch's `F.linear` (what `transformers` runs) and
itself under each known order on a probe, and keeps the order that is equal bit for bit
(`order`). Where none is, it does not run (`available` is False) and float32 projections
stay with torch, exact and slower. Where MKL runs a GEMV instead (fewer than 4 rows) or
splits one sum between its threads (some shapes and row counts), it adds in another order,
and results differ in the last bits, as oneDNN's would everywhere.

Layout (`pack`): the `[in, out]` weight is cut into blocks of `BLOCK_COLS` output columns,
each stored contiguously as `[in, BLOCK_COLS]` (the last block zero-padded), so one block's
columns stream from memory as one run, and a tile of 8 rows by 48 columns keeps its 24
accumulators in AVX-512's 32 vector registers (with AVX2's 16: 6 rows by 16 columns, 12
accumulators; the sums are the same). Threads (OpenMP, torch's runtime) take column
blocks; rows go in chunks that stay in L2 while a thread's blocks pass over them.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch

from engine.kernels.cpu_info import cpu_info
from engine.kernels.native import kernel_source, labelled, load_library

BLOCK_COLS = 48
# MKL's orders (chain length, halves or runs): Intel AVX-512 Xeons, AMD Zen 4 (AVX-512 or AVX2)
ORDERS = ((384, True), (192, False))
# probe of `_find_order`: rows, and reduction lengths on which the orders differ
_PROBE_ROWS = 16
_PROBE_KS = (576, 1536)

_SOURCE = kernel_source("gemm_f32.c")

logger = logging.getLogger(__name__)


@functools.cache
def _library() -> ctypes.CDLL | None:
    info = cpu_info()
    if not (info.avx512 or info.avx2_fma):
        return None
    # the sums' order is the point: no reassociation of the pairwise adds
    lib = load_library("gemm_f32", _SOURCE, ("-fno-associative-math", "-ffp-contract=off"))
    if lib is None:
        return None
    ptr = ctypes.c_void_p
    lib.pd_gemm_f32.argtypes = [ctypes.c_int64] * 3 + [ptr] * 4 + [ctypes.c_int]
    lib.pd_gemm_f32.restype = None
    lib.pd_gemm_f32_set_order.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.pd_gemm_f32_set_order.restype = None
    return lib


_order_lock = threading.Lock()
_order: list[tuple[int, bool] | None] = []  # the probe's result, once it has run


def order() -> tuple[int, bool] | None:
    """The entry of `ORDERS` in which torch's float32 matmul sums on this machine, set in
    the kernel; None where the kernel cannot run or no known order is torch's. The probe
    runs once per process (it sets the kernel's order while it tries each)."""
    if _order:
        return _order[0]
    with _order_lock:
        if not _order:
            lib = _library()
            found = None if lib is None else _find_order(lib)
            if lib is not None:
                default = found or ORDERS[0]  # a known order in the kernel, whatever it is
                lib.pd_gemm_f32_set_order(default[0], int(default[1]))
                if found is None:
                    logger.warning(
                        "float32 C GEMM: torch sums in none of its known orders here; "
                        "float32 projections run torch's matmul (exact, slower)"
                    )
            _order.append(found)
    return _order[0]


def _find_order(lib: ctypes.CDLL) -> tuple[int, bool] | None:
    gen = torch.Generator().manual_seed(0)
    probes = []
    for k in _PROBE_KS:
        x = torch.randn(_PROBE_ROWS, k, generator=gen)
        weight = torch.randn(2 * BLOCK_COLS, k, generator=gen) * 0.05
        bias = torch.randn(2 * BLOCK_COLS, generator=gen)
        expected = torch.nn.functional.linear(x, weight, bias)
        probes.append((x, pack(weight.t()), bias, expected))
    for candidate in ORDERS:
        lib.pd_gemm_f32_set_order(candidate[0], int(candidate[1]))
        if all(
            torch.equal(_run(lib.pd_gemm_f32, x, packed, 2 * BLOCK_COLS, b), expected)
            for x, packed, b, expected in probes
        ):
            return candidate
    return None


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C kernel with MKL's order set (built on first call), or None: neither AVX-512 nor
    AVX2 with FMA, no compiler, not Linux, or torch sums in an order the kernel does not know."""
    if order() is None:
        return None
    lib = _library()
    return None if lib is None else lib.pd_gemm_f32


def available() -> bool:
    """Whether `gemm` runs here: x86-64 with AVX-512 or AVX2 and
    FMA, a C compiler, and torch's float32 matmul in a known order (`order`)."""
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
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W + bias` for `x` `[rows, in]` float32 and `packed` from `pack` (`W` `[in, out]`),
    into `out` (contiguous `[rows, out_features]` float32) where given."""
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
    if out is not None and (
        out.shape != (rows, out_features) or out.dtype != torch.float32 or not out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous [{rows}, {out_features}] float32 tensor")
    with labelled("gemm_f32"):
        return _run(kernel, x, packed, out_features, bias, out)


def _run(
    kernel: ctypes._CFuncPtr,  # type: ignore[name-defined]
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    x = x.contiguous()
    rows, k = x.shape
    y = torch.empty(rows, out_features, dtype=torch.float32) if out is None else out
    if rows:
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
