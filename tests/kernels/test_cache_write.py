"""write_kv_cache equals its reference and writes exactly the mapped slots."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cache_write import write_kv_cache, write_kv_cache_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GEOMETRIES = [(4, 16, 16), (2, 64, 8), (3, 64, 16), (3, 16, 8)]  # (kvH, head_dim, block_size)


def layer_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    layer: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V as views of a flat `[layers, 2, blocks, bs, kvH, D]` buffer."""
    flat = torch.randn(num_layers, 2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    return flat[layer, 0], flat[layer, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_matches_reference(
    geometry: tuple[int, int, int], dtype: torch.dtype, num_tokens: int
) -> None:
    torch.manual_seed(0)
    kv_heads, head_dim, block_size = geometry
    num_blocks = 12
    k_cache, v_cache = layer_caches(3, num_blocks, block_size, kv_heads, head_dim, dtype, 1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    key = torch.randn(num_tokens, kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim).to(dtype)

    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    write_kv_cache_ref(key, value, k_ref, v_ref, slot_mapping)

    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    torch.testing.assert_close(k_cache[blocks, offsets], key, atol=0, rtol=0)
    torch.testing.assert_close(v_cache[blocks, offsets], value, atol=0, rtol=0)


def test_strided_key_and_value() -> None:
    """K/V sliced out of a fused projection are written without the caller copying them."""
    torch.manual_seed(1)
    k_cache, v_cache = layer_caches(1, 4, 8, 2, 16, torch.float32, 0)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv = torch.randn(5, 4, 16)
    key, value = kv[:, :2], kv[:, 2:]
    slot_mapping = torch.tensor([3, 30, 8, 17, 0])
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    write_kv_cache_ref(key, value, k_ref, v_ref, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


def test_empty_is_a_no_op() -> None:
    k_cache, v_cache = layer_caches(1, 2, 8, 2, 16, torch.float32, 0)
    before = k_cache.clone()
    empty = torch.empty(0, 2, 16)
    write_kv_cache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(k_cache, before)


def test_rejects_bad_inputs() -> None:
    k_cache, v_cache = layer_caches(1, 4, 8, 2, 16, torch.float32, 0)
    key = torch.randn(3, 2, 16)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="slot_mapping"):
        write_kv_cache(key, key, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match="entries"):
        write_kv_cache(key, key, k_cache, v_cache, slots[:2])
    with pytest.raises(TypeError, match="dtype"):
        write_kv_cache(key.half(), key.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="key must be"):
        write_kv_cache(torch.randn(3, 4, 16), torch.randn(3, 4, 16), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="value shape"):
        write_kv_cache(key, key[:2], k_cache, v_cache, slots)
    # blocks whose slots are not packed together cannot be addressed by flat slot
    k_odd = torch.randn(8, 4, 2, 16).transpose(0, 1)
    with pytest.raises(ValueError, match="stride"):
        write_kv_cache(key, key, k_odd, k_odd.clone(), slots)
