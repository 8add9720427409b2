"""Prefix-aware replica choice (`app/routing/prefix_choice.py`): the replica caching the
longest prefix wins while its load is near the least loaded replica's; without cached
prefixes the order is the load order; the choices are counted per pool."""

from __future__ import annotations

import pytest

from app.routing.prefix_choice import (
    Candidate,
    PrefixRoutingRegistry,
    PrefixRoutingStats,
    prefix_order,
    within_margin,
)


def cand(tokens: float = 0, sequences: float = 0, free: float = 0, matched: int = 0) -> Candidate:
    return Candidate((tokens, sequences, -free), matched)


def test_without_cached_prefixes_the_order_is_the_load_order() -> None:
    candidates = [cand(100, 1), cand(0, 3), cand(0, 1, free=5), cand(0, 1, free=9)]
    assert prefix_order(candidates) == [3, 2, 1, 0]
    assert prefix_order([]) == []


def test_the_longest_cached_prefix_wins_over_a_slightly_less_loaded_replica() -> None:
    candidates = [cand(0, 2), cand(0, 3, matched=1024), cand(0, 2, matched=512)]
    assert prefix_order(candidates) == [1, 2, 0]


def test_a_cached_prefix_does_not_beat_a_longer_queue() -> None:
    # 1,500 tokens cached, 2,000 queued in front: the idle replica computes sooner.
    assert prefix_order([cand(2000, 1, matched=1500), cand(0, 1)]) == [1, 0]
    assert prefix_order([cand(1000, 1, matched=1500), cand(0, 1)]) == [0, 1]


def test_past_the_load_margin_the_prefix_counts_for_nothing() -> None:
    assert within_margin(4, 0) and not within_margin(5, 0)
    assert within_margin(15, 10) and not within_margin(16, 10)  # half the least, above 4
    hot = cand(0, 5, matched=4096)
    assert prefix_order([hot, cand(0, 0)]) == [1, 0]
    assert prefix_order([cand(0, 4, matched=4096), cand(0, 0)]) == [0, 1]


def test_one_hot_prefix_cannot_draw_every_request_onto_one_replica() -> None:
    # Every request shares a prefix only replica 0 caches; it keeps winning until it holds
    # SEQUENCE_MARGIN more sequences than replica 1, then the load decides.
    sequences = [0, 0]
    for _ in range(40):
        matched = [4096, 0]
        choice = prefix_order([cand(0, sequences[i], matched=matched[i]) for i in range(2)])[0]
        sequences[choice] += 1
    assert sequences[1] >= 12
    assert max(sequences) <= 2 * min(sequences) + 4


def test_stats_count_hits_and_conversations_per_replica() -> None:
    stats = PrefixRoutingStats(max_conversations=3)
    stats.record("a", matched=0, best=0, first_key=1)  # a first turn: nothing cached
    stats.record("a", matched=5, best=5, first_key=1)  # its second turn, where it was
    stats.record("b", matched=2, best=4, first_key=2)  # moved for load
    stats.record("b", matched=0, best=0, first_key=3)
    report = stats.report()
    assert {k: report[k] for k in ("routed", "prefix_cached", "hit", "moved_for_load")} == {
        "routed": 4,
        "prefix_cached": 2,
        "hit": 1,
        "moved_for_load": 1,
    }
    assert report["hit_rate"] == pytest.approx(0.5)
    assert report["replicas"] == {
        "a": {"routed": 2, "conversations": 1},
        "b": {"routed": 2, "conversations": 2},
    }
    stats.record("a", matched=0, best=0, first_key=4)  # bounded: the oldest (1) forgotten
    assert stats.report()["replicas"]["a"]["conversations"] == 1
    assert (stats.held("a"), stats.held("b"), stats.held("c")) == (1, 2, 0)
    stats.record("a", matched=0, best=2, first_key=2)  # conversation 2 moved from b to a
    assert (stats.held("a"), stats.held("b")) == (2, 1)
    assert PrefixRoutingStats().report()["hit_rate"] is None


def test_equally_loaded_replicas_take_new_conversations_in_turn() -> None:
    """A first turn (no prefix anywhere) between replicas equally loaded goes to the one
    holding fewer conversations, before free KV blocks; the load still comes first."""
    busy_but_empty = Candidate((0, 1, -10), 0, conversations=0)
    assert prefix_order([Candidate((0, 0, -5), 0, conversations=9), busy_but_empty]) == [0, 1]
    fewer = Candidate((0, 0, -5), 0, conversations=2)
    more = Candidate((0, 0, -50), 0, conversations=3)
    assert prefix_order([more, fewer]) == [1, 0]
    stats = PrefixRoutingStats()
    for conversation in range(17):  # first turns arriving while both replicas idle
        candidates = [Candidate((0, 0, 0), 0, 0.5, stats.held(name)) for name in "ab"]
        stats.record("ab"[prefix_order(candidates)[0]], 0, 0, first_key=conversation)
    assert sorted((stats.held("a"), stats.held("b"))) == [8, 9]


def test_the_registry_reports_each_pool() -> None:
    registry = PrefixRoutingRegistry()
    registry.pool("decode").record("a", 1, 1, 7)
    assert registry.pool("decode") is registry.pool("decode")
    assert list(registry.report()) == ["decode"]
