"""Prefix-aware replica choice: prefer the replica that caches the longest prefix of the
prompt, while its load stays near the least loaded replica's; and what those choices were.

The replica router ranks a pool's replicas by load: prompt tokens queued (each figure at
least what the router itself has in flight there), then sequences, then most free KV blocks
(`app/serve/replica_router.py:replica_load`). A cached prefix is prompt work the replica
need not do (or KV it need not receive), so `prefix_order` credits it against the queued
tokens: a replica that caches 1,500 tokens of a 1,600-token prompt ranks ahead of an idle
one, but not ahead of an idle one when 2,000 tokens are queued in front of it.

The credit applies only while the replica's sequences are within a margin of the least
loaded replica's (`SEQUENCE_MARGIN`, or `SEQUENCE_MARGIN_FRACTION` of the least, whichever
is more): a prefix every request shares (a system prompt, a hot document) would otherwise
draw the whole pool's traffic onto the first replica that cached it. Past the margin the
request goes where the load says, which caches the prefix there too. With no prefix cached
anywhere the order is the load order; between replicas equally loaded (queued tokens and
sequences) the one holding fewer conversations (distinct first blocks this process last sent
there) comes first, then the one with more free KV blocks. A new conversation's first turn
has no prefix anywhere, and later turns follow it, so where first turns land decides the
split; by load alone, at a moment when both replicas were idle between turns, 13 of 17
conversations of a `bench multiturn` run landed on one of two replicas.

`PrefixRoutingStats` counts the choices per pool, in this process, for the ingress's stats
report (`GET /v1/pdserve/stats`, `routing.prefix`): requests routed, those with a prefix
cached somewhere, those sent to the replica caching the longest one (hits), and, per
replica, the conversations (distinct first blocks) last sent there.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.routing.prefix_index import PerPool

SEQUENCE_MARGIN = 4
SEQUENCE_MARGIN_FRACTION = 0.5
MAX_CONVERSATIONS = 10_000  # per pool: first blocks remembered, oldest forgotten first


@dataclass(frozen=True, slots=True)
class Candidate:
    """One replica as the policy sees it."""

    load: tuple[float, float, float]  # queued prompt tokens, sequences, -free KV blocks
    matched_tokens: int  # tokens of the prompt's longest prefix cached there
    tiebreak: float = 0.0  # random: equal replicas share the load
    conversations: int = 0  # conversations last sent there (`PrefixRoutingStats.held`)


def within_margin(sequences: float, least: float) -> bool:
    """Whether a replica with `sequences` may still be preferred for its cached prefix over
    one with `least`."""
    return sequences <= least + max(SEQUENCE_MARGIN, SEQUENCE_MARGIN_FRACTION * least)


def prefix_credit(candidate: Candidate, least_sequences: float) -> int:
    """The tokens `candidate`'s cached prefix takes off its load (0 past the margin)."""
    if candidate.matched_tokens > 0 and within_margin(candidate.load[1], least_sequences):
        return candidate.matched_tokens
    return 0


def prefix_order(candidates: Sequence[Candidate]) -> list[int]:
    """Indices of `candidates`, preferred first (module docstring)."""
    if not candidates:
        return []
    least = min(c.load[1] for c in candidates)

    def key(i: int) -> tuple[float, float, int, float, float]:
        c = candidates[i]
        tokens, sequences, free = c.load
        return tokens - prefix_credit(c, least), sequences, c.conversations, free, c.tiebreak

    return sorted(range(len(candidates)), key=key)


class PrefixRoutingStats:
    """Counts of one pool's prefix-aware choices (thread-safe: the router writes, the
    ingress reads)."""

    def __init__(self, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self._lock = threading.Lock()
        self._max_conversations = max_conversations
        self.counts: Counter[str] = Counter()
        self._routed: Counter[str] = Counter()
        self._conversations: OrderedDict[int, str] = OrderedDict()  # first block -> replica
        self._held: Counter[str] = Counter()  # replica -> conversations last sent there

    def record(self, chosen: str, matched: int, best: int, first_key: int | None) -> None:
        """A call went to `chosen`, which caches `matched` leading blocks of its prompt where
        the best replica caches `best`; `first_key`: its first block's key, if it has one."""
        with self._lock:
            self.counts["routed"] += 1
            self._routed[chosen] += 1
            if best > 0:
                self.counts["prefix_cached"] += 1
                self.counts["hit" if matched >= best else "moved_for_load"] += 1
            if first_key is not None:
                previous = self._conversations.get(first_key)
                if previous is not None:
                    self._held[previous] -= 1
                self._conversations[first_key] = chosen
                self._held[chosen] += 1
                self._conversations.move_to_end(first_key)
                while len(self._conversations) > self._max_conversations:
                    _, replica = self._conversations.popitem(last=False)
                    self._held[replica] -= 1

    def held(self, replica: str) -> int:
        """The conversations (distinct first blocks) last sent to `replica`."""
        with self._lock:
            return self._held[replica]

    def report(self) -> dict[str, Any]:
        """Counts, the hit rate over calls with a prefix cached somewhere, and per replica the
        calls routed and conversations last sent there."""
        with self._lock:
            conversations = self._held
            cached = self.counts["prefix_cached"]
            return {
                **{k: self.counts[k] for k in ("routed", "prefix_cached", "hit", "moved_for_load")},
                "hit_rate": self.counts["hit"] / cached if cached else None,
                "replicas": {
                    name: {"routed": n, "conversations": conversations.get(name, 0)}
                    for name, n in sorted(self._routed.items())
                },
            }


class PrefixRoutingRegistry(PerPool[PrefixRoutingStats]):
    """pool (deployment) name -> its `PrefixRoutingStats`, for this process."""

    def __init__(self) -> None:
        super().__init__(PrefixRoutingStats)

    def report(self) -> dict[str, Any]:
        """Each pool this process routed to, by name."""
        return {name: stats.report() for name, stats in self.items()}


# Process-global: Serve builds the routers, and the ingress's report reads what they chose.
prefix_routing = PrefixRoutingRegistry()
