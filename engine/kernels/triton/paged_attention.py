"""Triton paged attention: one program per (sequence, kv head, tile of query tokens).

A program packs `BLOCK_Q` query tokens times the kv head's query group into the rows of one
tile, so each K/V element it loads serves the whole group (GQA without copies), and walks the
sequence's context `TILE_N` keys at a time through its block table with an online softmax in
float32. Keys after a row's own position are masked (causal, offset by the cached prefix).
Decode (one token per sequence) is the same kernel with `BLOCK_Q` tokens of which one is real.
An FP8 cache's values convert exactly to the query's dtype; the program's kv head has one K
and one V scale, applied to the scores and to the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.metadata import AttentionMetadata


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_tile * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - query_len  # context position of the sequence's first query

        # rows = (token of the tile, head of the group), flattened
        rows = tl.arange(0, BLOCK_Q * BLOCK_G)
        token = q_tile * BLOCK_Q + rows // BLOCK_G
        head = kv_head * GROUP + rows % BLOCK_G
        row_valid = (token < query_len) & (rows % BLOCK_G < GROUP)
        query_pos = first_pos + token
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM

        q_ptrs = (
            query_ptr
            + (query_start + token).to(tl.int64)[:, None] * stride_qt
            + head[:, None] * stride_qh
            + dims[None, :] * stride_qd
        )
        # [BLOCK_Q * BLOCK_G, BLOCK_D]
        q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

        score_scale = scale
        out_scale = 1.0
        if IS_FP8:
            score_scale = scale * tl.load(k_scale_ptr + kv_head)
            out_scale = tl.load(v_scale_ptr + kv_head)

        m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], dtype=tl.float32)

        # keys past the tile's last query position are masked for every row: skip them
        kv_end = first_pos + tl.minimum((q_tile + 1) * BLOCK_Q, query_len)
        for kv_start in range(0, kv_end, TILE_N):
            key_pos = kv_start + tl.arange(0, TILE_N)
            key_valid = key_pos < kv_end
            block = tl.load(
                block_tables_ptr + seq.to(tl.int64) * stride_bt + key_pos // BLOCK_SIZE,
                mask=key_valid,
                other=0,
            ).to(tl.int64)
            offset = key_pos % BLOCK_SIZE
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            # [TILE_N, BLOCK_D]
            k = tl.load(
                k_cache_ptr
                + block[:, None] * stride_kb
                + offset[:, None] * stride_ks
                + kv_head * stride_kh
                + dims[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                v_cache_ptr
                + block[:, None] * stride_vb
                + offset[:, None] * stride_vs
                + kv_head * stride_vh
                + dims[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            )
            if IS_FP8:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            # [BLOCK_Q * BLOCK_G, TILE_N]
            scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * score_scale
            allowed = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
            scores = tl.where(allowed, scores, float("-inf"))
            # every row sees key 0 in the first tile, so m_new is finite from then on
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
            m_i = m_new

        out = acc * (out_scale / l_i[:, None])
        o_ptrs = (
            out_ptr
            + (query_start + token).to(tl.int64)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :] * stride_od
        )
        tl.store(
            o_ptrs,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`engine.kernels.paged_attention.paged_attention` in Triton; arguments already checked."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    is_fp8 = k_scale is not None and v_scale is not None
    block_g = triton.next_power_of_2(group)
    max_query_len = max(metadata.query_lens_list)
    # tl.dot wants >= 16 rows; decode fills them with masked tokens, prefill takes 64
    rows = 16 if max_query_len == 1 else 64
    block_q = max(1, rows // block_g)
    grid = (metadata.num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        k_scale if is_fp8 else metadata.seq_lens,  # unread unless IS_FP8
        v_scale if is_fp8 else metadata.seq_lens,
        scale,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        metadata.block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        TILE_N=max(32, triton.next_power_of_2(block_size)),
        INPUT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        IS_FP8=is_fp8,
    )
    return out
