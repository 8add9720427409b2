"""Replica metrics: a pool replica's gauges, counters and latency samples, exported via Ray.

`ReplicaMetricsFactory` is bound into each pool deployment by `build_app` (it pickles by
value: a frozen dataclass). The server calls it with its `stats` once built; the resulting
`ReplicaMetrics` (an `replica.engine_replica.ReplicaObserver`) then

- every `interval_s`, on its own thread, reads the replica's stats snapshot (which never
  waits on the engine) and sets the gauges (KV blocks, queues, prefix-cache hit rate, cost)
  and adds what the replica's cumulative counters gained since the last read;
- records the latency samples the server hands it (`observe("queue_seconds", s)`).

Counters the servers keep in `EngineReplica.counters` and what they become here:
`prefill_retries` → `pdserve_retries`; `local_prefill_fallback` → `pdserve_fallbacks{reason}`
(`FALLBACK_REASONS`); `kv_transfer_failures:<state>` → `pdserve_kv_transfer_failures`;
`kv_transfer_bytes` / `kv_transfer_us` (microseconds) → the transfer counters of the pool's
backend; `cached_tokens` / `prompt_tokens` → the prefix-cache hit rate; the engine's
`num_preemptions` → `pdserve_preemptions`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.observability import metrics
from app.observability.cost import pool_rates

if TYPE_CHECKING:
    from app.config import PDServeConfig, PoolConfig

logger = logging.getLogger(__name__)

FAILURE_PREFIX = "kv_transfer_failures:"
# Why a decode replica prefilled locally a request routed to a prefill pool: reason label ->
# the counter that counts it; the rest of `local_prefill_fallback` is "prefill_failed"
# (attempts failed or never routed).
FALLBACK_REASONS = {
    "no_kv_room": "no_kv_room",
    "breaker_open": "breaker_local_prefill",
    "prefill_backpressure": "prefill_backpressure",
    "kv_open_failed": "kv_open_failed",  # a rank of a TP replica could not open the ticket
}
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ReplicaMetricsFactory:
    """What a pool's replicas need to export their metrics; call it with the server's
    `stats` to start exporting."""

    pool: str
    backend: str  # the KV transfer backend (a label of the transfer counters)
    usd_per_hour: float = 0.0  # per replica
    interval_s: float = 1.0

    def __call__(self, stats: Callable[[], dict[str, Any]]) -> ReplicaMetrics:
        return ReplicaMetrics(self, stats)


def replica_metrics_factory(config: PDServeConfig, pool: PoolConfig) -> ReplicaMetricsFactory:
    """What `pool`'s replicas export, from the config (price per replica from `cost`)."""
    observability = config.observability
    rate = pool_rates(observability.cost, [pool])[pool.name]
    return ReplicaMetricsFactory(
        pool=pool.name,
        backend=config.transfer.backend,
        usd_per_hour=rate.usd_per_replica_hour,
        interval_s=observability.metrics.publish_interval_s,
    )


class ReplicaMetrics:
    """Exports one replica's metrics until `close`."""

    def __init__(self, factory: ReplicaMetricsFactory, stats: Callable[[], dict[str, Any]]):
        self.factory = factory
        self._stats = stats
        self._seen: dict[str, float] = {}  # cumulative values already exported
        self._labels = {"pool": factory.pool, "replica": str(stats().get("replica", ""))}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"pdserve-metrics-{factory.pool}", daemon=True
        )
        self._thread.start()

    def observe(self, name: str, value: float) -> None:
        """A latency sample of `pdserve_<name>` (a replica histogram), in seconds."""
        try:
            metrics.observe(f"pdserve_{name}", value, self._labels)
        except Exception:  # a metric must never fail the request that measured it
            logger.exception("recording %s failed", name)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
            except Exception:  # keep exporting: the next snapshot may be fine
                logger.exception("publishing replica metrics failed")
            self._stop.wait(self.factory.interval_s)

    def publish(self) -> None:
        """Export the current stats snapshot (the thread calls this every interval)."""
        stats = self._stats()
        labels = self._labels
        counters: Mapping[str, float] = stats.get("counters", {})
        num_blocks = int(stats.get("num_blocks", 0))
        num_free = int(stats.get("num_free_blocks", 0))
        metrics.set_gauge("pdserve_kv_blocks_used", num_blocks - num_free, labels)
        metrics.set_gauge("pdserve_kv_blocks_free", num_free, labels)
        metrics.set_gauge("pdserve_kv_blocks_kept", int(stats.get("num_kept_blocks", 0)), labels)
        waiting = int(stats.get("num_waiting", 0)) + int(stats.get("num_waiting_for_kv", 0))
        metrics.set_gauge("pdserve_requests_waiting", waiting, labels)
        metrics.set_gauge("pdserve_requests_running", int(stats.get("num_running", 0)), labels)
        metrics.set_gauge("pdserve_replica_cost_per_hour", self.factory.usd_per_hour, labels)
        prompt_tokens = counters.get("prompt_tokens", 0)
        if prompt_tokens:
            hit_rate = counters.get("cached_tokens", 0) / prompt_tokens
            metrics.set_gauge("pdserve_prefix_cache_hit_rate", hit_rate, labels)

        metrics.inc("pdserve_preemptions", self._gained("num_preemptions", stats), labels)
        metrics.inc("pdserve_retries", self._gained("prefill_retries", counters), labels)
        remainder = self._gained("local_prefill_fallback", counters)
        for reason, key in FALLBACK_REASONS.items():
            gained = self._gained(key, counters)
            metrics.inc("pdserve_fallbacks", gained, {**labels, "reason": reason})
            remainder -= gained
        metrics.inc("pdserve_fallbacks", remainder, {**labels, "reason": "prefill_failed"})
        for key in list(counters):
            if key.startswith(FAILURE_PREFIX):
                state = {**labels, "state": key.removeprefix(FAILURE_PREFIX)}
                metrics.inc("pdserve_kv_transfer_failures", self._gained(key, counters), state)
        backend = {**labels, "backend": self.factory.backend}
        sent = self._gained("kv_transfer_bytes", counters)
        metrics.inc("pdserve_kv_transfer_bytes", sent, backend)
        seconds = self._gained("kv_transfer_us", counters) / 1e6
        metrics.inc("pdserve_kv_transfer_seconds", seconds, backend)

    def _gained(self, key: str, values: Mapping[str, Any]) -> float:
        """How much cumulative `values[key]` grew since the last call."""
        value = float(values.get(key, 0))
        gained = value - self._seen.get(key, 0.0)
        self._seen[key] = value
        return max(gained, 0.0)
