"""Core splitting, pinned app args and drift: the pure parts of `bench/compare/quiet.py`."""

from __future__ import annotations

import pytest

from bench.compare.quiet import drift, host_state, parse_cores, pin_pools, split_cores
from bench.serve.deploy import app_args


def test_parse_cores() -> None:
    assert parse_cores("0,1") == [0, 1]
    assert parse_cores("2-4, 7,3") == [2, 3, 4, 7]
    for bad in ("", "a", "1-x"):
        with pytest.raises(ValueError, match="bad core list"):
            parse_cores(bad)


def test_split_cores_by_replicas() -> None:
    pools = [("prefill", 1), ("decode", 1)]
    assert split_cores([0, 1], pools) == {"prefill": [0], "decode": [1]}
    assert split_cores([4, 5, 6, 7], [("prefill", 1), ("decode", 3)]) == {
        "prefill": [4],
        "decode": [5, 6, 7],
    }
    assert split_cores([0, 1, 2], [("a", 1), ("b", 1)]) == {"a": [0, 1], "b": [2]}
    assert split_cores([0, 1], [("decode", 2)]) == {"decode": [0, 1]}
    # Fewer cores than pools: they share all of them.
    assert split_cores([3], pools) == {"prefill": [3], "decode": [3]}


def test_pin_pools_sets_a_valid_affinity_per_pool() -> None:
    args = app_args("cpu-disagg")
    pinned = pin_pools(args, [0])
    assert [p["cpu_affinity"] for p in pinned["pools"]] == [[0], [0]]
    assert "cpu_affinity" not in args["pools"][0]  # the original is untouched
    app_args(pinned)  # still a valid config
    colocated = pin_pools(app_args("cpu-colocated"), [0])
    assert [p["cpu_affinity"] for p in colocated["pools"]] == [[0]]


def test_drift_is_the_largest_relative_move() -> None:
    before = {"short": {"ttft_ms": 100.0, "tpot_ms": 50.0}, "long": {"ttft_ms": 1000.0}}
    after = {"short": {"ttft_ms": 110.0, "tpot_ms": 75.0}, "long": {"ttft_ms": 900.0}}
    assert drift(before, after) == pytest.approx(0.5)
    assert drift(before, {"short": {"ttft_ms": None, "tpot_ms": None}}) is None
    assert drift({}, after) is None


def test_host_state() -> None:
    state = host_state()
    assert len(state["load_avg"]) == 3 and all(v >= 0 for v in state["load_avg"])
    assert state["bench_cores"] and max(state["bench_cores"]) < state["num_cores"]
