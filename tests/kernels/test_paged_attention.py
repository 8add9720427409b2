"""paged_attention equals its reference; the reference equals dense causal attention."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.paged_attention import paged_attention, paged_attention_ref

HEADS = [(4, 4), (4, 2), (9, 3)]  # (num_heads, num_kv_heads)
# (num_heads, num_kv_heads, head_dim, block_size): every value of each axis appears
GEOMETRIES = [(4, 4, 16, 16), (4, 2, 64, 8), (9, 3, 64, 16), (9, 3, 16, 8)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (query_lens, seq_lens) per batch kind
BATCHES = {
    "decode": ([1] * 6, [1, 16, 17, 40, 63, 8]),
    "prefill": ([23, 16, 1, 40], [23, 16, 1, 40]),
    "chunked_prefix": ([9, 16, 3], [30, 48, 20]),
    "mixed": ([20, 1, 17, 1, 5, 1, 0], [50, 33, 17, 64, 9, 1, 12]),
    "mixed_one_decode": ([12, 1], [40, 25]),
    # runs of adjacent whole prompts of equal length, split by other kinds
    "prompt_runs": ([16, 16, 16, 1, 9, 9, 3, 30, 5], [16, 16, 16, 20, 9, 9, 12, 40, 5]),
}


def dense_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence's attention on contiguous K/V, via SDPA on repeated kv heads (float32)."""
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq_len, D]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    q = query.float().transpose(0, 1)  # [H, query_len, D]
    allowed = torch.ones(query_len, seq_len, dtype=torch.bool).tril(seq_len - query_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("heads", HEADS)
def test_reference_matches_dense_attention(
    paged_batch: Callable, kind: str, heads: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    query_lens, seq_lens = BATCHES[kind]
    num_heads, num_kv_heads = heads
    batch = paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=8,
    )
    scale = 0.3
    out = paged_attention_ref(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale)
    start = 0
    for q_len, keys, values in zip(query_lens, batch.keys, batch.values, strict=True):
        expected = dense_causal_attention(batch.query[start : start + q_len], keys, values, scale)
        torch.testing.assert_close(out[start : start + q_len], expected, atol=1e-5, rtol=1e-5)
        start += q_len


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_matches_reference(
    paged_batch: Callable,
    tolerances: dict,
    kind: str,
    geometry: tuple[int, int, int, int],
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(1)
    query_lens, seq_lens = BATCHES[kind]
    num_heads, num_kv_heads, head_dim, block_size = geometry
    batch = paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    scale = head_dim**-0.5
    args = (batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale)
    out = paged_attention(*args)
    assert out.shape == batch.query.shape and out.dtype == dtype
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(out, paged_attention_ref(*args), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("kind", ["prefill", "mixed", "prompt_runs"])
def test_new_kv_matches_reference(
    paged_batch: Callable,
    tolerances: dict,
    kind: str,
    geometry: tuple[int, int, int, int],
    dtype: torch.dtype,
) -> None:
    """Given the step's new K/V, whole prompts attend to them: same result as the cache."""
    torch.manual_seed(5)
    query_lens, seq_lens = BATCHES[kind]
    num_heads, num_kv_heads, head_dim, block_size = geometry
    batch = paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    # the step's new rows of each sequence: its last query_len context positions
    new = [
        (k[s - q :], v[s - q :])
        for k, v, q, s in zip(batch.keys, batch.values, query_lens, seq_lens, strict=True)
    ]
    key = torch.cat([k for k, _ in new])
    value = torch.cat([v for _, v in new])
    scale = head_dim**-0.5
    args = (batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale)
    out = paged_attention(*args, key=key, value=value)
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(out, paged_attention_ref(*args), atol=atol, rtol=rtol)


def test_new_kv_is_what_whole_prompts_read(paged_batch: Callable) -> None:
    """Whole prompts read the given K/V, not the cache (whose copy is stale here)."""
    torch.manual_seed(6)
    batch = paged_batch([8, 8], [8, 8], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.25)
    key, value = torch.cat(batch.keys), torch.cat(batch.values)
    other_value = torch.randn_like(value)
    from_cache = paged_attention(*args)
    torch.testing.assert_close(paged_attention(*args, key=key, value=value), from_cache)
    assert not torch.allclose(paged_attention(*args, key=key, value=other_value), from_cache)
    with pytest.raises(ValueError, match="key/value"):
        paged_attention(*args, key=key[:3], value=value[:3])


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [7, 1, 3]])
def test_strided_query_from_fused_projection(paged_batch: Callable, query_lens: list[int]) -> None:
    """Queries sliced out of a fused QKV projection (non-contiguous rows) work unchanged."""
    torch.manual_seed(2)
    batch = paged_batch(
        query_lens, [32, 9, 16], num_heads=9, num_kv_heads=3, head_dim=16, block_size=16
    )
    num_tokens = batch.query.shape[0]
    qkv = torch.randn(num_tokens, 15, 16)
    qkv[:, :9] = batch.query
    query = qkv[:, :9]  # [num_tokens, 9, 16], row stride 15 * 16
    assert not query.is_contiguous()
    args = (batch.k_cache, batch.v_cache, batch.metadata, 0.25)
    torch.testing.assert_close(
        paged_attention(query, *args),
        paged_attention_ref(batch.query, *args),
        atol=2e-5,
        rtol=1e-4,
    )


def test_decode_without_padding_mask(paged_batch: Callable) -> None:
    """Every context fills its blocks exactly, so the decode path runs unmasked."""
    torch.manual_seed(3)
    batch = paged_batch([1, 1], [32, 32], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.25)
    torch.testing.assert_close(paged_attention(*args), paged_attention_ref(*args))


def test_rejects_bad_inputs(paged_batch: Callable) -> None:
    torch.manual_seed(4)
    batch = paged_batch([3, 1], [10, 5], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    q, k, v, md = batch.query, batch.k_cache, batch.v_cache, batch.metadata
    with pytest.raises(TypeError, match="dtype"):
        paged_attention(q.half(), k, v, md, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(torch.randn(4, 3, 16), k, v, md, 1.0)
    with pytest.raises(ValueError, match="tokens"):
        paged_attention(q[:3], k, v, md, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention(q, k, v, dataclasses.replace(md, block_size=16), 1.0)
    with pytest.raises(ValueError, match="columns"):
        paged_attention(q, k, v, dataclasses.replace(md, block_tables=md.block_tables[:, :1]), 1.0)
    with pytest.raises(ValueError, match="v_cache shape"):
        paged_attention(q, k, v[:, :4], md, 1.0)
