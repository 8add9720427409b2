"""Shared builders for kernel tests: paged caches with known contents and their metadata."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from engine.kernels.metadata import AttentionMetadata

# (atol, rtol) of an optimized kernel against its reference, by dtype
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class PagedBatch:
    """A step's queries over a paged cache whose context K/V are also kept densely."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    metadata: AttentionMetadata


def build_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra_columns: int = 1,
) -> AttentionMetadata:
    """Metadata with random, distinct, unsorted block ids per sequence (uses torch's RNG).

    Block tables are zero-padded, with `extra_columns` more columns than the longest needs.
    """
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    if sum(blocks_needed) > num_blocks:
        raise ValueError("cache too small for the batch")
    pool = torch.randperm(num_blocks).tolist()
    width = max(blocks_needed, default=0) + extra_columns
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    slots: list[int] = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        ids = [pool.pop() for _ in range(blocks_needed[i])]
        tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        for pos in range(s_len - q_len, s_len):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int64),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int64),
        block_tables=tables,
        query_lens_list=tuple(query_lens),
        seq_lens_list=tuple(seq_lens),
        block_size=block_size,
    )


def make_paged_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 5,
) -> PagedBatch:
    """Random queries, context K/V placed in a random-filled cache through the block tables."""
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    metadata = build_metadata(query_lens, seq_lens, block_size, num_blocks)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Garbage everywhere, so reading a wrong slot cannot go unnoticed.
    k_cache = (torch.randn(cache_shape) * 100).to(dtype)
    v_cache = (torch.randn(cache_shape) * 100).to(dtype)
    keys, values = [], []
    for i, s_len in enumerate(seq_lens):
        k = torch.randn(s_len, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(s_len, num_kv_heads, head_dim).to(dtype)
        positions = torch.arange(s_len)
        blocks = metadata.block_tables[i, positions // block_size]
        k_cache[blocks, positions % block_size] = k
        v_cache[blocks, positions % block_size] = v
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    return PagedBatch(query, k_cache, v_cache, keys, values, metadata)


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    """Factory fixture: `paged_batch(query_lens, seq_lens, num_heads=..., ...)`."""
    return make_paged_batch


@pytest.fixture
def metadata_builder() -> Callable[..., AttentionMetadata]:
    """Factory fixture: `metadata_builder(query_lens, seq_lens, block_size, num_blocks)`."""
    return build_metadata


@pytest.fixture
def tolerances() -> dict[torch.dtype, tuple[float, float]]:
    return TOLERANCES
