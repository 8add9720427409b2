"""`bench batch`'s arguments: the model is `small` unless `--model` says otherwise (the
other serving benches keep their config's model), and the app it plans has the job's
tenant and a store of its own."""

from __future__ import annotations

import argparse
import shutil

import pytest

from bench.batch.jobs import run_job
from bench.batch.main import JOB_TENANT, build_parser, plan_args
from bench.serve.deploy import add_app_arguments


def test_the_model_is_small_unless_given() -> None:
    assert build_parser().parse_args(["--json", "out.json"]).model == "small"
    assert build_parser().parse_args(["--json", "out.json", "--model", "tiny"]).model == "tiny"
    other = argparse.ArgumentParser()
    add_app_arguments(other, "cpu-tenants")
    assert other.parse_args([]).model is None  # the config's own model


@pytest.mark.parametrize("model", ["small", "tiny"])
def test_the_planned_app_runs_that_model_with_the_jobs_tenant(model: str) -> None:
    options = build_parser().parse_args(["--json", "out.json", "--model", model])
    args, who = plan_args(options)
    try:
        assert args["model"]["model"] == model
        job_tenant = next(t for t in args["tenants"] if t["name"] == JOB_TENANT)
        assert job_tenant["api_keys"] == [who["job_key"]]
        assert job_tenant["default_class"] == "batch"
        assert who["interactive_tenant"] != JOB_TENANT
    finally:
        shutil.rmtree(args["batch"]["store_dir"], ignore_errors=True)


def test_the_job_is_polled_as_the_command_line_client_polls() -> None:
    import inspect

    from app.batch.cli import build_parser as cli_parser

    poll_s = inspect.signature(run_job).parameters["poll_s"].default
    assert poll_s == cli_parser().parse_args(["submit", "in.jsonl"]).poll_s
