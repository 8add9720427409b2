"""Every Prometheus metric pdserve exports, and how to record one (Ray's metrics API).

Metrics go through `ray.util.metrics`, so each node's Ray metrics endpoint exports them
(`ray.init(_metrics_export_port=...)`, or `ray start --metrics-export-port`). Ray puts its
namespace in front of every application metric and `_total` after a counter's name: the
metric defined here as `pdserve_prompt_tokens` is scraped as `ray_pdserve_prompt_tokens_total`
(`MetricSpec.series` lists the names Prometheus stores). Outside a Ray worker, recording is a
no-op, so code that records can run in plain unit tests.

Labels are bounded: pools, replicas, tenants, SLO classes, statuses, reasons, backends, never
request ids. Two families:

- request metrics, recorded by the ingress (`app/observability/request_metrics.py`), labelled
  `tenant`, `class`, `prefill_pool` ("local" when the decode replica prefilled) and
  `decode_pool`;
- replica metrics, recorded inside each pool replica (`app/observability/replica_metrics.py`),
  labelled `pool` and `replica`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

NAMESPACE = "ray"  # what Ray puts in front of application metric names

# Seconds. TTFT and end-to-end latency span milliseconds (a cached short prompt) to minutes.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# Seconds per token: ITL and TPOT.
TOKEN_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

REQUEST_LABELS = ("tenant", "class", "prefill_pool", "decode_pool")
REPLICA_LABELS = ("pool", "replica")
DEFAULT_CLASS = "default"  # the `class` label of a request without an SLO class


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: its name as defined (before Ray's namespace), kind, labels and buckets."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    description: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def exported_name(self) -> str:
        """The metric family's name in Prometheus (counters end in `_total`)."""
        base = f"{NAMESPACE}_{self.name}"
        return f"{base}_total" if self.kind == "counter" else base

    @property
    def series(self) -> tuple[str, ...]:
        """Every series name Prometheus stores for this metric."""
        base = self.exported_name
        if self.kind == "histogram":
            return (f"{base}_bucket", f"{base}_count", f"{base}_sum")
        return (base,)


def _request(
    name: str,
    kind: Literal["counter", "histogram"],
    description: str,
    extra: tuple[str, ...] = (),
    buckets: tuple[float, ...] = (),
) -> MetricSpec:
    return MetricSpec(name, kind, description, REQUEST_LABELS + extra, buckets)


def _replica(
    name: str,
    kind: Literal["counter", "gauge", "histogram"],
    description: str,
    extra: tuple[str, ...] = (),
    buckets: tuple[float, ...] = (),
) -> MetricSpec:
    return MetricSpec(name, kind, description, REPLICA_LABELS + extra, buckets)


METRICS: tuple[MetricSpec, ...] = (
    # ---- requests, as the ingress sees them -------------------------------------------
    _request("pdserve_ttft_seconds", "histogram",
             "Time to first token: from admission (after auth, validation and tokenizing) "
             "to the first generated token of any choice.", buckets=LATENCY_BUCKETS_S),
    _request("pdserve_itl_seconds", "histogram",
             "Inter-token latency: time between a choice's streamed deltas, per token.",
             buckets=TOKEN_BUCKETS_S),
    _request("pdserve_tpot_seconds", "histogram",
             "Time per output token of a finished choice after its first "
             "((last token - first token) / (tokens - 1)).", buckets=TOKEN_BUCKETS_S),
    _request("pdserve_e2e_latency_seconds", "histogram",
             "End-to-end latency of a successful request, admission to last token.",
             buckets=LATENCY_BUCKETS_S),
    _request("pdserve_prompt_tokens", "counter",
             "Prompt tokens of requests that ran (usage.prompt_tokens)."),
    _request("pdserve_generated_tokens", "counter",
             "Generated tokens of all choices (usage.completion_tokens)."),
    _request("pdserve_requests", "counter",
             "Routed requests by outcome: the HTTP status (200, 429, 500, 503; 499 when the "
             "client went away).", extra=("status",)),
    _request("pdserve_good_requests", "counter",
             "Successful requests that met their class's TTFT and TPOT targets (goodput)."),
    _request("pdserve_shed_requests", "counter",
             "Requests refused for load or quota (429/503) or past their deadline while "
             "waiting for admission (504), by reason.",
             extra=("reason", "status")),
    # ---- replicas ------------------------------------------------------------------
    _replica("pdserve_kv_blocks_used", "gauge", "KV cache blocks in use."),
    _replica("pdserve_kv_blocks_free", "gauge", "KV cache blocks free."),
    _replica("pdserve_kv_blocks_kept", "gauge",
             "KV cache blocks the requests holding blocks are still expected to add, kept "
             "free for their output (may exceed the free blocks); a request waits while it "
             "would take them (engine/growth.py)."),
    _replica("pdserve_requests_waiting", "gauge",
             "Requests queued in the engine (waiting for compute or for their KV)."),
    _replica("pdserve_requests_running", "gauge", "Requests in the engine's running batch."),
    _replica("pdserve_prefix_cache_hit_rate", "gauge",
             "Fraction of prompt tokens served from the prefix cache since the replica "
             "started (prefill pools)."),
    _replica("pdserve_replica_cost_per_hour", "gauge",
             "What the replica costs, in dollars per hour (observability.cost)."),
    _replica("pdserve_queue_seconds", "histogram",
             "Prefill pool: from the prefill call (handshake included) to the engine's first "
             "step on the prompt.",
             buckets=LATENCY_BUCKETS_S),
    _replica("pdserve_prefill_seconds", "histogram",
             "Prefill pool: from the engine's first step on the prompt to its KV transfer "
             "being done (compute, overlapped with the layer-by-layer transfer).",
             buckets=LATENCY_BUCKETS_S),
    _replica("pdserve_retries", "counter",
             "Decode pool: remote prefills retried with a fresh reservation and ticket."),
    _replica("pdserve_fallbacks", "counter",
             "Decode pool: requests prefilled locally although routed to a prefill pool, by "
             "reason (no_kv_room, breaker_open, prefill_backpressure, kv_open_failed, "
             "prefill_failed).",
             extra=("reason",)),
    _replica("pdserve_preemptions", "counter", "Requests preempted (recompute) by the engine."),
    _replica("pdserve_kv_transfer_failures", "counter",
             "Decode pool: remote prefill attempts whose KV transfer did not complete, by the "
             "transfer's terminal state (failed, aborted, expired, done: landed but the call "
             "failed).", extra=("state",)),
    _replica("pdserve_kv_transfer_bytes", "counter",
             "Prefill pool: KV bytes sent in completed transfers, by backend.",
             extra=("backend",)),
    _replica("pdserve_kv_transfer_seconds", "counter",
             "Prefill pool: seconds completed transfers ran on after their prompt was computed "
             "(the part of layer-by-layer streaming not hidden behind compute), by backend.",
             extra=("backend",)),
)  # fmt: skip

BY_NAME: Mapping[str, MetricSpec] = {spec.name: spec for spec in METRICS}


def exported_series() -> frozenset[str]:
    """Every series name pdserve's metrics put into Prometheus."""
    return frozenset(name for spec in METRICS for name in spec.series)


_instruments: dict[str, Any] = {}
_instruments_lock = threading.Lock()


def _instrument(name: str) -> Any:
    """The process's Ray metric object for `name`, created on first use."""
    instrument = _instruments.get(name)
    if instrument is not None:
        return instrument
    from ray.util import metrics  # imported here: modules that only read METRICS need no Ray

    spec = BY_NAME[name]
    with _instruments_lock:
        instrument = _instruments.get(name)
        if instrument is None:
            if spec.kind == "counter":
                instrument = metrics.Counter(spec.name, spec.description, spec.labels)
            elif spec.kind == "gauge":
                instrument = metrics.Gauge(spec.name, spec.description, spec.labels)
            else:
                instrument = metrics.Histogram(
                    spec.name, spec.description, list(spec.buckets), spec.labels
                )
            _instruments[name] = instrument
    return instrument


def inc(name: str, value: float, labels: Mapping[str, str]) -> None:
    """Add `value` to counter `name` (ignored unless positive: counters only go up)."""
    if value > 0:
        _instrument(name).inc(value, tags=dict(labels))


def observe(name: str, value: float, labels: Mapping[str, str]) -> None:
    """Record one sample of histogram `name`."""
    _instrument(name).observe(max(value, 0.0), tags=dict(labels))


def set_gauge(name: str, value: float, labels: Mapping[str, str]) -> None:
    """Set gauge `name` for these labels."""
    _instrument(name).set(value, tags=dict(labels))
