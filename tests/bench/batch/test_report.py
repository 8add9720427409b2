"""`bench batch`'s arithmetic: a job's throughput over time from its polls, and the verdicts."""

from __future__ import annotations

import json

import pytest

from bench.batch.jobs import JobRun, JobShape
from bench.batch.report import rates, verdicts


def test_rates_bin_the_lines_finished_between_polls() -> None:
    timeline = [(0.5, 0), (1.5, 4), (2.5, 4), (3.5, 10)]
    times, values = rates(timeline, tokens_per_line=8, bin_s=2.0)
    assert times == [1.0, 3.0]
    assert values == [4 * 8 / 2.0, 6 * 8 / 2.0]


def test_verdicts_against_the_targets() -> None:
    document = {
        "idle": {"job_tok_s": 850.0},
        "offline": {"tok_s": 1000.0},
        "loaded": {"interactive_attainment_with_job": 0.9, "interactive_attainment_without": 1.0},
    }
    result = verdicts(document)
    assert result["job_vs_offline"] == pytest.approx(0.85) and result["job_vs_offline_ok"]
    assert result["attainment_ratio"] == pytest.approx(0.9) and not result["attainment_ok"]


def test_job_lines_and_throughput() -> None:
    shape = JobShape(num_requests=3, prompt_tokens=10, max_tokens=4, seed=1)
    lines = [json.loads(raw) for raw in shape.jsonl("m").splitlines()]
    assert [line["custom_id"] for line in lines] == ["line-0", "line-1", "line-2"]
    assert all(line["body"]["ignore_eos"] and line["body"]["max_tokens"] == 4 for line in lines)
    assert lines[0]["body"]["prompt"] == shape.prompts()[0]
    run = JobRun(wall_s=2.0, final={"status": "completed", "request_counts": {"completed": 3}})
    assert run.tok_s(shape.max_tokens) == 6.0
    assert JobRun(wall_s=2.0, final={"status": "cancelled"}).tok_s(4) is None
