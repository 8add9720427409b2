"""What the ingress and the replicas record, metric by metric (without Ray).

Recording goes through `app/observability/metrics.py`'s `inc`/`observe`/`set_gauge`; these
tests capture those calls to check which samples each situation produces and with which
labels. `test_serve_prometheus.py` checks the same numbers end to end through Prometheus.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import pytest

from app.observability import metrics
from app.observability.replica_metrics import ReplicaMetrics, ReplicaMetricsFactory
from app.observability.request_metrics import RequestMetrics, SLOTargets
from engine.outputs import RequestOutput


class Captured:
    """Every recorded sample, by metric name: (value, labels)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[float, dict[str, str]]]] = defaultdict(list)

    def record(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        assert name in metrics.BY_NAME, f"{name} is not in the registry"
        assert set(labels) == set(metrics.BY_NAME[name].labels), (name, labels)
        self.samples[name].append((value, dict(labels)))

    def total(self, name: str, **match: str) -> float:
        return sum(
            value
            for value, labels in self.samples[name]
            if all(labels.get(k) == v for k, v in match.items())
        )

    def count(self, name: str) -> int:
        return len(self.samples[name])

    def last(self, name: str) -> float:
        return self.samples[name][-1][0]


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Captured:
    captured = Captured()

    def inc(name: str, value: float, labels: Mapping[str, str]) -> None:
        if value > 0:  # like the real one: counters only go up
            captured.record(name, value, labels)

    monkeypatch.setattr(metrics, "inc", inc)
    monkeypatch.setattr(metrics, "observe", captured.record)
    monkeypatch.setattr(metrics, "set_gauge", captured.record)
    return captured


def delta(tokens: list[int], num_output: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        new_token_ids=tokens,
        new_text="x" * len(tokens),
        new_logprobs=[],
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=7,
        num_output_tokens=num_output,
    )


LABELS = RequestMetrics.labels("acme", None, "short", "decode")
LAX = SLOTargets(ttft_s=60.0, tpot_s=60.0)


def test_a_request_records_ttft_once_and_the_usage_token_counts(captured: Captured) -> None:
    recorder = RequestMetrics(LAX).start(LABELS, num_prompt_tokens=7)
    for index in (0, 1):  # n=2: each choice streams 1 + 1 + 2 tokens (the last merged)
        recorder.on_delta(index, delta([5], 1))
        recorder.on_delta(index, delta([6], 2))
        recorder.on_delta(index, delta([7, 8], 4, finished=True))
    recorder.finish(200)
    recorder.finish(200)  # idempotent

    assert LABELS == {"tenant": "acme", "class": "default", "prefill_pool": "short",
                      "decode_pool": "decode"}  # fmt: skip
    assert captured.count("pdserve_ttft_seconds") == 1
    # One per choice's second delta: a merged one says nothing of single gaps.
    assert captured.count("pdserve_itl_seconds") == 2
    assert captured.count("pdserve_tpot_seconds") == 2
    assert captured.count("pdserve_e2e_latency_seconds") == 1
    assert captured.total("pdserve_prompt_tokens") == 7  # once, like usage.prompt_tokens
    assert captured.total("pdserve_generated_tokens") == 8
    assert captured.total("pdserve_requests", status="200") == 1
    assert captured.total("pdserve_good_requests") == 1


def test_a_slow_request_is_not_goodput(captured: Captured) -> None:
    recorder = RequestMetrics(LAX).start(LABELS, 7, SLOTargets(ttft_s=1e-9, tpot_s=60.0))
    recorder.on_delta(0, delta([5], 1, finished=True))
    recorder.finish(200)
    assert captured.total("pdserve_requests", status="200") == 1
    assert captured.count("pdserve_good_requests") == 0


def test_refused_and_failed_requests(captured: Captured) -> None:
    request_metrics = RequestMetrics(LAX)
    refused = request_metrics.start(LABELS, 7)
    request_metrics.shed(refused.labels, "requests_per_second", 429)
    refused.finish(429)
    failed = request_metrics.start(LABELS, 7)
    failed.on_delta(0, delta([5], 1))
    failed.finish(503)

    assert captured.total("pdserve_shed_requests", reason="requests_per_second") == 1
    assert captured.total("pdserve_requests", status="429") == 1
    assert captured.total("pdserve_requests", status="503") == 1
    # The refused prompt reached no engine; the failed one did and produced one token.
    assert captured.total("pdserve_prompt_tokens") == 7
    assert captured.total("pdserve_generated_tokens") == 1
    assert captured.count("pdserve_e2e_latency_seconds") == 0  # only successes


def test_replica_metrics_export_gauges_and_counter_increments(captured: Captured) -> None:
    stats: dict[str, Any] = {
        "replica": "decode:decode@host:1",
        "num_blocks": 100,
        "num_free_blocks": 60,
        "num_waiting": 2,
        "num_waiting_for_kv": 1,
        "num_running": 4,
        "num_preemptions": 3,
        "num_kept_blocks": 12,
        "counters": {
            "prefill_retries": 2,
            "local_prefill_fallback": 5,
            "no_kv_room": 1,
            "breaker_local_prefill": 1,
            "kv_transfer_failures:expired": 2,
            "kv_transfer_bytes": 4096,
            "kv_transfer_us": 1500,
            "prompt_tokens": 200,
            "cached_tokens": 50,
        },
    }
    factory = ReplicaMetricsFactory("decode", "shm", usd_per_hour=4.0, interval_s=60.0)
    exporter = ReplicaMetrics(factory, lambda: stats)
    exporter.close()  # the thread's own publishes race with ours; totals do not depend on it
    exporter.publish()
    exporter.publish()  # nothing new: no increments
    stats["counters"] = {**stats["counters"], "prefill_retries": 3, "kv_transfer_bytes": 5000}
    stats["num_free_blocks"] = 90
    exporter.publish()
    exporter.observe("queue_seconds", 0.25)

    assert captured.last("pdserve_kv_blocks_used") == 10
    assert captured.last("pdserve_kv_blocks_free") == 90
    assert captured.last("pdserve_kv_blocks_kept") == 12
    assert captured.last("pdserve_requests_waiting") == 3
    assert captured.last("pdserve_requests_running") == 4
    assert captured.last("pdserve_replica_cost_per_hour") == 4.0
    assert captured.last("pdserve_prefix_cache_hit_rate") == 0.25
    assert captured.total("pdserve_preemptions") == 3
    assert captured.total("pdserve_retries") == 3
    assert captured.total("pdserve_fallbacks", reason="no_kv_room") == 1
    assert captured.total("pdserve_fallbacks", reason="breaker_open") == 1
    assert captured.total("pdserve_fallbacks", reason="prefill_failed") == 3
    assert captured.total("pdserve_kv_transfer_failures", state="expired") == 2
    assert captured.total("pdserve_kv_transfer_bytes", backend="shm") == 5000
    assert captured.total("pdserve_kv_transfer_seconds", backend="shm") == pytest.approx(0.0015)
    assert captured.samples["pdserve_queue_seconds"] == [
        (0.25, {"pool": "decode", "replica": "decode:decode@host:1"})
    ]
