"""The index of which replica caches which prefixes (`app/routing/prefix_index.py`):
digests replace each other, stale ones and departed replicas are forgotten, the router's own
sends count until reports can show them, and it stays bounded."""

from __future__ import annotations

from app.routing.prefix_index import PerPool, PrefixIndex
from replica.prefix_digest import KEY_BYTES


def digest(*keys: int) -> dict[str, object]:
    blob = b"".join(k.to_bytes(KEY_BYTES, "little") for k in keys)
    return {"prefix_digest": blob, "block_size": 16}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_new_digest_replaces_the_old_one() -> None:
    index = PrefixIndex(clock=Clock())
    assert index.block_size is None
    index.update("a", digest(1, 2, 3))
    assert index.block_size == 16
    assert index.matched("a", [1, 2, 3, 4]) == 3
    assert index.matched("b", [1, 2, 3, 4]) == 0
    index.update("a", digest(1))  # the replica evicted blocks 2 and 3
    assert index.matched("a", [1, 2, 3]) == 1
    index.update("a", {"queued_tokens": 0})  # stats without a digest change nothing
    assert index.matched("a", [1, 2]) == 1


def test_the_longest_prefix_stops_at_the_first_missing_block() -> None:
    index = PrefixIndex(clock=Clock())
    index.update("a", digest(1, 3, 4))
    assert index.matched("a", [1, 2, 3, 4]) == 1
    assert index.matched("a", [9, 1]) == 0
    assert index.matched("a", []) == 0


def test_a_digest_not_seen_for_max_age_counts_as_empty() -> None:
    clock = Clock()
    index = PrefixIndex(max_age_s=10.0, clock=clock)
    index.update("a", digest(1, 2))
    clock.now += 10.0
    assert index.matched("a", [1, 2]) == 2
    clock.now += 0.1
    assert index.matched("a", [1, 2]) == 0
    index.update("a", digest(1, 2))  # reporting again
    assert index.matched("a", [1, 2]) == 2


def test_replicas_that_leave_the_pool_are_forgotten() -> None:
    index = PrefixIndex(clock=Clock())
    index.update("a", digest(1, 2))
    index.update("b", digest(1))
    index.note_sent("a", [1, 2, 3])
    index.retain(["b", "c"])  # a restarted: a new name
    assert index.matched("a", [1, 2, 3]) == 0
    assert index.matched("b", [1, 2]) == 1
    assert index.num_keys == 1


def test_sends_count_until_their_ttl_then_the_digest_alone_speaks() -> None:
    clock = Clock()
    index = PrefixIndex(sent_ttl_s=5.0, clock=clock)
    index.update("a", digest(1))
    index.note_sent("a", [1, 2, 3])
    assert index.matched("a", [1, 2, 3, 4]) == 3
    assert index.matched("b", [1, 2, 3]) == 0
    clock.now += 4.9
    index.note_sent("a", [1, 2])  # renewed
    clock.now += 0.2
    assert index.matched("a", [1, 2, 3]) == 2  # 3's send expired, 1 and 2 renewed
    clock.now += 5.0
    index.update("a", digest(1))  # the replica's next report
    assert index.matched("a", [1, 2, 3]) == 1  # the digest's
    assert index.num_keys == 1


def test_memory_is_bounded() -> None:
    index = PrefixIndex(max_sent=100, max_digest_keys=10, clock=Clock())
    for start in range(0, 1000, 50):
        index.note_sent("a", list(range(start, start + 50)))
    assert index.num_keys == 100
    assert index.matched("a", list(range(950, 1000))) == 50  # the newest kept
    index.update("b", digest(*range(1000)))
    assert index.num_keys == 100 + 10


def test_the_longest_prefix_over_the_pool() -> None:
    index = PrefixIndex(clock=Clock())
    assert index.longest([1, 2, 3]) == 0
    index.update("a", digest(1))
    index.note_sent("b", [1, 2])
    assert index.longest([1, 2, 3]) == 2
    index.retain(["a"])
    assert index.longest([1, 2, 3]) == 1


def test_one_index_per_pool_in_a_process() -> None:
    indexes = PerPool(PrefixIndex)
    assert indexes.get("decode") is None
    assert indexes.pool("decode") is indexes.pool("decode") is indexes.get("decode")
    assert indexes.pool("prefill") is not indexes.pool("decode")
