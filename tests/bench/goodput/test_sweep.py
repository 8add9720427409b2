"""Goodput interpolation, the rate sweep, and the comparison's pure helpers."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from bench.compare.main import parse_args
from bench.compare.report import common_rate, plot
from bench.compare.run import derive_slo, plan_slos, point
from bench.goodput.stats import wilson_interval
from bench.goodput.sweep import goodput_report, interpolate_goodput, next_rate, parse_rates, sweep
from bench.serve.loadgen import RunResult, normalize_base_url
from bench.serve.metrics import SLO, RequestRecord


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


def record(index: int, label: str, ttft: float, tpot: float) -> dict[str, Any]:
    """A 3-token request: first token at `ttft` s, then one every `tpot` s."""
    chunks = [ttft, ttft + tpot, ttft + 2 * tpot]
    end = chunks[-1]
    return {
        "index": index,
        "label": label,
        "input_len": 8,
        "max_tokens": 3,
        "arrival_s": 0.0,
        "start_s": 0.0,
        "first_token_s": ttft,
        "end_s": end,
        "chunk_times_s": chunks,
        "output_tokens": 3,
        "success": True,
    }


def compare_args(*argv: str) -> argparse.Namespace:
    return parse_args(["--json", "out.json", *argv])


def test_shared_slo_plan_derives_from_isolated_figures() -> None:
    args = compare_args("--workload", "mixed", "--k-ttft", "3", "--k-tpot", "2")
    isolated = {
        "short": {"ttft_ms": 100.0, "tpot_ms": 20.0},
        "long": {"ttft_ms": 1000.0, "tpot_ms": 25.0},
    }
    plan, shared, how = plan_slos(args, isolated)
    assert shared == SLO(3000.0, 40.0)
    assert plan == {"short": shared, "long": shared}
    given = compare_args("--workload", "mixed", "--slo-tpot", "55")
    assert plan_slos(given, isolated)[1] == SLO(3000.0, 55.0)


def test_per_class_slo_plan_for_multi_tenant() -> None:
    args = compare_args("--workload", "multi-tenant", "--batch-slo-factor", "4")
    isolated = {
        "interactive": {"ttft_ms": 100.0, "tpot_ms": 20.0},
        "batch": {"ttft_ms": 1000.0, "tpot_ms": 25.0},
    }
    plan, shared, _ = plan_slos(args, isolated)
    assert shared is None
    assert plan == {"interactive": SLO(300.0, 30.0), "batch": SLO(12000.0, 150.0)}


def test_point_counts_each_class_against_its_own_slo() -> None:
    # interactive: 9 of 10 meet TTFT 300 ms / TPOT 30 ms; batch: 1 of 2 (one too slow).
    rows = [record(i, "interactive", 0.1, 0.02) for i in range(9)]
    rows += [record(9, "interactive", 0.5, 0.02)]
    rows += [record(10, "batch", 1.0, 0.1), record(11, "batch", 1.0, 0.2)]
    result = RunResult([RequestRecord.from_dict(r) for r in rows], duration_s=5.0)
    plan = {"interactive": SLO(300.0, 30.0), "batch": SLO(12000.0, 150.0)}
    out = point(result, plan, None, None, 0.95)
    assert out["classes"]["interactive"]["met"] == 9 and out["classes"]["batch"]["met"] == 1
    assert out["attainment"] == pytest.approx(0.5)  # the worst class
    assert out["attainment_ci"] == pytest.approx(list(wilson_interval(1, 2)))
    assert out["num_requests"] == 12 and len(out["records"]) == 12
    slo = SLO(300.0, 30.0)
    shared = point(result, {"interactive": slo, "batch": slo}, slo, None, 0.95)
    assert list(shared["classes"]) == ["all"]
    assert shared["attainment"] == pytest.approx(9 / 12)
    assert shared["attainment"] == shared["summary"]["slo"]["attainment"]


def test_compare_arguments_are_checked() -> None:
    with pytest.raises(SystemExit):
        compare_args("--configs", "cpu-disagg")  # needs a baseline
    with pytest.raises(SystemExit):
        compare_args("--rates", "1,2")  # compare searches the knee itself
    with pytest.raises(SystemExit):
        compare_args("--seeds", "0")
    args = compare_args("--configs", "a,b,c", "--replica-cores", "0-1")
    assert args.names == ["a", "b", "c"] and args.replica_cores == [0, 1]
    assert (args.seeds, args.requests_per_point, args.max_points) == (3, 100, 10)


def test_plots_are_written(tmp_path: Path) -> None:
    def run(rate: float, attainment: float) -> dict[str, Any]:
        pt = {
            "rate": rate,
            "attainment": attainment,
            "attainment_ci": [attainment - 0.05, min(1.0, attainment + 0.05)],
            "records": [record(0, "short", 0.1, 0.05)],
        }
        return {"points": [pt]}

    document = {
        "workload": {"workload": "mixed"},
        "slo": {"shared": {"ttft_ms": 200.0, "tpot_ms": 50.0}},
        "target": 0.9,
        "confidence": 0.95,
        "goodput": {
            name: {"mean": 1.0, "ci": [0.8, 1.2], "per_run": [0.9, 1.1]}
            for name in ("disagg", "colocated")
        },
        "ratio": 1.0,
        "ratio_ci": [0.7, 1.4],
        "common_rate": 1.0,
        "runs": {"disagg": [run(1.0, 1.0)], "colocated": [run(1.0, 0.8)]},
    }
    paths = plot(document, tmp_path, "cmp")
    assert [Path(p).name for p in paths] == [
        "cmp_attainment.png",
        "cmp_goodput.png",
        "cmp_ttft_cdf.png",
        "cmp_tpot_cdf.png",
        "cmp_itl_cdf.png",
    ]
    assert all(Path(p).stat().st_size > 1000 for p in paths)
