"""`bench.compare.run` sends only prompts the server has not seen, in isolated requests and at
every knee point: a repeated prompt would hit the prefix cache and measure a shorter prefill
(before this, isolated figures after a run "drifted" 55-70% from those before it on long
prompts for that reason alone)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

import bench.compare.run as compare
from bench.serve.workloads import add_workload_args


def test_isolated_prompts_are_all_new(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []

    def record(target: Any, requests: list[Any], **kw: Any) -> Any:
        assert kw["warmup"] == 0  # the warm-up is a prompt of its own, sent first
        sent.extend(r.spec.prompt for r in requests)
        return SimpleNamespace(records=[])

    monkeypatch.setattr(compare, "run_load_sync", record)
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    args = parser.parse_args(["--workload", "mixed"])
    args.isolated_repeats = 3
    before = compare.measure_isolated(None, args, seed=0)  # type: ignore[arg-type]
    compare.measure_isolated(None, args, seed=0, phase=1)  # type: ignore[arg-type]
    assert set(before) == {"short", "long"}
    assert len(sent) == 2 * 2 * (1 + 3)  # 2 phases x 2 classes x (warm-up + repeats)
    assert len(set(sent)) == len(sent)


def test_every_knee_point_draws_new_prompts() -> None:
    # The k-th point of every config shares a seed (paired comparison); no two points of a
    # run, or of two seeds, do (the prefix cache would serve a repeated point's prefill).
    seeds = [compare.point_seed(seed, [{}] * k) for seed in range(3) for k in range(10)]
    assert len(set(seeds)) == len(seeds)
    assert compare.point_seed(1, [{}, {}]) == compare.point_seed(1, [{"rate": 2.0}] * 2)
