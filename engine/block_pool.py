"""The pool of KV cache blocks: free list, reference counts and the prefix cache.

Pure Python (no torch): a block is an integer id into the KV cache tensors. A block is
either *in use* (ref count > 0) or *free*. A free block may still hold the KV of a full,
hashed block of some earlier request: it stays findable in the prefix cache until it is
evicted (least recently freed first) to serve a new allocation.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], salt: str) -> bytes:
    """Chained hash of one full block: depends on every token before it and on `salt`.

    The salt is the tenant id, so two tenants with the same prompt never share blocks.
    Stable across processes (unlike `hash()`), so replicas can compare prefix hints.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash if parent_hash is not None else salt.encode() + b"\x00")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class BlockPool:
    """Owns every block id; hands them out and takes them back, with ref counts."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Free blocks in eviction order (oldest first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (cached-but-free blocks included)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (ref count 1 each), evicting their cached hashes.

        The caller checks `can_allocate` first; asking for more than is free is a bug.
        """
        assert self.can_allocate(num_blocks), (num_blocks, len(self._free))
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict_hash(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding `block_hash`'s KV, if still cached (does not take a reference)."""
        return self._hash_to_block.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (prefix-cache hits); revives free ones."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; at zero it returns to the free list.

        Pass blocks in the order their content should be evicted (the first evicted
        first): callers pass a request's table tail-first, so shared prefixes live longest.
        """
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            assert count > 0, f"block {block_id} freed more often than taken"
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Make a full, computed block findable by its hash (first writer wins)."""
        if not self.enable_prefix_caching or block_hash in self._hash_to_block:
            return
        if block_id in self._block_to_hash:
            return
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash

    def recent_block_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` cached block hashes, those an allocation would evict last first:
        blocks in use, then free cached blocks from the most recently freed. Read-only (the
        replica publishes them so that routers can find where a prefix is cached)."""
        if limit <= 0:
            return []
        hashes = [h for b, h in self._block_to_hash.items() if self._ref_counts[b] > 0]
        del hashes[limit:]
        for block_id in reversed(self._free):
            if len(hashes) >= limit:
                break
            if (block_hash := self._block_to_hash.get(block_id)) is not None:
                hashes.append(block_hash)
        return hashes

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change)."""
        self._hash_to_block.clear()
        self._block_to_hash.clear()

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._block_to_hash.pop(block_id, None)
        if block_hash is not None:
            del self._hash_to_block[block_hash]
