"""kernels package of pdserve."""

from engine.kernels.cache_write import write_kv_cache, write_kv_cache_ref
from engine.kernels.kv_pack import (
    pack_kv_blocks,
    pack_kv_blocks_ref,
    packed_shape,
    unpack_kv_blocks,
    unpack_kv_blocks_ref,
)
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.paged_attention import paged_attention, paged_attention_ref

__all__ = [
    "AttentionMetadata",
    "pack_kv_blocks",
    "pack_kv_blocks_ref",
    "packed_shape",
    "paged_attention",
    "paged_attention_ref",
    "unpack_kv_blocks",
    "unpack_kv_blocks_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]
