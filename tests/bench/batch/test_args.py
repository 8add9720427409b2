"""`bench batch`'s model and plan: a config serving the built-in `tiny` runs `small` unless
`--model` says otherwise, any other config its own model; the planned app has the job's
tenant and a store of its own; its interactive runs share arrival times, not prompts."""

from __future__ import annotations

import shutil

import pytest

from bench.batch.main import JOB_TENANT, build_parser, fresh_prompts, job_model, plan_args
from bench.serve.workloads import FixedWorkload, schedule


@pytest.mark.parametrize(
    ("configured", "model", "expected"),
    [
        ("tiny", None, "small"),  # serves tiny: small instead
        ("tiny", "tiny", "tiny"),  # asked for: kept
        ("small", None, None),  # any other model: the config's own
        ("/models/llama", None, None),
        ("small", "tiny", "tiny"),
    ],
)
def test_the_model_run(configured: str, model: str | None, expected: str | None) -> None:
    assert job_model(configured, model) == expected


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        ([], "small"),  # cpu-tenants serves tiny
        (["--model", "tiny"], "tiny"),
        (["--config", "cpu-fallback"], "small"),  # its own model (small)
        (["--config", "cpu-fallback", "--model", "tiny"], "tiny"),
    ],
)
def test_the_planned_app_runs_that_model_with_the_jobs_tenant(argv: list[str], model: str) -> None:
    options = build_parser().parse_args(["--json", "out.json", *argv])
    args, who = plan_args(options)
    try:
        assert args["model"]["model"] == model
        job_tenant = next(t for t in args["tenants"] if t["name"] == JOB_TENANT)
        assert job_tenant["api_keys"] == [who["job_key"]]
        assert job_tenant["default_class"] == "batch"
        assert who["interactive_tenant"] != JOB_TENANT
    finally:
        shutil.rmtree(args["batch"]["store_dir"], ignore_errors=True)


def test_each_interactive_run_keeps_the_arrival_times_with_prompts_of_its_own() -> None:
    workload = FixedWorkload(128, 32)
    arrivals = schedule(workload, 2.0, 10.0, seed=0)
    first, second = fresh_prompts(arrivals, workload, 13), fresh_prompts(arrivals, workload, 17)
    for runs in (first, second):
        assert [a.arrival_s for a in runs] == [a.arrival_s for a in arrivals]
        assert [a.spec.max_tokens for a in runs] == [a.spec.max_tokens for a in arrivals]
    prompts = [{a.spec.prompt for a in run} for run in (arrivals, first, second)]
    assert all(len(p) == len(arrivals) for p in prompts)
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
    assert fresh_prompts(arrivals, workload, 13) == first  # seeded
