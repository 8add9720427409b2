"""`pdserve bench batch`: a batch job on an idle service against the engine's own offline
throughput, then beside interactive load against that load alone.

1. **Offline**: the job's requests (`--requests` greedy completions of `--prompt-tokens`
   random tokens, `--max-tokens` generated each, EOS ignored) handed to one `Engine` in this
   process at once, with the config's decode pool's engine settings, once with 1 torch
   thread and once with `--num-cpus` (the cores the app gets), and with `--num-cpus` once
   more after the app has stopped (step 8): `offline_tok_s`, generated tokens/s, is the best
   of them.
2. The config is deployed on a private Ray instance with `--num-cpus` CPUs, plus a tenant of
   its own for the job (default class: the config's `batch` class, no limits of its own);
   interactive requests are sent by the config's first tenant whose default class is
   `interactive`, and judged by that class's TTFT/TPOT SLOs.
3. **Idle**: once the ingress reads the service as idle after the warm-up's interactive
   requests (`batch.idle` of `/v1/pdserve/stats`: their quiet period behind), the job
   is submitted (OpenAI Batch API) and followed to completion, `--idle-runs` (2) times in
   turn: `job_tok_s` = the best run's generated tokens / wall time from submit to completed.
4. **Capacity**: a closed-loop probe of interactive requests (`--interactive-prompt-tokens`,
   `--interactive-max-tokens`), doubling concurrency to saturation (`bench.serve.capacity`).
5. **Interactive alone**: Poisson arrivals at `--load` (0.5) x that capacity for
   `--duration` s.
6. **Interactive with a job**: the same job submitted again, then the same arrivals:
   `interactive_attainment_with_job`; the job is followed until it completes.
7. **Interactive alone again**, the same arrivals once more: `interactive_attainment_without`
   is over both runs alone, before and after the one with the job (A-B-A), so a host that
   slows down or speeds up across the phases moves both sides alike.
8. **Offline again**, the app stopped.

Each of the three interactive runs sends the same arrival times with prompts of its own
(`fresh_prompts`), and each job (the idle runs, the one beside the load) lines of its own
(`JobShape.seed`): no run finds another's prompts in a prefix cache.

Best of several runs on both sides of the idle ratio: on a shared host the same offline run
moved 261-348 tok/s between runs minutes apart (2 cores of an AMD EPYC, BENCHMARKS.md), and other
work only ever slows a run, so each side's best is its closest figure to what it can do;
every run is in the JSON.

    pdserve bench batch --config cpu-tenants --json out.json

runs the config's model, except that a config serving the built-in `tiny` (the quick
start's model, as `cpu-tenants` does) runs the built-in `small` unless `--model` says so:
on `tiny` the engine computes the whole default job in ~0.5 s on 2 cores, less than a
durable job's own latency (claiming its lease, writing its results and files, the
client's polls), so the ratio there measures that latency, not throughput.
The job is polled once a second (`pdserve batch submit --wait`'s pace; `job.poll_s` in
the JSON): a poll is an HTTP request through the proxy and the ingress, CPU the job's
engine would otherwise have, and `job_tok_s`'s wall time ends at the poll that sees the
job completed (up to a second late).

It writes the JSON (every figure, the job timelines, the interactive records) and `out.png`
beside it (job throughput over time, the interactive load marked); the last stdout line is
the summary as one JSON object. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import platform
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.batch.jobs import (
    POLL_S,
    JobRun,
    JobShape,
    interactive_capacity,
    offline_tok_s,
    run_job,
    with_threads,
)
from bench.batch.report import plot, verdicts
from bench.serve.deploy import add_app_arguments, app_args, free_port, running_app
from bench.serve.loadgen import Target, run_load
from bench.serve.metrics import SLO, attainment, finite_or_none
from bench.serve.workloads import FixedWorkload, ScheduledRequest, make_prompt, schedule

JOB_TENANT = "bench-batch"


def job_model(configured: str | None, model: str | None) -> str | None:
    """The model the bench runs in place of the config's `configured` one: `model` when
    given; else `small` where the config serves the built-in `tiny` (module docstring);
    else None (the config's own)."""
    if model is not None:
        return model
    return "small" if configured == "tiny" else None


def plan_args(options: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The app's args (with the job's tenant and a fresh store) and who sends what."""
    args = app_args(options.config, None, options.dtype, free_port())
    model = job_model(args["model"].get("model"), options.model)
    if model is not None:
        args = app_args(args, model)
    classes = {c["name"]: c for c in (args.get("admission") or {}).get("classes", [])}
    if options.batch_class not in classes or options.interactive_class not in classes:
        raise SystemExit(
            f"the config needs classes {options.batch_class!r} and "
            f"{options.interactive_class!r} (admission.classes)"
        )
    interactive_tenant = next(
        (t for t in args.get("tenants", []) if t.get("default_class") == options.interactive_class),
        None,
    )
    if interactive_tenant is None or not interactive_tenant.get("api_keys"):
        raise SystemExit(
            f"no tenant with inline keys has default_class {options.interactive_class!r}"
        )
    job_key = f"sk-bench-batch-{secrets.token_hex(8)}"
    args["tenants"] = [
        *args["tenants"],
        {"name": JOB_TENANT, "api_keys": [job_key], "default_class": options.batch_class},
    ]
    args["admin_api_keys"] = [f"sk-bench-admin-{secrets.token_hex(8)}"]
    store = tempfile.mkdtemp(prefix="pdserve-bench-batch-")
    args["batch"] = {**(args.get("batch") or {}), "store_dir": store}
    slo = classes[options.interactive_class]
    who = {
        "job_key": job_key,
        "interactive_key": interactive_tenant["api_keys"][0],
        "interactive_tenant": interactive_tenant["name"],
        "slo": SLO(slo["ttft_s"] * 1000, slo["tpot_s"] * 1000),
    }
    return args, who


IDLE_TIMEOUT_S = 120.0
# Offsets from --seed of each job's lines (module docstring: none repeats another's)
IDLE_JOB_SEED = 100
LOADED_JOB_SEED = 200


def fresh_prompts(
    arrivals: Sequence[ScheduledRequest], workload: FixedWorkload, seed: int
) -> list[ScheduledRequest]:
    """`arrivals`' times with new contents drawn from `workload` at `seed`."""
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(a, spec=workload.sample(rng)) for a in arrivals]


def wait_idle(base_url: str, admin_key: str) -> None:
    """Until the ingress's batch pacing reads the service as idle (`batch.idle` of
    `/v1/pdserve/stats`: nothing more important for its quiet period), so the idle job
    starts with the window open, as on a service nobody else uses."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    headers = {"Authorization": f"Bearer {admin_key}"}
    while True:
        stats = httpx.get(f"{base_url}/v1/pdserve/stats", headers=headers, timeout=30).json()
        if stats.get("batch", {}).get("idle"):
            return
        if time.monotonic() > deadline:
            pacing = stats.get("batch")
            raise SystemExit(f"the service did not read as idle in {IDLE_TIMEOUT_S} s: {pacing}")
        time.sleep(0.25)


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def loaded_phase(
    base_url: str,
    who: dict[str, Any],
    shape: JobShape,
    model: str,
    target: Target,
    arrivals: list[Any],
    options: argparse.Namespace,
) -> tuple[JobRun, Any, tuple[float, float]]:
    """The job submitted, then the interactive arrivals beside it; (job, load, window)."""
    run = JobRun()
    lines = dataclasses.replace(shape, seed=shape.seed + LOADED_JOB_SEED)
    job = asyncio.create_task(run_job(base_url, who["job_key"], lines, model, run=run))
    while not run.batch_id:
        await asyncio.sleep(0.05)
    await asyncio.sleep(options.job_lead_s)  # the job under way before the load starts
    load_start = time.time() - run.submitted_at
    result = await run_load(target, arrivals, desc="interactive with the job")
    load_end = load_start + result.duration_s
    return await job, result, (load_start, load_end)


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (which model `--model` left out means: `job_model`)."""
    parser = argparse.ArgumentParser(
        prog="pdserve bench batch",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    add_app_arguments(parser, "cpu-tenants")
    parser.add_argument("--requests", type=int, default=256, help="lines of the job")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--interactive-prompt-tokens", type=int, default=128)
    parser.add_argument("--interactive-max-tokens", type=int, default=32)
    parser.add_argument("--load", type=float, default=0.5, help="interactive rate / capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of interactive load")
    parser.add_argument("--probe-s", type=float, default=8.0, help="seconds per capacity point")
    parser.add_argument("--job-lead-s", type=float, default=2.0, help="job start to load start")
    parser.add_argument(
        "--idle-runs", type=int, default=2, help="jobs run in turn on the idle service (best)"
    )
    parser.add_argument("--batch-class", default="batch")
    parser.add_argument("--interactive-class", default="interactive")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, required=True, help="write the result here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    for name in ("httpx", "httpx2", "openai"):  # no log line per poll
        logging.getLogger(name).setLevel(logging.WARNING)

    from app.config import load_config

    args, who = plan_args(options)
    config = load_config(args)
    shape = JobShape(options.requests, options.prompt_tokens, options.max_tokens, options.seed)
    decode = config.pools_by_role("decode")[0]
    runs: list[dict[str, Any]] = []

    def measure_offline(threads: int) -> None:
        print(f"offline: {shape.num_requests} requests, {threads} thread(s)", file=sys.stderr)
        runs.append(offline_tok_s(with_threads(config.engine_config(decode), threads), shape))
        print(f"offline: {runs[-1]['tok_s']:.1f} generated tok/s", file=sys.stderr)

    for threads in sorted({1, options.num_cpus}):
        measure_offline(threads)

    document: dict[str, Any] = {
        "config": options.config,
        "model": config.model.model,
        "num_cpus": options.num_cpus,
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        },
        "job": {
            "num_requests": shape.num_requests,
            "prompt_tokens": shape.prompt_tokens,
            "max_tokens": shape.max_tokens,
            "poll_s": POLL_S,
        },
        "load_average_before": _loadavg(),
    }
    interactive = FixedWorkload(options.interactive_prompt_tokens, options.interactive_max_tokens)
    with running_app(args, options.num_cpus, any_port=True) as app:
        model = app.model_name
        target = Target(app.base_url, model, api_key=who["interactive_key"])
        warm = schedule(interactive, 1.0, 1.0, seed=options.seed + 7, num_requests=2)
        asyncio.run(run_load(target, warm, concurrency=1, progress=False))
        idle_runs = []
        for index in range(max(options.idle_runs, 1)):
            wait_idle(app.base_url, args["admin_api_keys"][0])
            lines = dataclasses.replace(shape, seed=shape.seed + IDLE_JOB_SEED + index)
            run = asyncio.run(run_job(app.base_url, who["job_key"], lines, model))
            idle_runs.append(run)
            print(f"idle: job {run.tok_s(shape.max_tokens) or 0:.1f} tok/s", file=sys.stderr)
        best = max(idle_runs, key=lambda run: run.tok_s(shape.max_tokens) or 0.0)
        document["idle"] = {
            "job_tok_s": best.tok_s(shape.max_tokens),
            "job": best.to_dict(shape.max_tokens),
            "runs_tok_s": [run.tok_s(shape.max_tokens) for run in idle_runs],
        }

        rng = np.random.default_rng(options.seed + 11)
        probe_prompts = [make_prompt(options.interactive_prompt_tokens, rng) for _ in range(64)]
        capacity = asyncio.run(
            interactive_capacity(
                app.base_url,
                who["interactive_key"],
                model,
                probe_prompts,
                options.interactive_max_tokens,
                options.probe_s,
            )
        )
        rate = options.load * capacity.requests_per_s
        print(
            f"capacity {capacity.requests_per_s:.2f} req/s; interactive at {rate:.2f}",
            file=sys.stderr,
        )
        arrivals = schedule(interactive, rate, options.duration, seed=options.seed)
        alone = asyncio.run(run_load(target, arrivals, desc="interactive alone"))
        beside_arrivals = fresh_prompts(arrivals, interactive, options.seed + 13)
        loaded_job, beside, window = asyncio.run(
            loaded_phase(app.base_url, who, shape, model, target, beside_arrivals, options)
        )
        again_arrivals = fresh_prompts(arrivals, interactive, options.seed + 17)
        again = asyncio.run(run_load(target, again_arrivals, desc="interactive alone again"))
    measure_offline(options.num_cpus)
    document["offline"] = {**max(runs, key=lambda run: run["tok_s"]), "runs": runs}
    slo = who["slo"]
    document["loaded"] = {
        "capacity": capacity.to_dict(),
        "interactive_rate": rate,
        "interactive_tenant": who["interactive_tenant"],
        "slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms},
        "interactive_attainment_without": attainment(alone.records + again.records, slo),
        "interactive_attainment_with_job": attainment(beside.records, slo),
        "interactive_attainment_without_before": attainment(alone.records, slo),
        "interactive_attainment_without_after": attainment(again.records, slo),
        "load_window_s": list(window),
        "job": loaded_job.to_dict(shape.max_tokens),
        "records_without": [r.to_dict() for r in alone.records],
        "records_without_after": [r.to_dict() for r in again.records],
        "records_with_job": [r.to_dict() for r in beside.records],
    }
    document["load_average_after"] = _loadavg()
    document["verdicts"] = verdicts(document)
    document["figure"] = plot(document, beside.records, options.json.with_suffix(".png"))
    options.json.write_text(json.dumps(finite_or_none(document), indent=1))
    summary = {
        "offline_tok_s": document["offline"]["tok_s"],
        "job_tok_s": document["idle"]["job_tok_s"],
        "interactive_rate": rate,
        "interactive_attainment_without": document["loaded"]["interactive_attainment_without"],
        "interactive_attainment_with_job": document["loaded"]["interactive_attainment_with_job"],
        **document["verdicts"],
    }
    print(json.dumps(finite_or_none(summary)))
    return 0
