"""`pdserve bench serve` end to end against the default app on the tiny model, and the
capacity probe that `pdserve bench chaos` sizes its load from, against the same app.

A ~10-second run at a low Poisson rate with a small mixed workload, through the CLI
dispatcher, the load generator and the metrics; the output JSON must be complete and sane.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from app.cli import main
from bench.chaos.load import measure_capacity, request_pool, with_references

if TYPE_CHECKING:
    from bench.serve.deploy import RunningApp

pytestmark = pytest.mark.slow

DURATION_S = 10
RATE = 2.0
USD_PER_HOUR = 3.6


def test_bench_serve_e2e(
    bench_server: RunningApp, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--url", f"{bench_server.base_url}/v1", "--no-progress"]
    argv += ["--workload", "mixed", "--rate", str(RATE), "--duration", str(DURATION_S)]
    argv += ["--short-input-len", "48", "--short-output-len", "16"]
    argv += ["--long-input-min", "300", "--long-input-max", "500", "--long-output-len", "8"]
    argv += ["--long-share", "0.2", "--slo-ttft", "2000", "--slo-tpot", "200", "--seed", "3"]
    argv += ["--json", str(out), "--usd-per-hour", str(USD_PER_HOUR)]
    assert main(argv) == 0

    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    printed = json.loads(last_line)
    document = json.loads(out.read_text())
    summary, records = document["summary"], document["records"]
    assert printed["num_requests"] == summary["num_requests"] == len(records)
    assert document["run"]["model"] == bench_server.model_name == "pdserve-tiny"

    # Poisson at 2 req/s for 10 s: about 20 requests, all completed.
    assert 8 <= summary["num_requests"] <= 40
    assert summary["num_completed"] == summary["num_requests"]
    assert summary["num_failed"] == 0
    assert {r["label"] for r in records} <= {"short", "long"}
    for r in records:
        assert r["success"], r["error"]
        assert r["output_tokens"] == r["max_tokens"]  # ignore_eos: exact lengths
        assert r["prompt_tokens"] == r["input_len"]  # one char per token, plus BOS
        assert r["ttft_ms"] > 0
        assert r["e2e_ms"] >= r["ttft_ms"]
        assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
        assert r["route"] and "decode" in r["route"]

    assert summary["num_output_tokens"] == sum(r["max_tokens"] for r in records)
    assert summary["ttft_ms"]["p50"] > 0 and summary["tpot_ms"]["p50"] > 0
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p90"] <= summary["ttft_ms"]["p99"]
    assert 0 < summary["request_throughput"] <= 2 * RATE
    slo = summary["slo"]
    assert 0.0 <= slo["attainment"] <= 1.0
    assert slo["attainment"] <= min(slo["ttft_attainment"], slo["tpot_attainment"])
    assert set(summary["by_label"]) == {r["label"] for r in records}

    # The server's side: its TTFT breakdown covers exactly the recorded requests (the
    # warm-up finished before the clock started), and the cost is the fleet's rate over
    # the run's duration, per token the client counted.
    server = document["server"]
    assert printed["server"] == server
    breakdown = server["ttft_breakdown"]
    assert breakdown["num_requests"] == summary["num_completed"]
    assert 0 < breakdown["num_remote_prefill"] <= breakdown["num_requests"]  # threshold 0
    assert 0 < breakdown["prefill_ms"]["p50"] <= breakdown["prefill_ms"]["p90"]
    assert breakdown["total_ms"]["p50"] <= summary["ttft_ms"]["p90"]
    tokens = summary["num_input_tokens"] + summary["num_output_tokens"]
    usd = USD_PER_HOUR * summary["duration_s"] / 3600
    assert server["cost"]["usd_per_1m_tokens"] == pytest.approx(usd / tokens * 1e6)
    assert server["cost"]["usd_per_request"] == pytest.approx(usd / summary["num_completed"])


def test_chaos_capacity_probe(bench_server: RunningApp) -> None:
    """A closed-loop saturation search with the chaos mix (short and long prompts, half
    streamed): the concurrency doubles from 1, every probe request completes with its
    reference text, and the capacity is the best throughput measured."""
    shapes = with_references(request_pool(3, 3, seed=0), bench_server.args)
    options = argparse.Namespace(seed=0, request_timeout=60.0, probe_s=2.0)
    capacity = asyncio.run(measure_capacity(bench_server, shapes, options, max_concurrency=8))

    concurrencies = [p.concurrency for p in capacity.points]
    assert concurrencies == [2**k for k in range(len(concurrencies))] and concurrencies[-1] <= 8
    assert capacity.requests_per_s == max(p.throughput for p in capacity.points) > 0
    assert all(p.failed == 0 for p in capacity.points), capacity.to_dict()
    assert all(p.completed + p.failed <= p.sent for p in capacity.points)
