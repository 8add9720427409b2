"""What this process's replica routers saw: where each prefill call went, and each pool's
replicas with their latest routing stats.

The replica router (`app/serve/replica_router.py`) runs inside the process that holds the
`DeploymentHandle`, on Serve's router thread. When it routes a call whose first argument
has a `request_id` (a `PrefillRequest`), it records here which replica took it, so that the
decode replica can charge a failed or timed-out attempt to the right replica (its circuit
breaker, and the retry's exclusion) even when that replica never answers. A call that was
never routed (no replica accepted it before the timeout) has no entry.

The same routers publish every pool's replicas and their routing stats as Serve pushes them
(`PoolView`): the decode replica learns which replicas a pool has (a retry with every replica
excluded goes local at once), and the ingress predicts TTFT from the prefill pools' queued
tokens and rates without calling any pool.

Process-global by necessity (Serve builds the routers, not us); bounded and thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

MAX_ENTRIES = 10_000  # far above the calls in flight in one decode replica


def figure(stats: Mapping[str, Any], name: str) -> float:
    """A replica's reported figure `name` from its routing stats; 0 when missing or null
    (a replica that has not measured it yet, or an older one that does not report it)."""
    return float(stats.get(name) or 0)


class PlacementLog:
    """request id -> replica name, the most recent `MAX_ENTRIES` calls."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, str] = OrderedDict()

    def record(self, request_id: str, replica: str) -> None:
        """Router thread: the call `request_id` was accepted by `replica`."""
        with self._lock:
            self._entries[request_id] = replica
            self._entries.move_to_end(request_id)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def pop(self, request_id: str) -> str | None:
        """Caller: where `request_id` went (None: never routed), forgetting it."""
        with self._lock:
            return self._entries.pop(request_id, None)


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A pool's replicas as its router last saw them."""

    replicas: Mapping[str, Mapping[str, Any]]  # replica name -> routing stats
    updated_at: float  # monotonic


class PoolView:
    """deployment (pool) name -> its latest `PoolSnapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, PoolSnapshot] = {}

    def update(self, pool: str, replicas: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        """Router thread: `pool` now has these (name, routing stats) replicas."""
        snapshot = PoolSnapshot(
            MappingProxyType({name: dict(stats) for name, stats in replicas}), time.monotonic()
        )
        with self._lock:
            self._pools[pool] = snapshot

    def get(self, pool: str) -> PoolSnapshot | None:
        """The pool's latest snapshot; None until its router has seen it."""
        with self._lock:
            return self._pools.get(pool)


placements = PlacementLog()
pool_view = PoolView()
