"""Paged attention over the block-table KV cache, for mixed prefill/decode batches.

Sequence `i` owns query rows `query_start_loc[i]:query_start_loc[i + 1]`; they are the last
`query_lens[i]` positions of its `seq_lens[i]`-token context, whose K/V (new tokens included)
are already in the cache. Each query attends causally to every context position up to its
own. Grouped-query attention: head `h` reads kv head `h // (num_heads // num_kv_heads)`.

On the CPU, decode sequences (one query each) run as one batch through
`engine.kernels.decode_attention` (a C kernel reading each context once; its torch form
gathers the blocks and calls SDPA). Prompts computed whole in the step attend
to the step's new K/V when the caller passes them (no gather), each run of adjacent
equal-length ones in one call; other prefill sequences run one by one through the same
kernel on their gathered blocks with an offset causal mask. GQA is native everywhere (no
K/V repeat copies).

An FP8 cache (`engine.kernels.fp8`) is read through its per-head scales without a dequantizing
pass: FP8 values convert exactly to the query's dtype, the K scale is folded into each
head's query (`q·(s·k) = (s·q)·k`) and the V scale applied to each head's output
(attention is linear in V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._checks import FLOAT_DTYPES, check_kv_caches
from engine.kernels.decode_attention import decode_attention
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
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
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
        key, value: optionally the step's new K/V `[num_tokens, num_kv_heads, head_dim]`,
            as just written to the cache: on the CPU, prompts computed whole in this step
            attend to them directly (no gather), runs of equal-length ones in one call.
            Ignored for an FP8 cache (attention reads the stored values) and on CUDA.

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
    if key is not None and value is not None:
        _check_new_kv(query, key, value, k_cache)
        return _attend(query, k_cache, v_cache, metadata, scale, (key, value))
    return _attend(query, k_cache, v_cache, metadata, scale)


def _check_new_kv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor
) -> None:
    expected = (query.shape[0], *k_cache.shape[2:])
    if key.shape != expected or value.shape != expected:
        raise ValueError(
            f"key/value must be {list(expected)}, got {tuple(key.shape)}/{tuple(value.shape)}"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"key/value {key.dtype}/{value.dtype} must be the query's {query.dtype}")


def _attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The CPU paths; the cache's values are read as the query's dtype."""
    if metadata.is_decode_only:
        return decode_attention(
            query,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.seq_lens_list,
            scale,
        )
    return _mixed(query, k_cache, v_cache, metadata, scale, new_kv)


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


def _fresh_prompts(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    start: int,
    num_seqs: int,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """`num_seqs` adjacent prompts of `seq_len` tokens, each computed whole in this step:
    causal attention over their own new K/V, one call. Rows `start:` of the step."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    end = start + num_seqs * seq_len
    # [num_seqs, heads, seq_len, D] strided views of the step's rows
    queries = query[start:end].view(num_seqs, seq_len, num_heads, head_dim).transpose(1, 2)
    keys = key[start:end].view(num_seqs, seq_len, num_kv_heads, head_dim).transpose(1, 2)
    values = value[start:end].view(num_seqs, seq_len, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        is_causal=seq_len > 1,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.transpose(1, 2).reshape(end - start, num_heads, head_dim)


def _fresh_runs(metadata: AttentionMetadata) -> list[tuple[int, int, int]]:
    """(first sequence, number of sequences, length) of each run of adjacent prompts that
    are computed whole in this step (query_len == seq_len > 1) and equally long."""
    runs: list[tuple[int, int, int]] = []
    for i, (query_len, seq_len) in enumerate(
        zip(metadata.query_lens_list, metadata.seq_lens_list, strict=True)
    ):
        if query_len != seq_len or query_len < 2:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i and runs[-1][2] == seq_len:
            first, count, _ = runs[-1]
            runs[-1] = (first, count + 1, seq_len)
        else:
            runs.append((i, 1, seq_len))
    return runs


def _mixed(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode sequences batched together, whole prompts by runs from the new K/V (when
    given), other prefill sequences one by one from the cache."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    starts = [0]
    for query_len in metadata.query_lens_list:
        starts.append(starts[-1] + query_len)
    done = [n == 0 for n in metadata.query_lens_list]
    decode_ids = [i for i, n in enumerate(metadata.query_lens_list) if n == 1]
    if len(decode_ids) > 1:
        seq_index = torch.tensor(decode_ids, dtype=torch.int64, device=query.device)
        rows = torch.tensor([starts[i] for i in decode_ids], device=query.device)
        decoded = decode_attention(
            query.index_select(0, rows),
            k_cache,
            v_cache,
            metadata.block_tables.index_select(0, seq_index),
            metadata.seq_lens.index_select(0, seq_index),
            [metadata.seq_lens_list[i] for i in decode_ids],
            scale,
        )
        out.index_copy_(0, rows, decoded)
        for i in decode_ids:
            done[i] = True
    if new_kv is not None:
        for first, count, seq_len in _fresh_runs(metadata):
            start, end = starts[first], starts[first + count]
            out[start:end] = _fresh_prompts(query, *new_kv, start, count, seq_len, scale)
            done[first : first + count] = [True] * count
    for i, seq_len in enumerate(metadata.seq_lens_list):
        if done[i]:
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
