"""Paged decode attention on the CPU: one query token per sequence over its cached blocks.

`decode_attention` runs a small C kernel (built on first use, `engine.kernels.native`) that
reads each sequence's K/V rows straight from the paged cache, once, for all its query heads
(GQA: each kv head serves its query group), and keeps scores and the softmax in float32.
The torch form, `decode_attention_ref`, gathers every sequence's blocks into a new tensor
(one copy of the whole context per layer) and then calls SDPA: it reads the context three
times instead of once. The C kernel covers float32 and bfloat16 caches; other dtypes, or a
machine without a C compiler, take the torch form.

Work is split over torch's threads by sequence. Numerics: the kernel's sums run in another
order than SDPA's and its `exp` is a polynomial (~1 ulp), so float32 outputs differ from the
torch form by a few ulps.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.kernels.native import kernel_source, labelled, load_library

_SOURCE = kernel_source("decode_attention.c")

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class _Args(ctypes.Structure):
    _fields_ = [
        ("num_seqs", _I64),
        ("num_heads", _I64),
        ("num_kv_heads", _I64),
        ("head_dim", _I64),
        ("block_size", _I64),
        ("q", _PTR),
        ("q_seq_stride", _I64),
        ("q_head_stride", _I64),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("block_tables", _PTR),
        ("table_stride", _I64),
        ("seq_lens", _PTR),
        ("max_seq_len", _I64),
        ("scale", ctypes.c_float),
        ("out", _PTR),
    ]


@functools.cache
def _kernels() -> dict[torch.dtype, Callable[..., int]] | None:
    """The C kernel per cache dtype, or None without one (built on first call)."""
    lib = load_library("decode_attention", _SOURCE)
    if lib is None:
        return None
    kernels = {
        torch.float32: lib.pd_decode_attention_f32,
        torch.bfloat16: lib.pd_decode_attention_bf16,
    }
    for fn in kernels.values():
        fn.argtypes = [ctypes.POINTER(_Args), ctypes.c_int]
        fn.restype = ctypes.c_int
    return dict(kernels)


def has_kernel(dtype: torch.dtype) -> bool:
    """Whether `decode_attention` runs the C kernel for this dtype (builds it on first call)."""
    kernels = _kernels()
    return kernels is not None and dtype in kernels


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Each sequence's one query attends to its `seq_lens[i]` cached positions.

    Args:
        query: `[num_seqs, num_heads, head_dim]` (head_dim contiguous; rows may be strided).
        k_cache, v_cache: one layer's `[num_blocks, block_size, num_kv_heads, head_dim]`.
        block_tables: `[num_seqs, max_blocks]` int64, block ids in `[0, num_blocks)`.
        seq_lens, seq_lens_list: `[num_seqs]` int64 context lengths (≥ 1), and their copy.
        scale: multiplier of `q @ k^T`.

    Returns:
        `[num_seqs, num_heads, head_dim]` in the query's dtype.
    """
    kernels = _kernels()
    kernel = None if kernels is None else kernels.get(query.dtype)
    if (
        kernel is None
        or k_cache.dtype != query.dtype
        or query.device.type != "cpu"
        or query.stride(2) != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return decode_attention_ref(
            query, k_cache, v_cache, block_tables, seq_lens, seq_lens_list, scale
        )
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size = k_cache.shape[:2]
    _check_tables(block_tables, seq_lens, seq_lens_list, num_seqs, num_blocks, block_size)
    out = torch.empty(query.shape, dtype=query.dtype)
    if num_seqs == 0:
        return out
    args = _Args(
        num_seqs,
        num_heads,
        k_cache.shape[2],
        head_dim,
        block_size,
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        max(seq_lens_list),
        scale,
        out.data_ptr(),
    )
    with labelled("decode_attention"):
        status = kernel(ctypes.byref(args), torch.get_num_threads())
    if status != 0:
        raise MemoryError("decode attention could not allocate its scratch buffers")
    return out


def _check_tables(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: Sequence[int],
    num_seqs: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """What the kernel reads through raw pointers must lie inside the cache."""
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2:
        raise TypeError(f"block_tables must be 2-D int64, got {block_tables.dtype}")
    if block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] with contiguous rows")
    if seq_lens.dtype != torch.int64 or seq_lens.shape != (num_seqs,) or seq_lens.stride(0) != 1:
        raise ValueError(f"seq_lens must be a contiguous [{num_seqs}] int64 tensor")
    if len(seq_lens_list) != num_seqs or (num_seqs and min(seq_lens_list) < 1):
        raise ValueError(f"seq_lens_list must hold {num_seqs} lengths ≥ 1")
    if num_seqs and max(seq_lens_list) > block_tables.shape[1] * block_size:
        raise ValueError("a sequence is longer than its block table")
    if block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < (
        num_blocks
    ):
        raise IndexError(f"block id out of range [0, {num_blocks})")


def decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """The torch form: gather each sequence's blocks, then one SDPA call for all of them
    with a padding mask (the cache's values read as the query's dtype)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_blocks = -(-max(seq_lens_list) // block_size)
    ctx_len = num_blocks * block_size
    # Gather is one contiguous copy per block; block table padding (block 0) is masked below.
    block_ids = block_tables[:, :num_blocks].reshape(-1)
    # [num_seqs, kvH, ctx_len, D] strided views over the gathered blocks
    keys = k_cache.index_select(0, block_ids).to(query.dtype)
    values = v_cache.index_select(0, block_ids).to(query.dtype)
    keys = keys.view(num_seqs, ctx_len, num_kv_heads, head_dim)
    values = values.view(num_seqs, ctx_len, num_kv_heads, head_dim)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    # [num_seqs, kvH, group, D]: each kv head attends for its whole query group at once
    queries = query.reshape(num_seqs, num_kv_heads, group, head_dim)
    mask = None
    if min(seq_lens_list) < ctx_len:
        positions = torch.arange(ctx_len, device=query.device)
        # [num_seqs, 1, 1, ctx_len] True where the key position is inside the context
        mask = (positions < seq_lens[:, None]).view(num_seqs, 1, 1, ctx_len)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)
