"""Attention metadata: what one model step needs to know about the paged KV cache.

Built once per step by the model runner and passed explicitly to every attention call.
Tokens of all sequences in the step are flattened into one dimension (`num_tokens`),
sequence `i` owning rows `query_start_loc[i]:query_start_loc[i + 1]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    # [num_tokens] int64: flat cache slot (block_id * block_size + offset) of each new token
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int64: cumulative count of new (query) tokens per sequence
    query_start_loc: torch.Tensor
    # [num_seqs] int64: context length of each sequence after this step (cached + new)
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks] int64: block ids of each sequence, padded with 0
    block_tables: torch.Tensor
    # Python copies of the above, so kernels on the CPU never sync to read them
    query_lens_list: tuple[int, ...]
    seq_lens_list: tuple[int, ...]
    block_size: int

    def __post_init__(self) -> None:
        """Check the metadata's own consistency once per step (kernels then trust it)."""
        num_seqs = len(self.seq_lens_list)
        if len(self.query_lens_list) != num_seqs:
            raise ValueError(
                f"metadata has {len(self.query_lens_list)} query lens for {num_seqs} seqs"
            )
        for i, (q_len, s_len) in enumerate(
            zip(self.query_lens_list, self.seq_lens_list, strict=True)
        ):
            if not 0 <= q_len <= s_len:
                raise ValueError(f"sequence {i}: query_len={q_len} not in [0, seq_len={s_len}]")
        tables = self.block_tables
        if tables.dim() != 2 or tables.shape[0] != num_seqs or tables.dtype != torch.int64:
            raise ValueError(
                f"block_tables must be [{num_seqs}, max_num_blocks] int64, "
                f"got {tuple(tables.shape)} {tables.dtype}"
            )
        if tables.shape[1] * self.block_size < self.max_seq_len:
            raise ValueError(
                f"block_tables has {tables.shape[1]} columns, too few for seq_len "
                f"{self.max_seq_len} at block_size {self.block_size}"
            )
        if self.query_start_loc.shape != (num_seqs + 1,):
            raise ValueError(
                f"query_start_loc must be [{num_seqs + 1}], got {tuple(self.query_start_loc.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence contributes exactly one new token (the fast decode path)."""
        return all(n == 1 for n in self.query_lens_list)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)
