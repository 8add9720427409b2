"""The C decode-attention kernel equals its torch form; it refuses tables outside the cache."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.kernels.decode_attention import decode_attention, decode_attention_ref, has_kernel

# (num_heads, num_kv_heads, head_dim, block_size): MHA, GQA, the small model's, odd sizes
GEOMETRIES = [(4, 4, 16, 16), (4, 2, 64, 8), (9, 3, 64, 16), (8, 2, 128, 16), (6, 3, 24, 4)]
DTYPES = [torch.float32, torch.bfloat16]
SEQ_LENS = [1, 16, 17, 40, 63, 8, 200]


def needs_kernel(dtype: torch.dtype) -> None:
    if not has_kernel(dtype):
        pytest.skip(f"no C decode-attention kernel for {dtype} here (no compiler?)")


def decode_args(
    paged_batch: Callable, geometry: tuple[int, int, int, int], dtype: torch.dtype
) -> tuple:
    num_heads, num_kv_heads, head_dim, block_size = geometry
    batch = paged_batch(
        [1] * len(SEQ_LENS),
        SEQ_LENS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    md = batch.metadata
    scale = head_dim**-0.5
    return (batch.query, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens,
            md.seq_lens_list, scale)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_matches_torch_form(
    paged_batch: Callable,
    tolerances: dict,
    geometry: tuple[int, int, int, int],
    dtype: torch.dtype,
) -> None:
    needs_kernel(dtype)
    torch.manual_seed(0)
    args = decode_args(paged_batch, geometry, dtype)
    out = decode_attention(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    expected = decode_attention_ref(*(a.float() if i < 3 else a for i, a in enumerate(args)))
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("threads", [1, 3])
def test_strided_query_and_thread_counts(paged_batch: Callable, threads: int) -> None:
    """Queries sliced out of a fused projection; results do not depend on the threads."""
    needs_kernel(torch.float32)
    torch.manual_seed(1)
    query, *rest = decode_args(paged_batch, (9, 3, 64, 16), torch.float32)
    fused = torch.randn(query.shape[0], 15, 64)
    fused[:, :9] = query
    strided = fused[:, :9]
    assert not strided.is_contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = decode_attention(strided, *rest)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, decode_attention_ref(query, *rest), atol=2e-5, rtol=1e-4)


def test_other_dtypes_take_the_torch_form(paged_batch: Callable) -> None:
    torch.manual_seed(2)
    args = decode_args(paged_batch, (4, 2, 16, 8), torch.float16)
    torch.testing.assert_close(decode_attention(*args), decode_attention_ref(*args))


def test_rejects_tables_outside_the_cache(paged_batch: Callable) -> None:
    needs_kernel(torch.float32)
    torch.manual_seed(3)
    query, k, v, tables, seq_lens, seq_lens_list, scale = decode_args(
        paged_batch, (4, 2, 16, 8), torch.float32
    )
    bad = tables.clone()
    bad[0, 0] = k.shape[0]
    with pytest.raises(IndexError, match="block id"):
        decode_attention(query, k, v, bad, seq_lens, seq_lens_list, scale)
    bad[0, 0] = -1
    with pytest.raises(IndexError, match="block id"):
        decode_attention(query, k, v, bad, seq_lens, seq_lens_list, scale)
    too_long = (tables.shape[1] * 8 + 1, *seq_lens_list[1:])
    with pytest.raises(ValueError, match="longer than its block table"):
        decode_attention(query, k, v, tables, seq_lens, too_long, scale)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(query, k, v, tables, seq_lens.int(), seq_lens_list, scale)
