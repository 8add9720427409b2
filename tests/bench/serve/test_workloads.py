"""Workload generation and arrival processes, with fixed seeds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from bench.serve.workloads import (
    FixedWorkload,
    MixedWorkload,
    RequestSpec,
    add_workload_args,
    arrival_offsets,
    class_shapes,
    describe_workload,
    interarrival_times,
    make_prompt,
    read_trace,
    schedule,
    schedule_trace,
    workload_from_args,
)

N = 20_000


def cv(values: np.ndarray) -> float:
    return float(np.std(values) / np.mean(values))


def test_poisson_mean_and_cv() -> None:
    gaps = interarrival_times(N, 4.0, "poisson", np.random.default_rng(0))
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert cv(gaps) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness_sets_cv(burstiness: float) -> None:
    gaps = interarrival_times(N, 2.0, "gamma", np.random.default_rng(1), burstiness)
    assert np.mean(gaps) == pytest.approx(0.5, rel=0.04)
    assert cv(gaps) == pytest.approx(1 / burstiness**0.5, rel=0.06)


def test_constant_arrivals() -> None:
    offsets = arrival_offsets(5.0, 2.0, "constant", np.random.default_rng(0))
    assert offsets == pytest.approx([i * 0.2 for i in range(10)])


def test_arrival_offsets_cover_the_window() -> None:
    offsets = arrival_offsets(10.0, 100.0, "poisson", np.random.default_rng(2))
    assert offsets[0] == 0.0
    assert all(b > a for a, b in zip(offsets, offsets[1:], strict=False))
    assert offsets[-1] < 100.0
    assert len(offsets) == pytest.approx(1000, rel=0.1)


def test_bad_arrival_arguments() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        interarrival_times(3, 0.0, "poisson", rng)
    with pytest.raises(ValueError):
        interarrival_times(3, 1.0, "gamma", rng, burstiness=0.0)
    with pytest.raises(ValueError):
        interarrival_times(3, 1.0, "weibull", rng)  # type: ignore[arg-type]


def test_make_prompt_length_and_charset() -> None:
    rng = np.random.default_rng(0)
    prompt = make_prompt(100, rng)
    assert len(prompt) == 99  # + BOS = 100 tokens
    assert prompt.isascii() and set(prompt) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert len(make_prompt(100, rng, special_tokens=0)) == 100
    assert make_prompt(100, rng) != prompt  # fresh text each time: no shared prefixes


def test_fixed_workload() -> None:
    spec = FixedWorkload(64, 16).sample(np.random.default_rng(0))
    assert (spec.input_len, spec.max_tokens, spec.label) == (64, 16, "fixed")
    assert len(spec.prompt) == 63


def test_mixed_workload_shares_and_lengths() -> None:
    workload = MixedWorkload(
        short_input_len=100,
        short_output_len=20,
        short_input_spread=0.2,
        long_input_min=500,
        long_input_max=900,
        long_output_len=8,
        long_share=0.3,
    )
    rng = np.random.default_rng(3)
    specs = [workload.sample(rng) for _ in range(5000)]
    long = [s for s in specs if s.label == "long"]
    short = [s for s in specs if s.label == "short"]
    assert len(long) / len(specs) == pytest.approx(0.3, abs=0.02)
    assert all(500 <= s.input_len <= 900 and s.max_tokens == 8 for s in long)
    assert all(80 <= s.input_len <= 120 and s.max_tokens == 20 for s in short)
    assert np.mean([s.input_len for s in short]) == pytest.approx(100, rel=0.02)
    assert all(len(s.prompt) == s.input_len - 1 for s in specs)


def test_mixed_workload_validates() -> None:
    with pytest.raises(ValueError):
        MixedWorkload(long_share=1.5)
    with pytest.raises(ValueError):
        MixedWorkload(long_input_min=10, long_input_max=5)


def test_schedule_is_seeded() -> None:
    workload = MixedWorkload(short_input_len=20, long_input_min=50, long_input_max=60)
    a = schedule(workload, 3.0, 20.0, "gamma", 0.5, seed=7)
    b = schedule(workload, 3.0, 20.0, "gamma", 0.5, seed=7)
    c = schedule(workload, 3.0, 20.0, "gamma", 0.5, seed=8)
    assert a == b
    assert a != c
    assert [r.index for r in a] == list(range(len(a)))
    # Contents do not depend on the arrival process.
    d = schedule(workload, 3.0, 20.0, "constant", seed=7)
    assert [r.spec for r in d[:5]] == [r.spec for r in a[:5]]


def test_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"prompt": "hello world", "max_tokens": 4, "arrival_s": 1.5},
        {"input_len": 32, "max_tokens": 8, "arrival_s": 0.5},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    entries = read_trace(path)
    assert [e.arrival_s for e in entries] == [0.5, 1.5]
    assert entries[0].spec.input_len == 32 and len(entries[0].spec.prompt) == 31
    assert entries[1].spec.prompt == "hello world" and entries[1].spec.input_len == 12
    scheduled = schedule_trace(entries, time_scale=2.0)
    assert [s.arrival_s for s in scheduled] == [1.0, 3.0]
    path.write_text(json.dumps({"prompt": "x", "arrival_s": 0}) + "\n")
    with pytest.raises(ValueError, match="max_tokens"):
        read_trace(path)


def workload_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    return parser.parse_args(list(argv))


def sample_labels(args: argparse.Namespace, n: int = 2000) -> list[RequestSpec]:
    workload = workload_from_args(args)
    rng = np.random.default_rng(5)
    return [workload.sample(rng) for _ in range(n)]


def test_chat_sends_short_prompts_only() -> None:
    args = workload_args("--workload", "chat", "--short-input-len", "64")
    specs = sample_labels(args)
    assert {s.label for s in specs} == {"chat"}
    assert all(48 <= s.input_len <= 80 and s.max_tokens == 128 for s in specs)
    assert list(class_shapes(args)) == ["chat"]


def test_long_context_sends_long_prompts_with_short_answers() -> None:
    args = workload_args("--workload", "long-context")
    specs = sample_labels(args)
    assert {s.label for s in specs} == {"long"}
    assert all(2048 <= s.input_len <= 4080 and s.max_tokens == 16 for s in specs)
    shapes = class_shapes(args)  # the longest prompt + its answer fit a 4096-token context
    assert list(shapes) == ["long"] and shapes["long"].input_len == 4080


def test_multi_tenant_mixes_interactive_and_batch() -> None:
    args = workload_args("--workload", "multi-tenant", "--long-input-min", "600")
    specs = sample_labels(args)
    batch = [s for s in specs if s.label == "batch"]
    assert {s.label for s in specs} == {"interactive", "batch"}
    assert len(batch) / len(specs) == pytest.approx(0.25, abs=0.03)
    assert all(600 <= s.input_len <= 4096 and s.max_tokens == 64 for s in batch)
    assert list(class_shapes(args)) == ["interactive", "batch"]
    described = describe_workload(args)
    assert described["labels"] == ["interactive", "batch"]
    assert (described["long_input_min"], described["long_share"]) == (600, 0.25)


def test_mixed_keeps_its_defaults() -> None:
    args = workload_args()
    described = describe_workload(args)
    assert described["workload"] == "mixed" and described["labels"] == ["short", "long"]
    assert (described["short_input_len"], described["long_input_max"]) == (256, 4096)
    assert described["long_share"] == 0.15
    assert list(class_shapes(args)) == ["short", "long"]


def test_schedule_by_count_sends_exactly_that_many_at_the_rate() -> None:
    workload = FixedWorkload(16, 4)
    requests = schedule(workload, 4.0, 0.0, "poisson", seed=3, num_requests=2000)
    offsets = [r.arrival_s for r in requests]
    assert len(requests) == 2000 and offsets[0] == 0.0
    assert offsets == sorted(offsets)
    assert offsets[-1] / 1999 == pytest.approx(0.25, rel=0.06)
    constant = schedule(workload, 2.0, 0.0, "constant", num_requests=5)
    assert [r.arrival_s for r in constant] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError, match="num_requests"):
        schedule(workload, 1.0, 0.0, num_requests=0)
