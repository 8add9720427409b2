"""Per-request block tables over the block pool, with prefix reuse.

Pure Python. The scheduler is the only caller: it asks `get_computed_blocks` at admission,
then `allocate_slots` every step (None = does not fit, which drives preemption), registers
newly computed full blocks with `cache_blocks`, and hands everything back with `free`.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import BlockPool, hash_block_tokens
from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._block_tables: dict[str, list[int]] = {}
        # Chained hashes of the request's full blocks known so far (tokens, not KV).
        self._block_hashes: dict[str, list[bytes]] = {}
        # How many leading blocks of the request's table are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty if it holds none)."""
        return self._block_tables.get(request_id, [])

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._block_tables

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest prefix of the request's tokens whose KV is cached: (block ids, tokens).

        Takes no references. At least one token is always left to compute, since the next
        token's logits come from computing the last one.
        """
        if not self.pool.enable_prefix_caching:
            return [], 0
        hashes = self._hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def cached_prefix_tokens(self, token_ids: Sequence[int], tenant: str) -> int:
        """Tokens of the longest prefix of `token_ids` whose KV is cached for `tenant`, as
        `get_computed_blocks` would find it (at least one token left to compute).

        Changes nothing and takes no references, so any thread may ask: the answer is a
        hint (blocks may be evicted before anyone pins them).
        """
        if not self.pool.enable_prefix_caching:
            return 0
        bs = self.block_size
        num_blocks = 0
        parent: bytes | None = None
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], tenant)
            if self.pool.lookup(parent) is None:
                break
            num_blocks += 1
        return num_blocks * bs

    def num_revived(self, computed_block_ids: list[int]) -> int:
        """Free blocks that starting on these cached blocks uses up: cached blocks that
        nobody holds sit in the free list."""
        return sum(1 for b in computed_block_ids if self.pool.ref_count(b) == 0)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_block_ids: list[int] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        With `computed_block_ids` (admission only), those cached blocks start the table.
        Returns the newly allocated block ids, or None when the pool cannot fit them (then
        nothing changes).
        """
        computed = computed_block_ids or []
        table = self._block_tables.get(request.request_id)
        if table is None:
            table = []
            num_tokens_before = len(computed) * self.block_size
        else:
            assert not computed, "cached prefix blocks can only start a new table"
            num_tokens_before = request.num_computed_tokens
        num_needed = self.num_blocks_for(num_tokens_before + num_new_tokens)
        num_new_blocks = max(0, num_needed - len(table) - len(computed))
        num_revived = self.num_revived(computed)
        if not self.pool.can_allocate(num_new_blocks + num_revived):
            return None
        if computed:
            self.pool.touch(computed)
            table.extend(computed)
            self._num_cached_blocks[request.request_id] = len(computed)
        new_block_ids = self.pool.allocate(num_new_blocks)
        table.extend(new_block_ids)
        self._block_tables[request.request_id] = table
        return new_block_ids

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.pool.enable_prefix_caching:
            return
        table = self._block_tables.get(request.request_id)
        if not table:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request | str) -> None:
        """Return every block the request holds (tail first, so shared prefixes live longest)."""
        request_id = request if isinstance(request, str) else request.request_id
        table = self._block_tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def _hashes(self, request: Request) -> list[bytes]:
        """Chained hashes of the request's full blocks of tokens, extended incrementally."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            tokens = request.all_token_ids
            bs = self.block_size
            for i in range(len(hashes), num_full):
                parent = hashes[i - 1] if i else None
                hashes.append(
                    hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], request.tenant)
                )
        return hashes
