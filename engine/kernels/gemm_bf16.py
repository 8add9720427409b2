"""A bfloat16 GEMM for the CPU's projections: `y = x @ W^T (+ b)`, float32 sums, on AMX tiles
where the CPU has them (Intel Sapphire Rapids and later), else on AVX512-BF16 (AMD Zen 4
and later, Intel Cooper Lake).

Why not oneDNN, which bfloat16 projections otherwise run (`engine.kernels.linear`): its
packed weight is opaque, so only torch can call it, one call per projection from Python;
a decode step of `small` spent about as long between those calls as in them. These kernels
take plain pointers, so the fused decode step (`engine.kernels.decode_layers`) calls them
from C. On AMX one `tdpbf16ps` multiplies a 16-row tile of x by a 32 x 16 tile of W in a
few cycles, and a decode step's rows stream the weights at memory speed (1.3-1.7x oneDNN's
rate at 16 rows on the `small` shapes; ~0.85x at prefill's thousands of rows). On
AVX512-BF16 each `vdpbf16ps` multiplies a pair of x's values, broadcast, by 16 columns'
pairs: oneDNN's own rate at every size, measured on a Xeon with oneDNN held to that
instruction set (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`).

Layout (`pack`): the `[in, out]` weight is cut into blocks of `BLOCK_COLS` (32) output
columns, each stored contiguously as `in / 32` steps of two B tiles; a B tile is 16 pairs of
rows (`k`, `k + 1`) of 16 columns, the pair's two values side by side (AMX's VNNI order,
which is also `vdpbf16ps`'s: one tile row is one vector). `in` must be a multiple of 32
(`can_pack`); the last block's missing columns are zero. Threads (OpenMP, torch's runtime)
take column blocks; rows go in 16-row tiles on AMX (32 where there are enough), in 8-row
tiles of a whole block's 32 columns on AVX512-BF16 (one broadcast of x serves two
`vdpbf16ps`), in chunks that stay in L2 while a thread's blocks pass over them. Products
of bfloat16 values are exact in float32; sums run in tile order, so results differ from
oneDNN's or torch's in the last bits of float32 (tests/kernels/test_gemm_bf16.py).

`PDSERVE_BF16_GEMM` picks the kernel ("amx", "avx512") or turns both off ("off": bfloat16
projections go back to oneDNN and the layer-by-layer step).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from engine.kernels.cpu_info import cpu_info
from engine.kernels.native import kernel_source, labelled, load_library

BLOCK_COLS = 32
K_STEP = 32

_SOURCE = kernel_source("gemm_bf16.c")


KERNELS = ("amx", "avx512")
# "amx", "avx512": which kernel runs (default: the best here); "off": none (oneDNN then)
KERNEL_ENV = "PDSERVE_BF16_GEMM"


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The C kernels (built on first call), or None where neither can run here."""
    if not cpu_info().avx512_bf16:
        return None
    lib = load_library("gemm_bf16", _SOURCE, ("-mavx512bf16", "-mamx-tile", "-mamx-bf16"))
    if lib is None:
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for fn in (lib.pd_gemm_bf16, lib.pd_gemm_bf16_avx512):
        fn.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, i32, i32]
        fn.restype = ctypes.c_int
    lib.pd_f32_to_bf16_n.argtypes = [i64, ptr, ptr]
    lib.pd_f32_to_bf16_n.restype = None
    return lib


@functools.cache
def _amx() -> bool:
    """Whether AMX runs here: the CPU has it and Linux grants this process its tile state."""
    lib = _library()
    return lib is not None and cpu_info().amx_bf16 and lib.pd_amx_init() == 0


@functools.cache
def kernel_name() -> str | None:
    """The kernel `gemm` runs: "amx", "avx512", or None where neither runs. `PDSERVE_BF16_GEMM`
    picks one, or "off" for none (an unavailable choice means none)."""
    if _library() is None:
        return None
    choice = os.environ.get(KERNEL_ENV, "").strip().lower()
    if choice == "off":
        return None
    if choice and choice not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: expected one of {KERNELS} or 'off'")
    if choice == "amx" or (not choice and _amx()):
        return "amx" if _amx() else None
    return "avx512"


def kernel(name: str | None = None) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C function of kernel `name` (default `kernel_name()`), or None where it does not
    run here."""
    lib = _library()
    name = name or kernel_name()
    if name is None or lib is None or (name == "amx" and not _amx()):
        return None
    return lib.pd_gemm_bf16 if name == "amx" else lib.pd_gemm_bf16_avx512


def available() -> bool:
    """Whether `gemm` runs here."""
    return kernel() is not None


def can_pack(weight_t: torch.Tensor) -> bool:
    """Whether this `[in, out]` weight can take `pack`'s layout and run here."""
    return (
        weight_t.device.type == "cpu"
        and weight_t.dtype == torch.bfloat16
        and weight_t.dim() == 2
        and weight_t.shape[0] % K_STEP == 0
        and available()
    )


def packed_width(out_features: int) -> int:
    """Output columns `pack` stores: whole blocks of `BLOCK_COLS`."""
    return -(-out_features // BLOCK_COLS) * BLOCK_COLS


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """The `[in, out]` bfloat16 weight in `gemm`'s layout, flat:
    `[blocks, in / 32, 2 tiles, 16 pairs, 16 columns, 2]`."""
    if weight_t.dtype != torch.bfloat16 or weight_t.dim() != 2 or weight_t.shape[0] % K_STEP:
        raise TypeError(
            f"pack takes a 2-D bfloat16 [in, out] weight, in a multiple of {K_STEP}; "
            f"got {weight_t.dtype} {tuple(weight_t.shape)}"
        )
    k, n = weight_t.shape
    blocks = packed_width(n) // BLOCK_COLS
    padded = torch.zeros(k, blocks * BLOCK_COLS, dtype=torch.bfloat16)
    padded[:, :n] = weight_t
    # k = step * 32 + pair * 2 + half; column = block * 32 + tile * 16 + c
    tiles = padded.view(k // K_STEP, 16, 2, blocks, 2, 16)
    return tiles.permute(3, 0, 4, 1, 5, 2).contiguous().view(-1)


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
    kernel_name: str | None = None,
) -> torch.Tensor:
    """`x @ W + bias` for `x` `[rows, in]` bfloat16 and `packed` from `pack`; `bias` float32
    (or None); the result float32 or bfloat16 (rounded to nearest even), `[rows, out]`.
    `kernel_name`: "amx" or "avx512" (default: the one this machine runs)."""
    fn = kernel(kernel_name)
    if fn is None:
        raise RuntimeError("the bfloat16 GEMM is not available on this machine")
    if x.dim() != 2 or x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16:
        raise TypeError(f"gemm takes 2-D bfloat16 x and weight, got {x.dtype}, {packed.dtype}")
    rows, k = x.shape
    if k % K_STEP or packed.numel() != packed_width(out_features) * k:
        raise ValueError(f"packed weight does not match [{k}, {out_features}]")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be [{out_features}] float32, got {bias.dtype}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"gemm writes float32 or bfloat16, not {out_dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(rows, out_features, dtype=out_dtype)
    if rows:
        with labelled("gemm_bf16"):
            status = fn(
                rows,
                k,
                out_features,
                x.data_ptr(),
                x.stride(0),
                packed.data_ptr(),
                None if bias is None else bias.contiguous().data_ptr(),
                y.data_ptr(),
                out_features,
                out_dtype == torch.bfloat16,
                torch.get_num_threads(),
            )
        if status != 0:
            raise MemoryError("the bfloat16 GEMM could not allocate its scratch")
    return y
