"""Goodput interpolation, the rate sweep, and the comparison's pure helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.compare import common_rate, derive_slo, plot
from bench.goodput import goodput_report, interpolate_goodput, next_rate, parse_rates, sweep
from bench.loadgen import normalize_base_url


def test_interpolates_between_bracketing_rates() -> None:
    est = interpolate_goodput([(1.0, 1.0), (2.0, 0.95), (3.0, 0.75), (4.0, 0.2)], target=0.9)
    # 2 + (0.95 - 0.9) / (0.95 - 0.75) * (3 - 2) = 2.25
    assert est.goodput == pytest.approx(2.25)
    assert (est.low_rate, est.high_rate, est.bracketed) == (2.0, 3.0, True)


def test_order_does_not_matter_and_first_crossing_wins() -> None:
    points = [(4.0, 0.95), (1.0, 0.92), (2.0, 0.5)]  # noisy: 4.0 passes again
    est = interpolate_goodput(points, 0.9)
    assert est.high_rate == 2.0
    assert est.goodput == pytest.approx(1.0 + (0.02 / 0.42))


def test_lowest_point_failing_interpolates_from_idle() -> None:
    est = interpolate_goodput([(2.0, 0.5)], 0.9)
    assert est.goodput == pytest.approx(2.0 * 0.1 / 0.5)
    assert est.low_rate == 0.0 and est.bracketed


def test_no_failing_point_is_a_lower_bound() -> None:
    est = interpolate_goodput([(1.0, 1.0), (2.0, 0.9)], 0.9)
    assert est.goodput == 2.0 and not est.bracketed and est.high_rate is None


def test_goodput_report_normalizes() -> None:
    results = [{"rate": 1.0, "attainment": 1.0}, {"rate": 2.0, "attainment": 0.8}]
    report = goodput_report(results, 0.9, num_units=2, unit="cores")
    assert report["goodput"] == pytest.approx(1.5)
    assert report["goodput_per_unit"] == pytest.approx(0.75)
    assert report["unit"] == "cores"


def fake_runner(capacity: float) -> Any:
    """Attainment falls linearly from 1 at half the capacity to 0 at 1.5x."""
    calls: list[float] = []

    def run(rate: float) -> dict[str, Any]:
        calls.append(rate)
        value = min(1.0, max(0.0, 1.5 - rate / capacity))
        return {"summary": {"slo": {"attainment": value}}}

    run.calls = calls  # type: ignore[attr-defined]
    return run


def test_adaptive_sweep_doubles_then_bisects() -> None:
    run = fake_runner(capacity=3.0)  # 90% attainment at rate 1.8
    results = sweep(run, rates=None, rate_start=0.5, max_points=5)
    assert run.calls[:3] == [0.5, 1.0, 2.0]  # doubling until 2.0 fails (0.83)
    assert run.calls[3] == 1.5  # then bisects [1, 2]
    assert run.calls[4] == 1.75
    est = interpolate_goodput([(r["rate"], r["attainment"]) for r in results])
    assert est.goodput == pytest.approx(1.8)


def test_listed_rates_stop_below() -> None:
    run = fake_runner(capacity=1.0)
    results = sweep(run, rates=[3.0, 0.5, 1.0, 2.0], stop_below=0.3)
    assert run.calls == [0.5, 1.0, 2.0]  # sorted; 2.0 has attainment 0 < 0.3: stop
    assert [r["attainment"] for r in results] == pytest.approx([1.0, 0.5, 0.0])


def test_next_rate_without_points() -> None:
    assert next_rate([], 0.7) == 0.7
    assert next_rate([(1.0, 0.1)], 0.7) == 0.5


def test_parse_rates_and_urls() -> None:
    assert parse_rates("0.5, 1,2") == [0.5, 1.0, 2.0]
    assert parse_rates(None) is None
    for url in ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"]:
        assert normalize_base_url(url) == "http://h:1"


def test_derive_slo() -> None:
    isolated = {
        "short": {"ttft_ms": 100.0, "tpot_ms": 20.0},
        "long": {"ttft_ms": 1000.0, "tpot_ms": 25.0},
    }
    slo, how = derive_slo(isolated, k_ttft=3, k_tpot=2)
    assert (slo.ttft_ms, slo.tpot_ms) == (3000.0, 40.0)
    assert "3" in how and "2" in how


def points(rates: list[float], values: list[float]) -> list[dict[str, Any]]:
    return [{"rate": r, "attainment": a, "records": []} for r, a in zip(rates, values, strict=True)]


def test_common_rate_is_where_the_configs_differ() -> None:
    pts = {
        "disagg": points([1, 2, 3, 4], [1.0, 1.0, 0.95, 0.5]),
        "colocated": points([1, 2, 3, 4], [1.0, 0.92, 0.4, 0.3]),
    }
    assert common_rate(pts, 0.9) == 3  # the highest rate some config still passes
    pts["disagg"] = points([1, 2, 3, 4], [0.5, 0.4, 0.3, 0.2])
    pts["colocated"] = points([1, 2, 3, 4], [0.5, 0.4, 0.3, 0.2])
    assert common_rate(pts, 0.9) == 1  # nobody passes: the lowest common rate
    pts["colocated"] = points([5], [1.0])
    assert common_rate(pts, 0.9) == 1  # no common rate: the lowest of all


def test_plots_are_written(tmp_path: Path) -> None:
    rec = {
        "index": 0,
        "label": "short",
        "input_len": 8,
        "max_tokens": 3,
        "arrival_s": 0.0,
        "start_s": 0.0,
        "first_token_s": 0.1,
        "end_s": 0.3,
        "chunk_times_s": [0.1, 0.2, 0.3],
        "output_tokens": 3,
        "success": True,
    }
    pts = {
        name: [{"rate": 1.0, "attainment": 1.0, "records": [rec]}]
        for name in ("disagg", "colocated")
    }
    result = {
        "slo": {"ttft_ms": 200.0, "tpot_ms": 50.0},
        "target": 0.9,
        "goodput": {"disagg": 1.0, "colocated": 1.0},
        "common_rate": 1.0,
    }
    paths = plot(result, pts, tmp_path, "cmp")
    assert len(paths) == 4
    assert all(Path(p).stat().st_size > 1000 for p in paths)
