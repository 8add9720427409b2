"""Which replica of a pool caches which prefixes: the index a replica router keeps.

Two sources, both bounded:

- **Digests.** Each replica publishes the keys of its prefix cache's most durable blocks in
  its routing stats (`replica/prefix_digest.py`, at most `DIGEST_MAX_BLOCKS`). A new digest
  replaces the replica's previous one, so evictions show in the next report; a digest not
  seen for `max_age_s` counts as empty (a replica that stopped reporting), and a replica
  that leaves the pool (stopped, restarted under a new name) is forgotten (`retain`).
- **Sends.** A report lags its replica by up to a stats period and a digest refresh, and a
  conversation's next turn (or another request of the same document) may come sooner. So
  the prompt blocks of each call this router sends count as cached on its replica for
  `sent_ttl_s`, after which the digest alone speaks; at most `max_sent` of them, oldest
  dropped first.

Pure Python with an injected clock; one instance per pool and process (`shared`), which
every replica router of the pool in that process feeds and reads, and which decode
overflow (`app/routing/overflow.py`) reads to keep a conversation on the pool holding its
history. Thread-safe: Serve may push replica updates from another thread than the one
choosing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from replica.prefix_digest import DIGEST_MAX_BLOCKS, KEY_BYTES, decode_digest, matched_blocks

DIGEST_MAX_AGE_S = 10.0  # reports come every second; ten missed means the replica is gone
SENT_TTL_S = 10.0  # covers the report lag (stats period, digest refresh, Serve's push)
# Blocks of a prompt hashed for a prefix lookup at most (32k tokens at 16 per block).
MAX_PROMPT_BLOCKS = 2048
MAX_SENT_KEYS = 65_536  # ~5 MiB at most; far above what ten seconds of sends name

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Digest:
    blob: bytes
    keys: frozenset[int]
    seen_at: float


class PrefixIndex:
    """replica name -> the block keys it caches (its latest digest, plus what this router
    sent it recently); `matched` is the longest cached prefix of a prompt's keys there."""

    def __init__(
        self,
        max_age_s: float = DIGEST_MAX_AGE_S,
        sent_ttl_s: float = SENT_TTL_S,
        max_sent: int = MAX_SENT_KEYS,
        max_digest_keys: int = DIGEST_MAX_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_age_s, self._sent_ttl_s, self._max_sent = max_age_s, sent_ttl_s, max_sent
        self._max_digest_bytes = max_digest_keys * KEY_BYTES
        self._clock = clock
        self._lock = threading.Lock()
        self._digests: dict[str, _Digest] = {}
        self._sent: OrderedDict[tuple[str, int], float] = OrderedDict()  # -> expiry
        self.block_size: int | None = None  # as the replicas report it

    def update(self, replica: str, stats: Mapping[str, Any]) -> None:
        """`replica`'s latest routing stats: its digest replaces the previous one (parsed
        only when it changed)."""
        blob = stats.get("prefix_digest")
        if not isinstance(blob, bytes):
            return
        if isinstance(size := stats.get("block_size"), int) and size > 0:
            self.block_size = size
        blob = blob[: self._max_digest_bytes]
        now = self._clock()
        with self._lock:
            previous = self._digests.get(replica)
        keys = previous.keys if previous is not None and previous.blob == blob else None
        digest = _Digest(blob, keys if keys is not None else decode_digest(blob), now)
        with self._lock:
            self._digests[replica] = digest

    def retain(self, replicas: Iterable[str]) -> None:
        """The pool's replicas now: forget every other one's digest and sends."""
        keep = set(replicas)
        with self._lock:
            self._retain(keep)

    def _retain(self, keep: set[str]) -> None:
        for name in [n for n in self._digests if n not in keep]:
            del self._digests[name]
        for entry in [e for e in self._sent if e[0] not in keep]:
            del self._sent[entry]

    def note_sent(self, replica: str, keys: Sequence[int]) -> None:
        """A call with these prompt block keys was sent to `replica`: they count as cached
        there for `sent_ttl_s`."""
        expiry = self._clock() + self._sent_ttl_s
        with self._lock:
            for key in keys:
                self._sent[(replica, key)] = expiry
                self._sent.move_to_end((replica, key))
            while len(self._sent) > self._max_sent:
                self._sent.popitem(last=False)

    def longest(self, keys: Sequence[int]) -> int:
        """Blocks of the longest prefix of `keys` cached on any of the pool's replicas."""
        with self._lock:
            replicas = set(self._digests) | {replica for replica, _ in self._sent}
        return max((self.matched(replica, keys) for replica in replicas), default=0)

    def matched(self, replica: str, keys: Sequence[int]) -> int:
        """Blocks of the longest prefix of `keys` cached on `replica`, as far as it knows."""
        if not keys:
            return 0
        now = self._clock()
        with self._lock:
            self._expire(now)
            digest = self._digests.get(replica)
            fresh = digest is not None and now - digest.seen_at <= self._max_age_s
            held = digest.keys if digest is not None and fresh else frozenset()
            sent = self._sent
            return matched_blocks(keys, lambda key: key in held or (replica, key) in sent)

    @property
    def num_keys(self) -> int:
        """Keys held in all (digests and sends): bounded by the replicas' digest size and
        `max_sent`."""
        with self._lock:
            return sum(len(d.keys) for d in self._digests.values()) + len(self._sent)

    def _expire(self, now: float) -> None:
        while self._sent and next(iter(self._sent.values())) <= now:
            self._sent.popitem(last=False)


class PerPool(Generic[T]):
    """pool (deployment) name -> one `T` for this process, made by `factory` on first use;
    thread-safe. What a process's replica routers share per pool: the prefix index (`shared`)
    and the prefix-routing counts (`prefix_choice.prefix_routing`)."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._pools: dict[str, T] = {}

    def pool(self, name: str) -> T:
        """The pool's `T`, created on first use."""
        with self._lock:
            if name not in self._pools:
                self._pools[name] = self._factory()
            return self._pools[name]

    def get(self, name: str) -> T | None:
        """The pool's `T`; None while nothing in this process has asked for it."""
        with self._lock:
            return self._pools.get(name)

    def items(self) -> list[tuple[str, T]]:
        """Every pool's `T`, by name."""
        with self._lock:
            return sorted(self._pools.items())


# Process-global: Serve builds the routers, and decode overflow reads what they know.
shared: PerPool[PrefixIndex] = PerPool(PrefixIndex)
