"""KV heads re-sharded between tensor-parallel sizes: prefill TP=a into decode TP=b.

Both ends split a layer's KV heads the same way (`engine.parallel.split`: contiguous,
the first ranks one more), so decode rank j's heads of layer l are the union of pieces of
prefill ranks' heads. The sender builds each of the receiver's items (layer l, rank j)
from its own items of layer l, in the receiver's geometry (`KVLayout.head_slots` wide,
unused slots zero), and sends it as an ordinary item: the data paths and the receiver
stay as they are. Built once a layer is written by every rank (the layer hook).

    a=2, b=1, 3 KV heads:   src item (l, 0) = heads 0 1   ─┐
                            src item (l, 1) = head  2 _   ─┴─▶ dst item (l, 0) = heads 0 1 2
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_cache import KVCache
from engine.parallel import split
from kvtransfer.base import KVLayout


@dataclass(frozen=True, slots=True)
class Piece:
    """Heads `src_slots` of source rank `src_rank`'s item land in `dst_slots` of the
    destination item."""

    src_rank: int
    src_slots: slice
    dst_slots: slice


@dataclass(frozen=True, slots=True)
class Resharding:
    """From a cache of layout `src` to the items of a receiver of layout `dst` (same model,
    another `tensor_parallel_size`)."""

    src: KVLayout
    dst: KVLayout

    def pieces(self, dst_rank: int) -> list[Piece]:
        """Where destination rank `dst_rank`'s heads come from."""
        heads, a = self.dst.num_kv_heads, self.src.tensor_parallel_size
        want = split(heads, dst_rank, self.dst.tensor_parallel_size)
        pieces = []
        for rank in range(a):
            have = split(heads, rank, a)
            start, stop = max(want.start, have.start), min(want.stop, have.stop)
            if start < stop:
                pieces.append(
                    Piece(
                        rank,
                        slice(start - have.start, stop - have.start),
                        slice(start - want.start, stop - want.start),
                    )
                )
        return pieces

    def items(
        self, cache: KVCache, layer: int, block_ids: np.ndarray
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """The receiver's items of model layer `layer` for the source blocks `block_ids`, as
        `(item index, K, V)`: contiguous `[len(block_ids), block_size, dst.head_slots,
        head_dim]` tensors
        whose block i is source block `block_ids[i]`. Every rank of `cache` must have
        written the layer."""
        a, b = self.src.tensor_parallel_size, self.dst.tensor_parallel_size
        index = torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64))
        # each source item's blocks gathered once: [n, block_size, slots_a, head_dim]
        gathered = [
            (
                cache.key_caches[layer * a + rank].index_select(0, index),
                cache.value_caches[layer * a + rank].index_select(0, index),
            )
            for rank in range(a)
        ]
        shape = (len(index), *self.dst.cache_spec(len(index)).block_shape)
        for rank in range(b):
            k = torch.zeros(shape, dtype=cache.spec.torch_dtype)
            v = torch.zeros(shape, dtype=cache.spec.torch_dtype)
            for piece in self.pieces(rank):
                src_k, src_v = gathered[piece.src_rank]
                k[:, :, piece.dst_slots] = src_k[:, :, piece.src_slots]
                v[:, :, piece.dst_slots] = src_v[:, :, piece.src_slots]
            yield layer * b + rank, k, v
