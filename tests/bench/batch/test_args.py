"""`bench batch`'s model and plan: a config serving the built-in `tiny` runs `small` unless
`--model` says otherwise, any other config its own model; the planned app has the job's
tenant and a store of its own."""

from __future__ import annotations

import shutil

import pytest

from bench.batch.main import JOB_TENANT, build_parser, job_model, plan_args


@pytest.mark.parametrize(
    ("config", "model", "expected"),
    [
        ("cpu-tenants", None, "small"),  # serves tiny: small instead
        ("cpu-tenants", "tiny", "tiny"),  # asked for: kept
        ("cpu-fallback", None, None),  # serves small: its own model
        ("cpu-fallback", "tiny", "tiny"),
    ],
)
def test_the_model_run(config: str, model: str | None, expected: str | None) -> None:
    assert job_model(config, model) == expected


@pytest.mark.parametrize(("argv", "model"), [([], "small"), (["--model", "tiny"], "tiny")])
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
