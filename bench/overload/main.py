"""`pdserve bench overload`: two tenants' classes at 3x the fleet's goodput, admission on vs off.

The config (`configs/<name>.yaml`, default `cpu-tenants`) names SLO classes and tenants; each
class of `--classes` (default `interactive,batch`) is sent by the first tenant whose
`default_class` it is (in `cpu-tenants`: acme and globex), with that tenant's API key.
Requests are streamed greedy completions of random prompts (`--<class>-prompt-tokens`,
`--<class>-max-tokens`, `ignore_eos`), each asking for a server deadline of
`--request-timeout` s (header `x-pdserve-timeout`), Poisson arrivals per class.

1. **Admission off**: the same config with every admission feature disabled
   (`bench.overload.plan.admission_off`: no tenant limits or queues, no load shedding, one
   priority for every class, Serve queues per pool unbounded) is deployed on a private Ray
   instance.
2. **Calibration** (unless `--goodput` is given): the fleet's goodput, as DistServe defines
   it (the highest rate at which >= 90% of requests meet their class's SLO), is measured on
   that app with the same class mix: `--calibrate-s` seconds per rate point, doubling from
   `--calibrate-start` until a point fails, then bisecting, `--calibrate-points` points in all,
   interpolated (`bench.goodput.sweep.interpolate_goodput`).
3. The overload, `--overload` (3) x that goodput for `--duration` s, split between the classes
   by `--interactive-share`, is offered to the admission-off app, then the same arrivals to
   the config as written (**admission on**: quotas, queues, shedding, priorities), redeployed
   on a fresh Ray instance.

`--modes no-quotas` runs a third variant, `admission_no_quotas`: the config without tenant
limits (`bench.overload.plan.without_quotas`) but with shedding and priorities, to see what
they do alone.

A request that has no end `--hung-grace` s after its deadline is `hung` (the goal is 0 in
both modes). Per mode and class: SLO attainment and goodput (`bench.overload.report`), shed
counts by `"<status> <code>"`, and whether each shed response carried a Retry-After.

    pdserve bench overload --config cpu-tenants --json out.json

writes the JSON (`admission_on` / `admission_off`, `calibration`, rates, SLOs, load
average, host, every request) and `out.png` beside it; the last stdout line is the summary
(no per-request records) as one JSON object. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.goodput.sweep import interpolate_goodput, next_rate
from bench.overload.load import run_phase
from bench.overload.plan import (
    Arrival,
    ClassPlan,
    admission_off,
    arrivals,
    class_plans,
    class_rates,
    without_quotas,
)
from bench.overload.report import (
    Record,
    human_table,
    joint_attainment,
    mode_report,
    plot,
)
from bench.serve.deploy import RunningApp, add_app_arguments, app_args, free_port, running_app
from bench.serve.metrics import finite_or_none
from bench.serve.server_report import fetch_stats
from bench.serve.workloads import make_prompt

TARGET_ATTAINMENT = 0.9
MODES = ("on", "off", "no-quotas")


def warm_up(app: RunningApp, plans: Sequence[ClassPlan], options: argparse.Namespace) -> None:
    """Two requests per class, one at a time (loads the engines, measures prefill rates)."""
    warm = [
        Arrival(0.0, p.name, make_prompt(p.prompt_tokens, np.random.default_rng(i)))
        for i, p in enumerate(plans)
        for _ in range(2)
    ]
    for arrival in warm:
        asyncio.run(run_phase(app, plans, [arrival], options, "warm-up", progress=False))


def calibrate(
    app: RunningApp, plans: Sequence[ClassPlan], options: argparse.Namespace
) -> dict[str, Any]:
    """The fleet's goodput with the overload's class mix (module docstring, step 2)."""
    slos = {p.name: p.slo for p in plans}
    points: list[tuple[float, float]] = []
    for k in range(options.calibrate_points):
        rate = next_rate(points, options.calibrate_start, TARGET_ATTAINMENT)
        rates = class_rates(plans, rate, options.interactive_share)
        plan = arrivals(plans, rates, options.calibrate_s, options.seed + 100 + k)
        records = asyncio.run(run_phase(app, plans, plan, options, f"calibrate {rate:.2f}/s"))
        points.append((rate, joint_attainment(records, slos)))
        tqdm.write(
            f"calibration: {rate:.2f} req/s -> attainment {points[-1][1]:.1%}", file=sys.stderr
        )
    estimate = interpolate_goodput(points, TARGET_ATTAINMENT)
    return {
        "method": f"rate sweep with admission off, {options.calibrate_s:g} s per point, "
        f"goodput = highest rate with >= {TARGET_ATTAINMENT:.0%} joint SLO attainment "
        "(interpolated)",
        "points": [{"rate": r, "attainment": a} for r, a in sorted(points)],
        **asdict(estimate),
    }


# ---------------------------------------------------------------------------- command line


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_mode(
    mode_args: dict[str, Any],
    plans: Sequence[ClassPlan],
    options: argparse.Namespace,
    mode: str,
    calibration: dict[str, Any] | None,
) -> tuple[list[Record], dict[str, Any] | None, dict[str, Any]]:
    """Deploy `mode_args`, calibrate if asked (`calibration` None and no `--goodput`), run
    the overload; (records, calibration, machine state around the phase)."""
    with running_app(mode_args, options.num_cpus) as app:
        warm_up(app, plans, options)
        if calibration is None:
            calibration = (
                {"method": "given (--goodput)", "goodput": options.goodput}
                if options.goodput
                else calibrate(app, plans, options)
            )
        goodput = float(calibration["goodput"])
        if goodput <= 0:
            raise SystemExit(f"calibration found no rate meeting the SLOs: {calibration}")
        rates = class_rates(plans, options.overload * goodput, options.interactive_share)
        plan = arrivals(plans, rates, options.duration, options.seed)
        before, started_at = _loadavg(), time.time()
        records = asyncio.run(run_phase(app, plans, plan, options, mode))
        machine: dict[str, Any] = {"load_average_before": before, "load_average_after": _loadavg()}
        admin_key = next(iter(mode_args.get("admin_api_keys") or []), None)
        stats = fetch_stats(app.base_url, admin_key, started_at)
        machine["server_ttft_breakdown"] = stats.get("ttft_breakdown") or stats.get("error")
    return records, calibration, machine


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve bench overload",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    add_app_arguments(parser, "cpu-tenants")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of overload")
    parser.add_argument("--overload", type=float, default=3.0, help="offered = this x goodput")
    parser.add_argument("--goodput", type=float, default=None, help="skip calibration: req/s")
    parser.add_argument("--calibrate-s", type=float, default=10.0, help="seconds per point")
    parser.add_argument("--calibrate-start", type=float, default=1.0, help="first rate, req/s")
    parser.add_argument("--calibrate-points", type=int, default=5)
    parser.add_argument("--classes", default="interactive,batch", help="comma list, first one")
    parser.add_argument(
        "--interactive-share", type=float, default=0.2, help="the first class's share of load"
    )
    parser.add_argument("--interactive-prompt-tokens", type=int, default=128)
    parser.add_argument("--interactive-max-tokens", type=int, default=32)
    parser.add_argument("--batch-prompt-tokens", type=int, default=1000)
    parser.add_argument("--batch-max-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="other classes")
    parser.add_argument("--max-tokens", type=int, default=64, help="other classes")
    parser.add_argument("--request-timeout", type=float, default=30.0, help="server deadline")
    parser.add_argument("--hung-grace", type=float, default=30.0, help="past the deadline: hung")
    parser.add_argument(
        "--modes", default="off,on", help="comma list of off, on, no-quotas (run in order)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", type=Path, required=True, help="write the result here")
    options = parser.parse_args(argv)
    options.classes = [c.strip() for c in options.classes.split(",") if c.strip()]
    options.modes = [m.strip() for m in options.modes.split(",") if m.strip()]
    if not options.modes or set(options.modes) - set(MODES):
        parser.error(f"--modes: a comma list of {', '.join(MODES)}")
    if not 0 < options.interactive_share < 1 and len(options.classes) > 1:
        parser.error("--interactive-share must be in (0, 1)")
    options.hung_after_s = options.request_timeout + options.hung_grace

    on_args = app_args(options.config, options.model, options.dtype, free_port())
    # The server's TTFT breakdown after each phase needs an admin key (this run's own).
    on_args["admin_api_keys"] = [f"sk-bench-admin-{secrets.token_hex(8)}"]
    off_args, off_changes = admission_off(on_args)
    no_quota_args, _ = without_quotas(on_args)
    plans = class_plans(on_args, options)
    slos = {p.name: p.slo for p in plans}
    document: dict[str, Any] = {
        "config": options.config,
        "duration_s": options.duration,
        "overload": options.overload,
        "classes": {p.name: {**asdict(p), "api_key": "(from config)"} for p in plans},
        "admission_off_changes": off_changes,
        "request_timeout_s": options.request_timeout,
        "hung_after_s": options.hung_after_s,
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "ray_cpus": options.num_cpus,
        },
        "machine": {},
    }
    calibration: dict[str, Any] | None = None
    records: dict[str, list[Record]] = {}
    for mode in options.modes:
        name = f"admission_{mode.replace('-', '_')}"
        mode_args = {"on": on_args, "off": off_args, "no-quotas": no_quota_args}[mode]
        records[name], calibration, document["machine"][name] = run_mode(
            mode_args, plans, options, name, calibration
        )
        document[name] = mode_report(records[name], slos, options.duration)
    assert calibration is not None
    document["calibration"] = calibration
    document["goodput"] = calibration["goodput"]
    document["offered_rate"] = options.overload * float(calibration["goodput"])
    document["rates"] = class_rates(plans, document["offered_rate"], options.interactive_share)
    options.json.parent.mkdir(parents=True, exist_ok=True)
    document["plot"] = plot(document, options.classes, options.json.with_suffix(".png"))
    full = {**document, "records": {k: [asdict(r) for r in v] for k, v in records.items()}}
    options.json.write_text(json.dumps(finite_or_none(full), indent=1) + "\n")
    print(human_table(document, options.classes), file=sys.stderr)
    print(json.dumps(finite_or_none(document)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
