"""kernels package of pdserve."""

from kernels.cache_write import write_kv_cache, write_kv_cache_ref
from kernels.kv_pack import (
    pack_kv_blocks,
    pack_kv_blocks_ref,
    packed_shape,
    unpack_kv_blocks,
    unpack_kv_blocks_ref,
)
from kernels.metadata import AttentionMetadata
from kernels.paged_attention import paged_attention, paged_attention_ref

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
