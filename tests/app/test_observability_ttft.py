"""The stats' TTFT breakdown: percentiles by phase over the requests of a window."""

from __future__ import annotations

import pytest

from app.observability.ttft import TTFTStats, percentile, summarize
from engine.outputs import TTFTBreakdown


def test_percentile_interpolates() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 90) == 7.0


def test_summary_by_phase() -> None:
    items = [TTFTBreakdown(q, 10.0 * q, remote=q > 2) for q in (1.0, 2.0, 3.0, 4.0)]
    report = summarize(items)
    assert report["num_requests"] == 4 and report["num_remote_prefill"] == 2
    assert report["queue_ms"]["p50"] == pytest.approx(2.5)
    assert report["prefill_ms"]["mean"] == pytest.approx(25.0)
    assert report["total_ms"]["p50"] == pytest.approx(27.5)
    assert report["transfer_ms"]["p90"] == 0.0
    assert summarize([])["queue_ms"] == {"p50": None, "p90": None, "mean": None}


def test_since_keeps_only_later_requests() -> None:
    now = [1000.0]
    stats = TTFTStats(clock=lambda: now[0])
    stats.add(TTFTBreakdown(1.0, 1.0))
    now[0] = 2000.0
    stats.add(TTFTBreakdown(5.0, 5.0))
    assert stats.report()["num_requests"] == 2
    since = stats.report(since=1500.0)
    assert since["num_requests"] == 1 and since["queue_ms"]["p50"] == 5.0
