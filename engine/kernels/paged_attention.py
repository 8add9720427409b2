"""Paged attention over the block-table KV cache, for mixed prefill/decode batches.

Sequence `i` owns query rows `query_start_loc[i]:query_start_loc[i + 1]`; they are the last
`query_lens[i]` positions of its `seq_lens[i]`-token context, whose K/V (new tokens included)
are already in the cache. Each query attends causally to every context position up to its
own. Grouped-query attention: head `h` reads kv head `h // (num_heads // num_kv_heads)`.

On the CPU, decode sequences (one query each) run as one batch: gather their blocks, view
the queries as `[num_seqs, kvH, group, D]` so each kv head serves its whole query group, and
call SDPA's fused CPU kernel with a padding mask. Prefill sequences run one by one through
the same kernel with native GQA and an offset causal mask (no K/V repeat copies anywhere).

An FP8 cache (`engine.kernels.fp8`) is read through its per-head scales without a dequantizing
pass: FP8 values convert exactly to the query's dtype, the K scale is folded into each
head's query (`q·(s·k) = (s·q)·k`) and the V scale applied to each head's output
(attention is linear in V).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.kernels._checks import FLOAT_DTYPES, check_kv_caches
from engine.kernels.fp8 import check_kv_scales, dequantize_per_head, is_fp8
from engine.kernels.metadata import AttentionMetadata


def _check_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    check_kv_caches(k_cache, v_cache)
    check_kv_scales(k_cache, k_scale, v_scale)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(
            f"query must be [num_tokens, num_heads, {head_dim}], got {tuple(query.shape)}"
        )
    num_heads = query.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if is_fp8(k_cache) and query.dtype not in FLOAT_DTYPES:
        raise TypeError(f"query for an FP8 cache must be one of {FLOAT_DTYPES}, got {query.dtype}")
    if not is_fp8(k_cache) and query.dtype != k_cache.dtype:
        raise TypeError(f"query dtype {query.dtype} != cache dtype {k_cache.dtype}")
    if query.device != k_cache.device:
        raise ValueError(f"query on {query.device}, cache on {k_cache.device}")
    if metadata.block_size != block_size:
        raise ValueError(f"metadata.block_size={metadata.block_size} != cache's {block_size}")
    # The metadata's own consistency is checked once, when it is built (`__post_init__`).
    if metadata.num_tokens != query.shape[0]:
        raise ValueError(f"query has {query.shape[0]} tokens, metadata has {metadata.num_tokens}")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        if getattr(metadata, name).device != k_cache.device:
            raise ValueError(f"metadata.{name} must be on the cache's device {k_cache.device}")


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a step's new tokens over their sequences' paged KV cache.

    Args:
        query: `[num_tokens, num_heads, head_dim]`, rows grouped by sequence as in
            `metadata.query_start_loc`; any float dtype matching the cache.
        k_cache, v_cache: one layer's `[num_blocks, block_size, num_kv_heads, head_dim]`,
            already holding the step's new K/V.
        metadata: the step's attention metadata (`seq_lens` count the new tokens).
        scale: multiplier of `q @ k^T` (usually `head_dim ** -0.5`).
        k_scale, v_scale: float32 `[num_kv_heads]` dequantization scales of an FP8 cache
            (stored value * scale = K or V); None for any other cache.

    Returns:
        `[num_tokens, num_heads, head_dim]` in the query's dtype; softmax runs in float32.
    """
    _check_paged_attention(query, k_cache, v_cache, metadata, k_scale, v_scale)
    if query.is_cuda:
        from engine.kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, metadata, scale, k_scale, v_scale)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if k_scale is not None and v_scale is not None:
        group = query.shape[1] // k_cache.shape[2]
        # [num_heads, 1] scale of each query head's kv head
        k_heads = k_scale.repeat_interleave(group)[:, None]
        v_heads = v_scale.repeat_interleave(group)[:, None]
        scaled_query = (query.float() * k_heads).to(query.dtype)
        out = _attend(scaled_query, k_cache, v_cache, metadata, scale)
        return (out.float() * v_heads).to(query.dtype)
    return _attend(query, k_cache, v_cache, metadata, scale)


def _attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The CPU paths; the cache's values are read as the query's dtype."""
    if metadata.is_decode_only:
        return _decode(
            query,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.seq_lens_list,
            scale,
        )
    return _mixed(query, k_cache, v_cache, metadata, scale)


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """One query per sequence, all sequences in one fused call."""
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


def _prefill_one(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """The `query_len` newest positions of one sequence attend to its `seq_len` context."""
    query_len, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_blocks = -(-seq_len // block_size)
    block_ids = block_table[:num_blocks]
    # [1, kvH, seq_len, D] strided views over the gathered blocks
    keys = k_cache.index_select(0, block_ids).to(query.dtype).flatten(0, 1)[:seq_len]
    values = v_cache.index_select(0, block_ids).to(query.dtype).flatten(0, 1)[:seq_len]
    keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    queries = query.transpose(0, 1)[None]  # [1, num_heads, query_len, D]
    mask = None
    is_causal = query_len == seq_len and query_len > 1
    if 1 < query_len < seq_len:
        # [query_len, seq_len]: query j sits at position seq_len - query_len + j
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril_(
            seq_len - query_len
        )
    out = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out[0].transpose(0, 1)  # [query_len, num_heads, D]


def _mixed(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Decode sequences batched together, prefill sequences one by one."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    starts = [0]
    for query_len in metadata.query_lens_list:
        starts.append(starts[-1] + query_len)
    decode_ids = [i for i, n in enumerate(metadata.query_lens_list) if n == 1]
    batch_decode = len(decode_ids) > 1
    if batch_decode:
        seq_index = torch.tensor(decode_ids, dtype=torch.int64, device=query.device)
        rows = torch.tensor([starts[i] for i in decode_ids], device=query.device)
        decoded = _decode(
            query.index_select(0, rows),
            k_cache,
            v_cache,
            metadata.block_tables.index_select(0, seq_index),
            metadata.seq_lens.index_select(0, seq_index),
            [metadata.seq_lens_list[i] for i in decode_ids],
            scale,
        )
        out.index_copy_(0, rows, decoded)
    for i, (query_len, seq_len) in enumerate(
        zip(metadata.query_lens_list, metadata.seq_lens_list, strict=True)
    ):
        if query_len == 0 or (query_len == 1 and batch_decode):
            continue
        start, end = starts[i], starts[i + 1]
        out[start:end] = _prefill_one(
            query[start:end], k_cache, v_cache, metadata.block_tables[i], seq_len, scale
        )
    return out


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for `paged_attention`: per sequence, gather, repeat kv heads, masked softmax.

    Everything is computed in float32 (an FP8 cache dequantized first) and cast back to the
    query's dtype at the end.
    """
    num_heads = query.shape[1]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    start = 0
    for i, (query_len, seq_len) in enumerate(
        zip(metadata.query_lens_list, metadata.seq_lens_list, strict=True)
    ):
        end = start + query_len
        num_blocks = -(-seq_len // block_size)
        block_ids = metadata.block_tables[i, :num_blocks]
        # [seq_len, num_kv_heads, head_dim] -> [seq_len, num_heads, head_dim]
        keys = k_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        values = v_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        if k_scale is not None and v_scale is not None:
            keys = dequantize_per_head(keys, k_scale)
            values = dequantize_per_head(values, v_scale)
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        queries = query[start:end].float()  # [query_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        future = key_pos[None, :] > query_pos[:, None]  # [query_len, seq_len]
        scores = scores.masked_fill(future[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [num_heads, query_len, seq_len]
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
        start = end
    return out
