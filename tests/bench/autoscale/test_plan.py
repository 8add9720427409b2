"""How `pdserve bench autoscale` turns measured capacity into its ramp (`bench/autoscale/plan.py`,
pure): the probe fleet is the config at its minimum with nothing to scale, the decode probe
keeps the pool's target overshot, and the rates scale with what was measured."""

from __future__ import annotations

import pytest

from app.config import load_config
from bench.autoscale.load import Shape, stress_ramp
from bench.autoscale.plan import (
    decode_peak,
    decode_probe_concurrency,
    fixed_at_minimum,
    fixed_rates,
    ramp_rates,
)
from bench.serve.deploy import app_args


def test_the_probe_fleet_is_the_minimum_with_autoscaling_off() -> None:
    args = app_args("cpu-autoscale")
    probe, fleet = fixed_at_minimum(args)
    assert fleet == {"prefill": 1, "decode": 1}
    config = load_config(probe)  # still a valid config
    for pool in config.pools:
        assert pool.autoscaling is None and pool.num_replicas == 1
    # Everything else is the config as written; the caller's args are untouched.
    assert [p["engine"] for p in probe["pools"]] == [p["engine"] for p in args["pools"]]
    assert all("autoscaling" in p for p in args["pools"])


def test_fixed_pools_keep_their_count() -> None:
    args = app_args("cpu-autoscale")
    args["pools"][1] = {**args["pools"][1], "num_replicas": 3}
    del args["pools"][1]["autoscaling"]
    args["pools"][0]["autoscaling"] = {**args["pools"][0]["autoscaling"], "min_replicas": 2}
    args["pools"][0]["autoscaling"]["max_replicas"] = 3
    _, fleet = fixed_at_minimum(args)
    assert fleet == {"prefill": 2, "decode": 3}


def test_decode_probe_starts_at_the_target_of_the_minimum_pool() -> None:
    assert decode_probe_concurrency(3, 1) == 3  # cpu-autoscale: 3 running x 1 replica
    assert decode_probe_concurrency(3, 2, overshoot=1.5) == 9
    assert decode_probe_concurrency(2.5, 1, overshoot=1.5) == 4  # rounded up
    with pytest.raises(ValueError):
        decode_probe_concurrency(0, 1)


def test_the_decode_peak_is_where_the_pool_runs_its_overshot_target() -> None:
    # (running sequences read from the pool, throughput) at 3, 6, 12 in flight.
    points = [(1.5, 2.5), (3.5, 4.0), (7.5, 6.0)]
    assert decode_peak(points, running=6.0, capacity=9.0, load=0.8) == pytest.approx(5.25)
    assert decode_peak(points, running=3.5, capacity=9.0, load=0.8) == 4.0
    # Below the first point or past the last one: in proportion (Little's law).
    assert decode_peak(points, running=0.75, capacity=9.0) == pytest.approx(1.25)
    assert decode_peak(points[:2], running=7.0, capacity=20.0) == pytest.approx(8.0)


def test_the_decode_peak_stays_below_the_knee() -> None:
    # Streaming saturates the machine before the pool runs its target: the peak is capped.
    points = [(0.8, 4.0), (1.2, 5.5), (1.4, 5.7)]
    assert decode_peak(points, running=6.0, capacity=5.7, load=0.8) == pytest.approx(4.56)
    assert decode_peak([(0.0, 4.0)], running=6.0, capacity=5.0, load=0.8) == 4.0  # no reading


def test_rates_follow_the_measured_capacity() -> None:
    # A machine twice as fast measures twice the capacity and gets twice the rates.
    slow = ramp_rates({"prefill": 0.9 * 10.0, "decode": 4.0})
    fast = ramp_rates({"prefill": 0.9 * 20.0, "decode": 8.0})
    assert slow.peaks == {"prefill": 9.0, "decode": 4.0}
    assert slow.low == pytest.approx(0.25 * 4.0)  # a quarter of the lower peak
    assert fast.low == pytest.approx(2 * slow.low)
    assert fast.peaks == {role: 2 * rate for role, rate in slow.peaks.items()}
    assert ramp_rates({"decode": 4.0}, low_load=0.5).low == 2.0  # one role stressed
    with pytest.raises(ValueError):
        ramp_rates({"prefill": 0.0, "decode": 4.0})  # a probe that completed nothing
    with pytest.raises(ValueError):
        ramp_rates({})


def test_a_fixed_ramp_is_the_old_absolute_one() -> None:
    rates = fixed_rates(0.75, 4.0, ["prefill", "decode"])
    assert rates.low == 0.75 and rates.peaks == {"prefill": 3.0, "decode": 3.0}


def test_the_ramp_runs_each_stress_at_its_own_measured_peak() -> None:
    rates = ramp_rates({"prefill": 9.0, "decode": 4.0})
    shapes = {"prefill": Shape(2048, 4), "decode": Shape(48, 128)}
    ramp = stress_ramp(rates.low, rates.peaks, 30.0, 10.0, 80.0, Shape(256, 16), shapes)
    by_name = {phase.name: phase for phase in ramp.phases}
    assert by_name["prefill-peak"].rate_from == by_name["prefill-peak"].rate_to == 9.0
    assert by_name["decode-peak"].rate_from == by_name["decode-peak"].rate_to == 4.0
    assert by_name["decode-up"].rate_from == by_name["low"].rate_to == 1.0
    assert ramp.peak_rate == 9.0
