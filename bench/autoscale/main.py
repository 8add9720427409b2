"""`pdserve bench autoscale`: a load ramp that stresses each pool's own signal in turn, sized
from the capacity measured on this machine in the same run.

The config (`configs/<name>.yaml`, default `cpu-autoscale`) is first deployed with every pool
fixed at its minimum replicas, and closed-loop probes measure what that fleet takes of each
stressing request shape (`bench.serve.capacity`); the ramp's rates follow from it
(`bench.autoscale.plan`: the prefill peak at `--load` x the prefill shape's capacity, the
decode peak at the rate at which the decode pool, read at each probe point, runs
`--decode-overshoot` x its target of running sequences, at most `--load` x the decode shape's
capacity, the low phases at `--low-load` x the lower peak). `--rate R` skips the probes: an
absolute ramp, low at R and both peaks at `--peak` x R.

Then the config is deployed as written on a private Ray instance (`bench.serve.deploy`). Requests
arrive as a Poisson process whose rate and shape follow the ramp
(`bench.autoscale.load.stress_ramp`): `--low-s` at the low rate of the base requests
(`--prompt-tokens`, `--max-tokens`); then for each of `--stress` (default: prefill, then
decode) `--ramp-s` up to that role's peak, `--peak-s` there and `--ramp-s` down, with that
pool's stressing requests (prefill: `--long-prompt-tokens` prompts with `--short-output-tokens`
outputs, so the prefill queue grows; decode: `--short-prompt-tokens` prompts with
`--long-output-tokens` outputs, so running sequences and KV grow), each followed by `--low-s`
of base load. Every `--sample-s` the RUNNING replicas of each pool are read from Serve; after
the load the pools get `--settle-s` to scale back to their minimum.

The pools' policies log each scaling decision with the signal that drove it and its metric
values (`app.serve.autoscaling`); the bench reads them from the Serve controller's log, pairs each
replica change with its decision and gives a verdict per pool (`bench.autoscale.report`).
Every request that did not complete (HTTP error, error event, cut stream, timeout) counts as
`failed`: the goal is 0, as scaling (starting, draining, stopping replicas) must never fail a
request.

Prints the capacity and rates, the timeline, the replica changes with their signals and the
summary; writes JSON (`capacity` and `rates`, `max_replicas` and `final_replicas` per pool,
`failed`, `verdict`, the scaling decisions, the load average, the timeline, every request)
and a plot beside it (`.png`).

    pdserve bench autoscale --config cpu-autoscale --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.autoscale.load import Ramp, Record, Shape, arrival_times, request_body, send, stress_ramp
from bench.autoscale.plan import DECODE_OVERSHOOT, LOW_LOAD, PEAK_LOAD, fixed_rates
from bench.autoscale.probe import measure_rates
from bench.autoscale.report import (
    attribute,
    human,
    plot,
    replica_changes,
    scaling_events,
    timeline,
    verdict,
)
from bench.serve.deploy import RunningApp, add_app_arguments, app_args, free_port, running_app
from bench.serve.metrics import finite_or_none, percentile


def running_replicas(app_name: str, pools: Sequence[str]) -> dict[str, int]:
    """RUNNING replicas of each pool, as Serve reports them now."""
    from ray import serve

    status = serve.status().applications.get(app_name)
    counts = {pool: 0 for pool in pools}
    if status is None:
        return counts
    for name in pools:
        deployment = status.deployments.get(name)
        if deployment is not None:
            states = deployment.replica_states.items()
            counts[name] = sum(n for state, n in states if state == "RUNNING")
    return counts


def controller_log_lines() -> list[str]:
    """The lines of this Ray instance's Serve controller logs (where policies log)."""
    import ray._private.worker as worker

    node = worker._global_node
    if node is None:
        return []
    lines: list[str] = []
    for path in sorted(Path(node.get_logs_dir_path(), "serve").glob("controller_*.log")):
        lines += path.read_text(encoding="utf-8", errors="replace").splitlines()
    return lines


class Bench:
    """Runs the ramp against `app` while sampling each pool's replicas."""

    def __init__(
        self, app: RunningApp, app_name: str, pools: list[str], ramp: Ramp, args: argparse.Namespace
    ):
        self.app, self.app_name, self.pools, self.ramp, self.args = app, app_name, pools, ramp, args
        self.records: list[Record] = []
        self.samples: list[dict[str, Any]] = []
        self.start = 0.0  # monotonic
        self.wall_start = 0.0  # time.time(), the clock of the policies' decisions

    async def run(self) -> None:
        self.start, self.wall_start = time.monotonic(), time.time()
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        # `send` bounds each whole request by --request-timeout; no shorter per-read limit.
        timeout = httpx.Timeout(self.args.request_timeout)
        async with httpx.AsyncClient(
            base_url=self.app.base_url, limits=limits, timeout=timeout
        ) as client:
            sampler = asyncio.create_task(self._sample_until(None))
            tasks = []
            for index, at in enumerate(arrival_times(self.ramp, self.args.seed)):
                await asyncio.sleep(max(0.0, self.start + at - time.monotonic()))
                found = self.ramp.phase_at(at)
                assert found is not None  # arrivals lie inside the ramp
                phase = found[0]
                shape = phase.shape
                record = Record(
                    time.monotonic() - self.start, phase.name, shape.prompt_tokens, shape.max_tokens
                )
                self.records.append(record)
                body = request_body(self.app.model_name, shape, index)
                timeout_s = self.args.request_timeout
                tasks.append(asyncio.create_task(send(client, body, record, self.start, timeout_s)))
            await asyncio.gather(*tasks)
            if sampler.done():
                sampler.result()  # the sampler failed: raise its error
            sampler.cancel()
            await self._sample_until(self._settled)

    def _settled(self, counts: dict[str, int]) -> bool:
        return all(counts[pool] <= self.args.min_replicas[pool] for pool in self.pools)

    async def _sample_until(self, done: Any) -> None:
        """Sample every `--sample-s`; with `done`, stop once `done(counts)` or `--settle-s`."""
        deadline = time.monotonic() + self.args.settle_s
        while True:
            counts = await asyncio.to_thread(running_replicas, self.app_name, self.pools)
            now = time.monotonic() - self.start
            self.samples.append(
                {"t_s": now, "rate": self.ramp.rate_at(now), "load1": os.getloadavg()[0], **counts}
            )
            if done is not None and (done(counts) or time.monotonic() > deadline):
                return
            await asyncio.sleep(self.args.sample_s)


def failure_kind(error: str | None) -> str:
    """`shed` (503 overloaded: admission control), `http` (another status), `timeout`, or
    `stream` (an error event, a cut stream)."""
    error = error or ""
    if error.startswith("HTTP 503") and "overloaded" in error:
        return "shed"
    if error.startswith("HTTP"):
        return "http"
    return "timeout" if "Timeout" in error else "stream"


def summarize(
    bench: Bench, roles: Mapping[str, str], events: list[dict[str, Any]]
) -> dict[str, Any]:
    """`max_replicas` / `final_replicas` per pool, `failed`, the replica changes with their
    signals, the verdict, the latency overall and the machine's load."""
    final = bench.samples[-1] if bench.samples else {}
    failed = [r for r in bench.records if not r.ok]
    ok = [r for r in bench.records if r.ok]
    pools = bench.pools
    max_replicas = {p: max((s[p] for s in bench.samples), default=0) for p in pools}
    final_replicas = {p: final.get(p, 0) for p in pools}
    scaled = attribute(replica_changes(bench.samples, pools), events, bench.ramp)
    loads = [s["load1"] for s in bench.samples]
    return {
        "requests": len(bench.records),
        "failed": len(failed),
        "failures": sorted({r.error or "?" for r in failed})[:20],
        "failed_by_kind": dict(Counter(failure_kind(r.error) for r in failed)),
        "max_replicas": max_replicas,
        "final_replicas": final_replicas,
        "min_replicas": bench.args.min_replicas,
        "verdict": verdict(
            scaled, roles, bench.args.min_replicas, final_replicas, bench.ramp, events
        ),
        "replica_changes": scaled,
        "ttft_p90_ms": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 90) * 1000,
        "tpot_p90_ms": percentile([r.tpot_s for r in ok if r.tpot_s is not None], 90) * 1000,
        "load_average": {
            "cpus": os.cpu_count(),
            "mean": sum(loads) / len(loads) if loads else None,
            "max": max(loads, default=None),
        },
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pdserve bench autoscale",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    add_app_arguments(parser, "cpu-autoscale")
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="a fixed low load, requests/s: no capacity probe, both peaks --peak x it",
    )
    parser.add_argument("--peak", type=float, default=4.0, help="with --rate: peak = rate x this")
    parser.add_argument(
        "--load",
        type=float,
        default=PEAK_LOAD,
        help="each peak at most this x its shape's measured capacity (prefill: exactly)",
    )
    parser.add_argument(
        "--decode-overshoot",
        type=float,
        default=DECODE_OVERSHOOT,
        help="decode peak: where the minimum pool runs this x its target_running_seqs",
    )
    parser.add_argument(
        "--low-load", type=float, default=LOW_LOAD, help="low rate = this x the lower peak"
    )
    parser.add_argument("--probe-s", type=float, default=6.0, help="seconds per probe point")
    parser.add_argument("--low-s", type=float, default=30.0, help="seconds of each low phase")
    parser.add_argument("--ramp-s", type=float, default=10.0, help="seconds of each ramp")
    parser.add_argument("--peak-s", type=float, default=80.0, help="seconds of each peak")
    parser.add_argument(
        "--stress",
        default="prefill,decode",
        help="pool roles to stress, in order (comma-separated: prefill, decode)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=256, help="base requests")
    parser.add_argument("--max-tokens", type=int, default=16, help="base requests")
    parser.add_argument("--long-prompt-tokens", type=int, default=4000, help="prefill stress")
    parser.add_argument("--short-output-tokens", type=int, default=4, help="prefill stress")
    parser.add_argument("--short-prompt-tokens", type=int, default=48, help="decode stress")
    parser.add_argument("--long-output-tokens", type=int, default=128, help="decode stress")
    parser.add_argument("--sample-s", type=float, default=1.0, help="replica sampling period")
    parser.add_argument("--settle-s", type=float, default=90.0, help="wait for scale-down")
    parser.add_argument("--window-s", type=float, default=10.0, help="timeline window")
    parser.add_argument("--request-timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, required=True, help="write the result here")
    args = parser.parse_args(argv)
    roles = [r.strip() for r in args.stress.split(",") if r.strip()]
    if not set(roles) <= {"prefill", "decode"}:
        parser.error(f"--stress: roles are prefill and decode, got {args.stress!r}")
    args.stress_roles = roles
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

    from app.config import load_config

    config_args = app_args(args.config, args.model, args.dtype, free_port())
    config = load_config(config_args)
    pools = [pool.name for pool in config.pools]
    roles = {pool.name: pool.role for pool in config.pools}
    args.min_replicas = {
        pool.name: pool.autoscaling.min_replicas if pool.autoscaling else pool.num_replicas
        for pool in config.pools
    }
    stressing = {
        "prefill": Shape(args.long_prompt_tokens, args.short_output_tokens),
        "decode": Shape(args.short_prompt_tokens, args.long_output_tokens),
    }
    stressing = {role: stressing[role] for role in args.stress_roles}
    if args.rate is not None:
        rates = fixed_rates(args.rate, args.peak, args.stress_roles)
        capacity: dict[str, Any] = {"method": "not measured: a fixed ramp (--rate, --peak)"}
    else:
        rates, capacity = measure_rates(config_args, stressing, args)
    print(
        f"rates: low {rates.low:.2f} req/s, peaks "
        + ", ".join(f"{role} {rate:.2f}" for role, rate in rates.peaks.items()),
        file=sys.stderr,
    )
    base = Shape(args.prompt_tokens, args.max_tokens)
    ramp = stress_ramp(
        rates.low, rates.peaks, args.low_s, args.ramp_s, args.peak_s, base, stressing
    )
    load_before = os.getloadavg()
    with running_app(config_args, args.num_cpus) as app:
        bench = Bench(app, config.app_name, pools, ramp, args)
        asyncio.run(bench.run())
        events = scaling_events(controller_log_lines(), config.app_name, bench.wall_start)
    rows = timeline(ramp, bench.records, bench.samples, pools, args.window_s)
    summary = {"config": args.config, "model": app.model_name, **summarize(bench, roles, events)}
    summary["capacity"] = capacity
    summary["rates"] = {
        "low": rates.low,
        "peaks": rates.peaks,
        "load": None if args.rate is not None else args.load,
        "decode_overshoot": None if args.rate is not None else args.decode_overshoot,
        "low_load": None if args.rate is not None else args.low_load,
    }
    summary["load_average"]["before"] = load_before[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    summary["plot"] = plot(
        ramp, bench.samples, summary["replica_changes"], rows, pools, args.json.with_suffix(".png")
    )
    document = {
        **summary,
        "ramp": [asdict(p) for p in ramp.phases],
        "scaling_decisions": events,
        "timeline": rows,
        "samples": bench.samples,
        "records": [asdict(r) for r in bench.records],
    }
    args.json.write_text(json.dumps(finite_or_none(document), indent=1) + "\n")
    print(human(summary, rows, pools), file=sys.stderr)
    brief = {k: v for k, v in summary.items() if k != "replica_changes"}
    print(json.dumps(finite_or_none(brief)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
