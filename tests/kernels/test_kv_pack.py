"""pack/unpack_kv_blocks equal their references and round-trip blocks between caches."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kv_pack import (
    pack_kv_blocks,
    pack_kv_blocks_ref,
    packed_shape,
    unpack_kv_blocks,
    unpack_kv_blocks_ref,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GEOMETRIES = [(4, 16, 16), (2, 64, 8), (3, 64, 16)]  # (kvH, head_dim, block_size)
NUM_BLOCKS = 20


def layer_caches(
    geometry: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's K and V, views of a flat `[layers, 2, blocks, bs, kvH, D]` buffer."""
    kv_heads, head_dim, block_size = geometry
    flat = torch.randn(2, 2, NUM_BLOCKS, block_size, kv_heads, head_dim).to(dtype)
    return flat[1, 0], flat[1, 1]


def random_ids(num_ids: int) -> torch.Tensor:
    """Distinct, unsorted, non-contiguous block ids."""
    return torch.randperm(NUM_BLOCKS)[:num_ids]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_pack_matches_reference(geometry: tuple[int, int, int], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    k_cache, v_cache = layer_caches(geometry, dtype)
    ids = random_ids(7)
    packed = pack_kv_blocks(k_cache, v_cache, ids)
    assert packed.shape == packed_shape(k_cache, 7) and packed.is_contiguous()
    torch.testing.assert_close(packed, pack_kv_blocks_ref(k_cache, v_cache, ids), atol=0, rtol=0)
    torch.testing.assert_close(packed[0, 3], k_cache[ids[3]], atol=0, rtol=0)
    torch.testing.assert_close(packed[1, 6], v_cache[ids[6]], atol=0, rtol=0)


def test_pack_into_preallocated_buffer_and_from_list() -> None:
    torch.manual_seed(1)
    k_cache, v_cache = layer_caches(GEOMETRIES[0], torch.float32)
    ids = [13, 2, 7, 19]
    out = torch.empty(packed_shape(k_cache, len(ids)))
    packed = pack_kv_blocks(k_cache, v_cache, ids, out=out)
    assert packed is out
    torch.testing.assert_close(out, pack_kv_blocks_ref(k_cache, v_cache, ids), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_unpack_matches_reference(geometry: tuple[int, int, int], dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    k_cache, v_cache = layer_caches(geometry, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ids = random_ids(5)
    buffer = torch.randn(packed_shape(k_cache, 5)).to(dtype)
    unpack_kv_blocks(buffer, k_cache, v_cache, ids)
    unpack_kv_blocks_ref(buffer, k_ref, v_ref, ids)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


def test_round_trip_between_caches() -> None:
    """Blocks packed from a prefill cache land unchanged at other ids of a decode cache."""
    torch.manual_seed(3)
    src_k, src_v = layer_caches(GEOMETRIES[2], torch.bfloat16)
    dst_k, dst_v = layer_caches(GEOMETRIES[2], torch.bfloat16)
    untouched_k = dst_k.clone()
    src_ids, dst_ids = random_ids(6), random_ids(6)
    unpack_kv_blocks(pack_kv_blocks(src_k, src_v, src_ids), dst_k, dst_v, dst_ids)
    torch.testing.assert_close(dst_k[dst_ids], src_k[src_ids], atol=0, rtol=0)
    torch.testing.assert_close(dst_v[dst_ids], src_v[src_ids], atol=0, rtol=0)
    others = torch.ones(NUM_BLOCKS, dtype=torch.bool)
    others[dst_ids] = False
    torch.testing.assert_close(dst_k[others], untouched_k[others], atol=0, rtol=0)


def test_empty_ids() -> None:
    k_cache, v_cache = layer_caches(GEOMETRIES[0], torch.float32)
    packed = pack_kv_blocks(k_cache, v_cache, [])
    assert packed.shape == packed_shape(k_cache, 0)
    unpack_kv_blocks(packed, k_cache, v_cache, [])


def test_rejects_bad_inputs() -> None:
    k_cache, v_cache = layer_caches(GEOMETRIES[0], torch.float32)
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="shape"):
        pack_kv_blocks(k_cache, v_cache, ids, out=torch.empty(packed_shape(k_cache, 3)))
    with pytest.raises(TypeError, match="dtype"):
        pack_kv_blocks(k_cache, v_cache, ids, out=torch.empty(packed_shape(k_cache, 2)).half())
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.empty(2, 2, *k_cache.shape[1:-1], 2 * k_cache.shape[-1])[..., ::2]
        pack_kv_blocks(k_cache, v_cache, ids, out=strided)
    with pytest.raises(TypeError, match="block_ids"):
        pack_kv_blocks(k_cache, v_cache, ids.int())
    with pytest.raises(ValueError, match="buffer"):
        unpack_kv_blocks(torch.empty(packed_shape(k_cache, 3)), k_cache, v_cache, ids)
    with pytest.raises(TypeError, match="k_cache/v_cache"):
        pack_kv_blocks(k_cache, v_cache.half(), ids)
