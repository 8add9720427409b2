"""`pdserve bench overload`: two tenants' classes at 3x the fleet's goodput, admission on vs off.

The config (`configs/<name>.yaml`, default `cpu-tenants`) names SLO classes and tenants; each
class of `--classes` (default `interactive,batch`) is sent by the first tenant whose
`default_class` it is (in `cpu-tenants`: acme and globex), with that tenant's API key.
Requests are streamed greedy completions of random prompts (`--<class>-prompt-tokens`,
`--<class>-max-tokens`, `ignore_eos`), each asking for a server deadline of
`--request-timeout` s (header `x-pdserve-timeout`), Poisson arrivals per class.

1. **Admission off**: the same config with every admission feature disabled
   (`bench.overload_plan.admission_off`: no tenant limits or queues, no load shedding, one
   priority for every class, Serve queues per pool unbounded) is deployed on a private Ray
   instance.
2. **Calibration** (unless `--goodput` is given): the fleet's goodput, as DistServe defines
   it (the highest rate at which >= 90% of requests meet their class's SLO), is measured on
   that app with the same class mix: `--calibrate-s` seconds per rate point, doubling from
   `--calibrate-start` until a point fails, then bisecting, `--calibrate-points` points in all,
   interpolated (`bench.goodput.interpolate_goodput`).
3. The overload, `--overload` (3) x that goodput for `--duration` s, split between the classes
   by `--interactive-share`, is offered to the admission-off app, then the same arrivals to
   the config as written (**admission on**: quotas, queues, shedding, priorities), redeployed
   on a fresh Ray instance.

`--modes no-quotas` runs a third variant, `admission_no_quotas`: the config without tenant
limits (`bench.overload_plan.without_quotas`) but with shedding and priorities, to see what
they do alone.

A request that has no end `--hung-grace` s after its deadline is `hung` (the goal is 0 in
both modes). Per mode and class: SLO attainment and goodput (`bench.overload_report`), shed
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

import aiohttp
import numpy as np
from tqdm import tqdm

from bench.goodput import interpolate_goodput, next_rate
from bench.metrics import finite_or_none
from bench.overload_plan import (
    Arrival,
    ClassPlan,
    admission_off,
    arrivals,
    class_plans,
    class_rates,
    without_quotas,
)
from bench.overload_report import (
    Record,
    classify,
    human_table,
    joint_attainment,
    mode_report,
    plot,
)
from bench.serve_app import RunningApp, add_app_arguments, app_args, free_port, running_app
from bench.server_report import fetch_stats
from bench.workloads import make_prompt

TARGET_ATTAINMENT = 0.9
MODES = ("on", "off", "no-quotas")


# ------------------------------------------------------------------------------- the load


def client_session() -> aiohttp.ClientSession:
    """The load generator's HTTP client (aiohttp, which ray[serve] brings: about a quarter
    of httpx's CPU per streamed request): no connection limit, 30 s to connect, no other
    timeout (each request has its own, `send`'s `hung_after_s`)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
    )


async def send(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    plan: ClassPlan,
    prompt: str,
    record: Record,
    request_timeout_s: float,
    hung_after_s: float,
    t0: float,
) -> None:
    """Stream one completion from `url` (the server's `/v1/completions`) into `record`
    (outcome, status, code, Retry-After, latencies).

    The stream is read as raw bytes and scanned, not parsed: at 3x overload this client
    shares the host's cores with the server, so it must cost little per event. TTFT is
    taken when the bytes holding the first non-empty `text` arrive; only the usage chunk
    and error events are decoded as JSON (`SSEScanner`).
    """
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": plan.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {
        "Authorization": f"Bearer {plan.api_key}",
        "x-pdserve-timeout": f"{request_timeout_s:g}",
    }
    sent = time.monotonic()
    scanner = SSEScanner()
    try:
        async with asyncio.timeout(hung_after_s):
            async with session.post(url, json=body, headers=headers) as response:
                record.status = response.status
                if response.status != 200:
                    raw = await response.read()
                    record.outcome = classify(response.status, streamed_tokens=False)
                    record.retry_after = response.headers.get("retry-after")
                    record.code, record.error = _error_fields(raw)
                    return
                async for chunk in response.content.iter_any():
                    if scanner.feed(chunk, time.monotonic()):
                        break
                record.code, record.error = scanner.code, scanner.error
                if scanner.done:
                    record.outcome = "ok" if record.error is None else "error"
                else:
                    record.outcome, record.error = "error", "stream ended without [DONE]"
    except (aiohttp.ClientError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        # (before TimeoutError: aiohttp's connect timeout is both, and is not a hang)
        record.outcome, record.error = "error", repr(exc)[:200]
    except TimeoutError:
        record.outcome, record.error = "hung", f"no end within {hung_after_s:g} s"
    finally:
        record.end_s = time.monotonic() - t0
        record.num_tokens = scanner.num_tokens
        if scanner.first_at is not None:
            record.ttft_s = scanner.first_at - sent
            if scanner.last_at is not None and record.num_tokens > 1:
                record.tpot_s = (scanner.last_at - scanner.first_at) / (record.num_tokens - 1)


class SSEScanner:
    """Reads a completions event stream from raw bytes with as little work as possible.

    Events are split on the blank line that ends them. An event with a non-empty `text`
    is content: `"text":"` followed by anything but `"` (a quote inside a JSON string is
    always escaped, so these bytes only ever match the key). Only events holding an
    `"error"` key or a `"usage":{` object are decoded. `feed` returns True at `[DONE]`.
    """

    __slots__ = ("_pending", "code", "done", "error", "first_at", "last_at", "num_tokens")

    def __init__(self) -> None:
        self._pending = b""
        self.first_at: float | None = None  # arrival of the first content bytes
        self.last_at: float | None = None  # arrival of the last content bytes
        self.num_tokens = 0  # the usage chunk's completion_tokens
        self.code: str | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, chunk: bytes, now: float) -> bool:
        """Scan `chunk`, which arrived at `now`; True once `data: [DONE]` was seen."""
        *events, self._pending = (self._pending + chunk).split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            if event == b"data: [DONE]":
                self.done = True
                return True
            at = event.find(b'"text":"')
            if at >= 0 and event[at + 8 : at + 9] != b'"':
                self.last_at = now
                if self.first_at is None:
                    self.first_at = now
            if b'"error"' in event:
                error = json.loads(event[6:]).get("error") or {}
                self.code = error.get("code")
                self.error = str(error.get("message"))[:200]
            elif b'"usage":{' in event:
                usage = json.loads(event[6:])["usage"]
                self.num_tokens = int(usage.get("completion_tokens") or 0)
        return False


def _error_fields(raw: bytes) -> tuple[str | None, str]:
    try:
        error = json.loads(raw)["error"]
        return error.get("code"), str(error.get("message"))[:200]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, raw[:200].decode(errors="replace")


async def run_phase(
    app: RunningApp,
    plans: Sequence[ClassPlan],
    plan_arrivals: Sequence[Arrival],
    options: argparse.Namespace,
    desc: str,
    progress: bool = True,
) -> list[Record]:
    """Send every arrival at its time; return once each has ended (or hung)."""
    by_name = {p.name: p for p in plans}
    records: list[Record] = []
    bar = tqdm(
        total=len(plan_arrivals),
        desc=desc,
        file=sys.stderr,
        disable=options.no_progress or not progress,
    )
    url = f"{app.base_url}/v1/completions"
    async with client_session() as session:
        t0 = time.monotonic()

        async def one(arrival: Arrival, record: Record) -> None:
            plan = by_name[arrival.slo_class]
            await send(
                session,
                url,
                app.model_name,
                plan,
                arrival.prompt,
                record,
                options.request_timeout,
                options.hung_after_s,
                t0,
            )
            bar.update(1)
            if bar.n % 20 == 0:
                bar.set_postfix(_outcome_counts(records))

        tasks = []
        for i, arrival in enumerate(plan_arrivals):
            await asyncio.sleep(max(0.0, arrival.at_s - (time.monotonic() - t0)))
            record = Record(i, arrival.slo_class, time.monotonic() - t0)
            records.append(record)
            tasks.append(asyncio.create_task(one(arrival, record)))
        await asyncio.gather(*tasks)
    bar.close()
    return records


def _outcome_counts(records: Sequence[Record]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if r.end_s is not None:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return counts


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
