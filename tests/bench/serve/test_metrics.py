"""Metric code on synthetic request records: percentiles, latencies, SLO attainment."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.serve.metrics import (
    SLO,
    RequestRecord,
    attainment,
    distribution,
    finite_or_none,
    meets_slo,
    percentile,
    prefill_interference,
    route_breakdown,
    route_kind,
    summarize,
)


def record(
    ttft: float,
    tpot: float,
    output_tokens: int = 5,
    start: float = 0.0,
    label: str = "short",
    success: bool = True,
    index: int = 0,
) -> RequestRecord:
    """A completed request sent at `start`, one chunk per token at a steady `tpot`."""
    times = [start + ttft + i * tpot for i in range(output_tokens)]
    return RequestRecord(
        index=index,
        label=label,
        input_len=10,
        max_tokens=output_tokens,
        arrival_s=start,
        start_s=start,
        first_token_s=times[0] if success else None,
        end_s=times[-1] + 0.001 if success else None,
        chunk_times_s=times if success else [],
        prompt_tokens=10,
        output_tokens=output_tokens if success else 0,
        success=success,
    )


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n: int) -> None:
    values = np.random.default_rng(n).lognormal(size=n).tolist()
    for p in [0, 1, 25, 50, 90, 99, 99.9, 100]:
        assert percentile(values, p) == pytest.approx(np.percentile(values, p), rel=1e-12)


def test_percentile_edge_cases() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_scales_to_ms() -> None:
    values = [0.1, 0.2, 0.3, 0.4]
    stats = distribution(values)
    assert stats["count"] == 4
    assert stats["mean"] == pytest.approx(250.0)
    assert stats["p50"] == pytest.approx(np.percentile(values, 50) * 1000)
    assert stats["p99"] == pytest.approx(np.percentile(values, 99) * 1000)
    assert stats["max"] == pytest.approx(400.0)
    assert distribution([])["count"] == 0


def test_record_latencies() -> None:
    r = record(ttft=0.5, tpot=0.1, output_tokens=5, start=2.0)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx(0.1)
    assert r.itls_s == pytest.approx([0.1] * 4)
    assert r.e2e_s == pytest.approx(0.5 + 0.4 + 0.001)
    assert RequestRecord.from_dict(r.to_dict()) == r


def test_tpot_counts_tokens_not_chunks() -> None:
    # 9 tokens arriving in 3 chunks: TPOT spreads the time over the 8 tokens after the first.
    r = record(ttft=0.2, tpot=0.1, output_tokens=3)
    r.output_tokens = 9
    assert r.tpot_s == pytest.approx(0.2 / 8)
    assert record(ttft=0.2, tpot=0.1, output_tokens=1).tpot_s is None


def test_attainment_needs_both_slos() -> None:
    records = [
        record(ttft=0.1, tpot=0.01),  # meets both
        record(ttft=0.5, tpot=0.01),  # TTFT miss
        record(ttft=0.1, tpot=0.05),  # TPOT miss
        record(ttft=0.1, tpot=0.01, success=False),  # failed: a miss
    ]
    slo = SLO(ttft_ms=200, tpot_ms=20)
    assert [meets_slo(r, slo) for r in records] == [True, False, False, False]
    assert attainment(records, slo) == pytest.approx(0.25)
    assert attainment(records, SLO(ttft_ms=200)) == pytest.approx(0.5)
    assert attainment(records, SLO(tpot_ms=20)) == pytest.approx(0.5)
    assert attainment(records, SLO()) == pytest.approx(0.75)
    assert math.isnan(attainment([], slo))


def test_single_token_request_judged_by_ttft() -> None:
    slo = SLO(ttft_ms=200, tpot_ms=1)
    assert meets_slo(record(ttft=0.1, tpot=0.5, output_tokens=1), slo)


def test_summarize_counts_and_throughput() -> None:
    records = [record(0.1, 0.01, output_tokens=10, index=i, start=i) for i in range(4)]
    records.append(record(0.1, 0.01, success=False, index=4))
    summary = summarize(records, duration_s=5.0, slo=SLO(ttft_ms=150, tpot_ms=20))
    assert summary["num_requests"] == 5
    assert summary["num_completed"] == 4
    assert summary["num_failed"] == 1
    assert summary["request_throughput"] == pytest.approx(4 / 5)
    assert summary["output_token_throughput"] == pytest.approx(40 / 5)
    assert summary["total_token_throughput"] == pytest.approx((40 + 40) / 5)
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(10.0)
    assert summary["itl_ms"]["count"] == 4 * 9
    assert summary["slo"]["attainment"] == pytest.approx(0.8)
    assert summary["slo"]["goodput"] == pytest.approx(4 / 5)
    assert "by_label" not in summary


def test_summarize_by_label() -> None:
    records = [record(0.1, 0.01, label="short"), record(2.0, 0.01, label="long", index=1)]
    by_label = summarize(records, 3.0, SLO(ttft_ms=500))["by_label"]
    assert by_label["short"]["attainment"] == 1.0
    assert by_label["long"]["attainment"] == 0.0
    assert by_label["long"]["ttft_ms"]["mean"] == pytest.approx(2000.0)


def test_prefill_interference_splits_overlapping_decodes() -> None:
    long = record(ttft=3.0, tpot=0.01, start=10.0, label="long")  # prefill window 10..13
    hit = record(ttft=0.1, tpot=0.5, output_tokens=8, start=9.0, index=1)  # decodes 9.1..12.6
    clear = record(ttft=0.1, tpot=0.05, output_tokens=8, start=0.0, index=2)  # 0.1..0.45
    out = prefill_interference([long, hit, clear])
    assert out["overlapped"]["num_requests"] == 1
    assert out["clear"]["num_requests"] == 1
    assert out["overlapped"]["tpot_ms"]["mean"] == pytest.approx(500.0)
    assert out["clear"]["tpot_ms"]["mean"] == pytest.approx(50.0)
    assert out["alone"]["num_requests"] == 1  # `clear`: no other request in 0..0.45
    assert out["alone"]["tpot_ms"]["mean"] == pytest.approx(50.0)


def test_route_kinds_from_the_route_header() -> None:
    static_local = "len 40 < local_prefill_threshold 64 -> local prefill on decode pool decode"
    remote = "len 900 in [64, inf] -> pool prefill, decode pool decode"
    adaptive = f"{remote}; adaptive (prefill vs decode): predicted wait 3.1 s remote, "
    overflow = "; decode overflow: decode load 3.0 on decode vs 1.0 on prefill -> served whole"
    assert route_kind(None) == "unknown"
    assert route_kind(static_local) == "local"
    assert route_kind(remote) == "remote"
    assert route_kind(adaptive + "local cost 0.2 s -> local prefill") == "local"
    assert route_kind(adaptive + "local cost 4.0 s -> remote prefill") == "remote"
    assert route_kind(static_local + overflow + " on prefill") == "whole"
    assert (
        route_kind(remote + "; 1.0 on decode vs 1.0 on prefill: decode not above by 1") == "remote"
    )


def test_route_breakdown_says_where_the_misses_came_from() -> None:
    fast, slow = record(0.1, 0.01), record(0.1, 0.2, index=1)
    fast.route = "len 40 < local_prefill_threshold 64 -> local prefill on decode pool decode"
    slow.route = "len 900 in [64, inf] -> pool prefill, decode pool decode"
    out = route_breakdown([fast, slow, record(0.1, 0.01, index=2)], SLO(tpot_ms=100))
    assert list(out) == ["local", "remote", "unknown"]
    assert [out[k]["num_missed"] for k in out] == [0, 1, 0]
    assert out["remote"]["tpot_ms"]["mean"] == pytest.approx(200.0)


def test_finite_or_none() -> None:
    data = {"a": math.nan, "b": [1.0, math.inf, {"c": 2}], "d": "x"}
    assert finite_or_none(data) == {"a": None, "b": [1.0, None, {"c": 2}], "d": "x"}
