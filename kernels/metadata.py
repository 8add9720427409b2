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
