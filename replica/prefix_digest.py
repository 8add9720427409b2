"""Where a prefix is cached: the digest a replica publishes of its prefix cache, and the keys
a router computes for a prompt to look it up.

A replica's prefix cache names each full block by a chained, tenant-salted hash
(`engine.block_pool.hash_block_tokens`): block i's hash depends on every token up to the end
of block i and on the tenant. A router that hashes a prompt's blocks the same way (same
block size, same tenant) knows the prompt's first k blocks are cached on a replica when the
replica's digest holds the first k keys. Keys are the hashes' first `KEY_BYTES` bytes, as
integers: a digest of `DIGEST_MAX_BLOCKS` keys is 32 KiB on the wire.

The replica side, `PrefixDigest`, rebuilds its digest on the engine thread (the block pool
is the engine thread's; nothing else may read it while a step runs) at most once per
`refresh_s`, and hands out the latest one without waiting: routing stats never block.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Sequence

from engine.block_pool import BlockPool, hash_block_tokens

KEY_BYTES = 8
# Blocks a digest names at most: the cached blocks least likely to be evicted next.
DIGEST_MAX_BLOCKS = 4096
DIGEST_REFRESH_S = 0.5  # under the routing stats period (1 s), so each report is fresh


def block_key(block_hash: bytes) -> int:
    """A block hash as a digest key."""
    return int.from_bytes(block_hash[:KEY_BYTES], "little")


def encode_digest(block_hashes: Iterable[bytes]) -> bytes:
    """The wire form of a digest: each hash's first `KEY_BYTES` bytes, concatenated."""
    return b"".join(h[:KEY_BYTES] for h in block_hashes)


def decode_digest(blob: bytes) -> frozenset[int]:
    """The keys of a digest's wire form (a trailing partial key is ignored)."""
    end = len(blob) - len(blob) % KEY_BYTES
    return frozenset(
        int.from_bytes(blob[i : i + KEY_BYTES], "little") for i in range(0, end, KEY_BYTES)
    )


def prompt_block_keys(
    token_ids: Sequence[int], block_size: int, tenant: str, max_blocks: int | None = None
) -> list[int]:
    """The keys of the prompt's full blocks, in order (as the engine's prefix cache hashes
    them for `tenant`), at most `max_blocks` of them."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    keys: list[int] = []
    parent: bytes | None = None
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], tenant)
        keys.append(block_key(parent))
    return keys


def matched_blocks(keys: Sequence[int], held: Callable[[int], bool]) -> int:
    """How many leading keys are held: the blocks of the longest cached prefix (the engine
    too stops at the first block it lacks)."""
    for i, key in enumerate(keys):
        if not held(key):
            return i
    return len(keys)


class PrefixDigest:
    """A replica's latest digest of its block pool, rebuilt on the engine thread.

    `run_on_engine` runs a function on the engine thread between steps and returns its
    future (`AsyncEngine.call`). `current()` is safe from any thread and never waits.
    """

    def __init__(
        self,
        pool: BlockPool,
        run_on_engine: Callable[[Callable[[], bytes]], concurrent.futures.Future[bytes]],
        max_blocks: int = DIGEST_MAX_BLOCKS,
        refresh_s: float = DIGEST_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool, self._run = pool, run_on_engine
        self._max_blocks, self._refresh_s, self._clock = max_blocks, refresh_s, clock
        self._blob = b""
        self._pending: concurrent.futures.Future[bytes] | None = None
        self._asked_at = -float("inf")

    def current(self) -> bytes:
        """The latest digest (b"" until the first is built); asks for a newer one when the
        latest is older than `refresh_s` and none is being built."""
        now = self._clock()
        if self._pending is None and now - self._asked_at >= self._refresh_s:
            self._asked_at = now
            try:
                self._pending = self._run(self._build)
            except Exception:  # noqa: BLE001 - a stopped engine keeps the last digest
                return self._blob
            self._pending.add_done_callback(self._done)
        return self._blob

    def _build(self) -> bytes:
        return encode_digest(self._pool.recent_block_hashes(self._max_blocks))

    def _done(self, future: concurrent.futures.Future[bytes]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._blob = future.result()  # one reference swap: readers need no lock
        self._pending = None
