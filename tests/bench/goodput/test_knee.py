"""The knee search, Wilson intervals, bootstrap intervals and the comparison's aggregates:
pure functions against values worked out by hand or known distributions."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from bench.compare.report import aggregate
from bench.goodput.knee import (
    KneeStepper,
    PointCounts,
    find_knee,
    interpolate_goodput,
    resampled_goodput,
)
from bench.goodput.stats import bootstrap_interval, spread, wilson_interval, z_score


def linear(capacity: float, calls: list[float]) -> Any:
    """Attainment 1 up to half the capacity, falling linearly to 0 at 1.5x."""

    def attainment_at(rate: float) -> float:
        calls.append(rate)
        return min(1.0, max(0.0, 1.5 - rate / capacity))

    return attainment_at


def test_doubles_then_bisects_to_the_tolerance() -> None:
    calls: list[float] = []
    search = find_knee(linear(3.0, calls), rate_start=0.5, target=0.9, tolerance=0.1)
    # 0.5, 1 pass; 2 fails (0.83); bisect [1, 2]: 1.5 passes (1.0), 1.75 passes (0.917),
    # [1.75, 2] is 0.25 wide > 0.2: 1.875 fails (0.875); [1.75, 1.875] is 0.125 <= 0.1875.
    assert calls == [0.5, 1.0, 2.0, 1.5, 1.75, 1.875]
    assert search.converged
    assert search.points == [(r, min(1.0, max(0.0, 1.5 - r / 3))) for r in calls]
    assert search.estimate.bracketed
    assert search.estimate.goodput == pytest.approx(1.8)  # the exact 90% crossing


def test_halves_when_the_first_rate_fails() -> None:
    calls: list[float] = []
    search = find_knee(linear(1.0, calls), rate_start=4.0, target=0.9, tolerance=0.2)
    # 4, 2, 1 fail (0, 0, 0.5); 0.5 passes; then bisect [0.5, 1]: 0.75 (0.75) fails,
    # 0.625 (0.875) fails; [0.5, 0.625] is 0.125 <= 0.2 * 0.625.
    assert calls == [4.0, 2.0, 1.0, 0.5, 0.75, 0.625]
    assert search.converged
    assert search.estimate.goodput == pytest.approx(0.6)


def test_every_point_is_counted_against_max_points() -> None:
    calls: list[float] = []
    search = find_knee(linear(100.0, calls), rate_start=1.0, max_points=3)
    assert calls == [1.0, 2.0, 4.0]  # never fails within 3 points
    assert not search.converged and not search.estimate.bracketed
    assert search.estimate.goodput == 4.0  # a lower bound


def test_a_server_failing_everywhere_stops_halving() -> None:
    calls: list[float] = []
    search = find_knee(lambda r: calls.append(r) or 0.0, rate_start=1.0, max_points=50)
    assert len(calls) == 12 and calls[-1] == pytest.approx(2.0**-11)
    assert not search.converged


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate_start": 0}, "rate_start"),
        ({"tolerance": 1.0}, "tolerance"),
        ({"max_points": 0}, "max_points"),
    ],
)
def test_bad_search_arguments(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        find_knee(lambda r: 1.0, **{"rate_start": 1.0, **kwargs})  # type: ignore[arg-type]


def test_wilson_matches_hand_computed_values() -> None:
    # 90 of 100 at 95%: center (0.9 + 1.96^2/200) / (1 + 1.96^2/100), half-width ...
    low, high = wilson_interval(90, 100)
    assert (low, high) == pytest.approx((0.8256, 0.9448), abs=5e-4)
    assert wilson_interval(100, 100)[1] == 1.0
    assert wilson_interval(100, 100)[0] == pytest.approx(0.963, abs=1e-3)
    assert wilson_interval(0, 10)[0] == 0.0
    assert z_score(0.95) == pytest.approx(1.959964, abs=1e-6)
    with pytest.raises(ValueError, match="n must be positive"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_wilson_covers_the_true_share() -> None:
    rng = np.random.default_rng(7)
    hits = sum(
        low <= 0.9 <= high
        for low, high in (wilson_interval(int(rng.binomial(100, 0.9)), 100) for _ in range(2000))
    )
    assert 0.92 <= hits / 2000 <= 0.98  # nominal 95%


def test_bootstrap_interval_of_a_mean() -> None:
    data = np.random.default_rng(1).normal(10.0, 2.0, size=400)

    def draw(rng: np.random.Generator) -> float:
        return float(rng.choice(data, size=data.size).mean())

    low, high = bootstrap_interval(draw, num_resamples=1000, seed=3)
    se = data.std(ddof=1) / math.sqrt(data.size)  # ~0.1
    assert low < data.mean() < high
    assert high - low == pytest.approx(2 * 1.96 * se, rel=0.2)
    assert all(math.isnan(v) for v in bootstrap_interval(lambda rng: math.inf, 10))


def test_spread() -> None:
    out = spread([1.0, 2.0, 3.0])
    assert (out["mean"], out["std"], out["min"], out["max"], out["n"]) == (2.0, 1.0, 1.0, 3.0, 3)
    assert spread([2.0])["std"] is None
    assert spread([])["mean"] is None


def test_point_counts_use_the_worst_class() -> None:
    assert PointCounts(1.0, ((95, 100), (8, 10))).attainment == pytest.approx(0.8)
    assert PointCounts(1.0, ((9, 10), (0, 0))).attainment == pytest.approx(0.9)


def test_resampled_goodput_without_noise_is_exact() -> None:
    # Shares of 0 or 1 redraw to themselves: every draw is the interpolated goodput.
    run = [PointCounts(1.0, ((100, 100),)), PointCounts(2.0, ((0, 100),))]
    rng = np.random.default_rng(0)
    assert resampled_goodput([run, run], 0.9, rng) == pytest.approx(1.1)
    assert interpolate_goodput([(1.0, 1.0), (2.0, 0.0)], 0.9).goodput == pytest.approx(1.1)


def fake_run(rate_pass: float, rate_fail: float, fail_met: int = 0) -> dict[str, Any]:
    points = [
        {"rate": rate_pass, "classes": {"all": {"met": 100, "n": 100}}},
        {"rate": rate_fail, "classes": {"all": {"met": fail_met, "n": 100}}},
    ]
    estimate = interpolate_goodput([(rate_pass, 1.0), (rate_fail, fail_met / 100)], 0.9)
    return {
        "noisy": False,
        "points": points,
        "goodput": {"goodput": estimate.goodput, "bracketed": estimate.bracketed},
    }


def test_aggregate_ratio_and_interval() -> None:
    runs = {
        "disagg": [fake_run(2.0, 3.0), fake_run(2.0, 4.0), fake_run(2.0, 3.0, 50)],
        "colocated": [fake_run(1.0, 2.0), fake_run(1.0, 2.0)],
    }
    out = aggregate(runs, ["disagg", "colocated"], 0.9, num_resamples=500)
    # disagg goodputs 2 + 0.1 x 1, 2 + 0.1 x 2, 2 + 0.1 / 0.5 x 1; colocated 1.1, 1.1
    assert out["goodput"]["disagg"]["per_run"] == pytest.approx([2.1, 2.2, 2.2])
    assert out["goodput"]["colocated"]["std"] == pytest.approx(0.0)
    assert out["ratio"] == pytest.approx(out["goodput"]["disagg"]["mean"] / 1.1)
    low, high = out["ratio_ci"]
    # Seeds resampled: means between 2.1 and 2.2; the 50% point redraws to 2.17-2.25.
    assert 2.1 / 1.1 - 0.01 <= low < out["ratio"] < high <= 2.25 / 1.1 + 0.01
    assert out["ratios"]["disagg"]["ratio"] == out["ratio"]
    assert out["goodput"]["colocated"]["ci"] == pytest.approx([1.1, 1.1])


def test_aggregate_handles_three_configs_and_noisy_runs() -> None:
    noisy = {**fake_run(8.0, 9.0), "noisy": True}
    runs = {
        "a": [fake_run(2.0, 3.0), noisy],
        "b": [fake_run(1.5, 2.5)],
        "base": [fake_run(1.0, 2.0)],
    }
    out = aggregate(runs, ["a", "b", "base"], 0.9, exclude_noisy=True, num_resamples=200)
    assert out["goodput"]["a"]["per_run"] == [pytest.approx(2.1)]  # the noisy run left out
    assert out["goodput"]["a"]["num_noisy"] == 1 and out["goodput"]["a"]["num_runs"] == 2
    assert set(out["ratios"]) == {"a", "b"}
    assert out["ratios"]["b"]["ratio"] == pytest.approx(1.6 / 1.1)
    kept = aggregate(runs, ["a", "b", "base"], 0.9, num_resamples=200)
    assert len(kept["goodput"]["a"]["per_run"]) == 2


def test_paired_ratio_cancels_a_swing_every_config_shares() -> None:
    # Each seed moves both configs (its requests, the host): A is 2x B at every seed.
    runs = {
        "a": [{**fake_run(2.0 * k, 4.0 * k), "seed": k} for k in (1, 2, 3)],
        "b": [{**fake_run(1.0 * k, 2.0 * k), "seed": k} for k in (1, 2, 3)],
    }
    out = aggregate(runs, ["a", "b"], 0.9, num_resamples=500)
    ratios = out["ratios"]["a"]
    assert ratios["per_seed_ratio"] == pytest.approx([2.0, 2.0, 2.0])
    assert out["ratio_ci_paired"] == pytest.approx([2.0, 2.0])  # no noise left to resample
    low, high = out["ratio_ci"]  # unpaired: seeds drawn apart, the swing widens it
    assert low < 1.5 and high > 3.0
    # Different seeds: nothing to pair.
    runs["b"] = [{**run, "seed": run["seed"] + 10} for run in runs["b"]]
    assert (
        "ratio_ci_paired" not in aggregate(runs, ["a", "b"], 0.9, num_resamples=50)["ratios"]["a"]
    )


def test_steppers_advanced_in_turn_probe_what_each_search_alone_would() -> None:
    # `bench compare` interleaves configs point by point: the searches must not notice.
    knees = {"a": 3.0, "b": 0.7, "c": 100.0}
    alone = {
        name: find_knee(linear(k, []), rate_start=1.0, max_points=6) for name, k in knees.items()
    }
    steppers = {name: KneeStepper(1.0, max_points=6) for name in knees}
    while any(s.next_rate() is not None for s in steppers.values()):
        for name, stepper in steppers.items():
            if (rate := stepper.next_rate()) is not None:
                stepper.record(rate, linear(knees[name], [])(rate))
    for name, stepper in steppers.items():
        assert stepper.result() == alone[name]
