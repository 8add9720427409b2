"""FP8 KV cache kernels on the CPU: cache write quantizes per head, paged attention reads
through the scales, pack/unpack move the bytes untouched; each against its reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.kernels import (
    pack_kv_blocks,
    pack_kv_blocks_ref,
    paged_attention,
    paged_attention_ref,
    unpack_kv_blocks,
    write_kv_cache,
    write_kv_cache_ref,
)
from engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_per_head, quantize_per_head

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def scales(num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct per-head scales, so a head read with another head's scale shows."""
    return torch.rand(num_kv_heads) * 2 + 0.25, torch.rand(num_kv_heads) * 2 + 0.25


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_quantize_round_trip_is_within_half_an_fp8_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4, 32) * torch.tensor([0.5, 3.0, 20.0, 100.0]).view(1, 4, 1)
    scale = x.abs().amax(dim=(0, 2)) / FP8_MAX
    back = dequantize_per_head(quantize_per_head(x, scale), scale)
    # e4m3: 3 mantissa bits, so a normal value is off by at most 2^-4 of itself; values
    # below the smallest normal (2^-6 * scale) by at most half the subnormal step
    bound = torch.maximum(x.abs() * 2**-4, (2**-10 * scale).view(1, 4, 1))
    assert ((back - x).abs() <= bound).all()


def test_values_past_the_fp8_range_saturate() -> None:
    x = torch.tensor([[[1000.0, -1000.0, 1.0]]])
    q = quantize_per_head(x, torch.ones(1))
    assert q.float().tolist() == [[[FP8_MAX, -FP8_MAX, 1.0]]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_quantizes_like_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    kv_heads, head_dim, block_size = 3, 16, 8
    k_cache = torch.zeros(6, block_size, kv_heads, head_dim, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv = (torch.randn(9, 2 * kv_heads, head_dim) * 4).to(dtype)
    key, value = kv[:, :kv_heads], kv[:, kv_heads:]  # strided, as from a fused projection
    slots = torch.randperm(6 * block_size)[:9]
    k_scale, v_scale = scales(kv_heads)
    write_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    assert same_bytes(k_cache, k_ref) and same_bytes(v_cache, v_ref)
    stored = dequantize_per_head(k_cache.view(-1, kv_heads, head_dim)[slots], k_scale)
    torch.testing.assert_close(stored, key.float(), rtol=2**-4, atol=2**-9 * k_scale.max())


def test_fp8_cache_demands_its_scales_and_others_refuse_them() -> None:
    k_cache = torch.zeros(2, 4, 2, 8, dtype=FP8_DTYPE)
    key = torch.randn(1, 2, 8)
    slot = torch.tensor([0])
    with pytest.raises(ValueError, match="needs k_scale"):
        write_kv_cache(key, key, k_cache, k_cache.clone(), slot)
    with pytest.raises(TypeError, match="float32 \\[2\\]"):
        write_kv_cache(key, key, k_cache, k_cache.clone(), slot, torch.ones(3), torch.ones(3))
    plain = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="FP8 cache only"):
        write_kv_cache(key, key, plain, plain.clone(), slot, torch.ones(2), torch.ones(2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1], [1, 20, 37]), ([13, 1, 40, 0, 1, 1], [30, 17, 40, 5, 9, 3])],
    ids=["decode", "mixed"],
)
def test_paged_attention_over_fp8_equals_the_dequantizing_reference(
    paged_batch: Callable,
    tolerances: dict,
    query_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim, block_size = 6, 3, 16, 8
    batch = paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    k_scale, v_scale = scales(num_kv_heads)
    k_cache = quantize_per_head(batch.k_cache, k_scale)
    v_cache = quantize_per_head(batch.v_cache, v_scale)
    query, scale = batch.query, head_dim**-0.5
    out = paged_attention(query, k_cache, v_cache, batch.metadata, scale, k_scale, v_scale)
    expected = paged_attention_ref(query, k_cache, v_cache, batch.metadata, scale, k_scale, v_scale)
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(out, expected, atol=atol * 4, rtol=rtol * 4)
    # and FP8 attention stays near full precision (scales keep values inside the range)
    full = paged_attention_ref(query, batch.k_cache, batch.v_cache, batch.metadata, scale)
    assert (out.float() - full.float()).abs().max() < 0.25


def test_pack_and_unpack_move_fp8_bytes_untouched() -> None:
    torch.manual_seed(3)
    flat = (torch.randn(2, 2, 10, 8, 3, 16) * 50).to(FP8_DTYPE)
    ids = torch.tensor([7, 2, 9, 4])
    packed = pack_kv_blocks(flat[0, 0], flat[0, 1], ids)
    assert packed.dtype == FP8_DTYPE
    assert same_bytes(packed, pack_kv_blocks_ref(flat[0, 0], flat[0, 1], ids))
    dst_ids = torch.tensor([0, 5, 3, 8])
    unpack_kv_blocks(packed, flat[1, 0], flat[1, 1], dst_ids)
    assert same_bytes(flat[1, 0][dst_ids], flat[0, 0][ids])
    assert same_bytes(flat[1, 1][dst_ids], flat[0, 1][ids])
