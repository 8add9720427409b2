"""`pdserve bench goodput`: the highest request rate a server sustains within its SLOs.

Goodput as DistServe defines it: the largest arrival rate (requests/s) at which at least
`--target` (default 90%) of requests meet both the TTFT and the TPOT SLO. The sweep runs one
`bench serve`-style run per rate point and estimates the crossing by linear interpolation
between the last rate that met the target and the first one that did not (first crossing,
scanning upwards; an idle server is assumed to meet it at rate 0). Without a failing point
the goodput is only a lower bound (`bracketed: false`).

Rates: `--rates 0.5,1,2` runs exactly those (stopping early once attainment drops below
`--stop-below`), or `--rate-start R --max-points N` doubles from R until a point fails and then
bisects the bracket until it is `--tolerance` (relative) wide (`bench/goodput/knee.py`).
Normalization: `goodput_per_unit` = goodput / `--num-units` of `--unit` (DistServe reports
per GPU; on CPU we use cores, e.g. 2 for a `num_cpus=2` Ray instance).

    pdserve bench goodput --url http://127.0.0.1:8000 --workload mixed --rates 0.5,1,2,4 \
        --duration 60 --slo-ttft 2000 --slo-tpot 100 --num-units 2 --unit cores --json g.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.goodput.knee import DEFAULT_TARGET, GoodputEstimate, find_knee, interpolate_goodput
from bench.serve.loadgen import Target, add_target_args, run_load_sync, run_report, target_from_args
from bench.serve.metrics import SLO, finite_or_none
from bench.serve.workloads import ScheduledRequest, add_workload_args, describe_workload
from bench.serve.workloads import requests_from_args as _requests_from_args

__all__ = ["DEFAULT_TARGET", "GoodputEstimate", "interpolate_goodput", "next_rate", "sweep"]

PointRunner = Callable[[float], dict[str, Any]]  # rate -> run report (with "summary")


def next_rate(
    points: Sequence[tuple[float, float]], rate_start: float, target: float = DEFAULT_TARGET
) -> float:
    """One step of an adaptive sweep driven from outside: `rate_start` first, then double
    until a point fails, then bisect the bracket (`find_knee` runs the whole search)."""
    if not points:
        return rate_start
    estimate = interpolate_goodput(points, target)
    if estimate.high_rate is None:
        return max(rate for rate, _ in points) * 2
    return (estimate.low_rate + estimate.high_rate) / 2


def sweep(
    run_point: PointRunner,
    rates: Sequence[float] | None = None,
    rate_start: float = 1.0,
    max_points: int = 4,
    target: float = DEFAULT_TARGET,
    stop_below: float = 0.0,
    tolerance: float = 0.0,
) -> list[dict[str, Any]]:
    """Run rate points; each result is `run_point(rate)` plus `rate` and `attainment`.

    With `rates`: those, ascending, stopping after a point whose attainment < `stop_below`.
    Without: the knee search of `bench/goodput/knee.py` from `rate_start` (double until a point
    fails, then bisect), at most `max_points` points, until the bracket is `tolerance` wide.
    """
    results: list[dict[str, Any]] = []

    def attainment_at(rate: float) -> float:
        report = run_point(rate)
        value = float(report["summary"]["slo"]["attainment"] or 0.0)
        results.append({"rate": rate, "attainment": value, **report})
        print(json.dumps({"rate": rate, "attainment": value}), file=sys.stderr)
        return value

    if not rates:
        find_knee(attainment_at, rate_start, target, tolerance, max_points)
        return results
    for rate in sorted(rates):
        if attainment_at(rate) < stop_below:
            break
    return results


def goodput_report(
    results: Sequence[dict[str, Any]],
    target: float,
    num_units: float | None = None,
    unit: str | None = None,
) -> dict[str, Any]:
    """Interpolated goodput of a sweep, with the per-unit normalization if asked."""
    estimate = interpolate_goodput([(r["rate"], r["attainment"]) for r in results], target)
    out: dict[str, Any] = {"target": target, **asdict(estimate)}
    if num_units:
        out.update(num_units=num_units, unit=unit, goodput_per_unit=estimate.goodput / num_units)
    return out


def point_runner(
    target: Target,
    make_requests: Callable[[float], list[ScheduledRequest]],
    slo: SLO,
    concurrency: int | None = None,
    warmup: int = 1,
    progress: bool = True,
    label: str = "",
) -> PointRunner:
    """A `PointRunner` that sends `make_requests(rate)` to `target` and reports the run."""

    def run(rate: float) -> dict[str, Any]:
        requests = make_requests(rate)
        desc = f"{label} rate {rate:g}".strip()
        result = run_load_sync(target, requests, concurrency, warmup, progress, desc)
        return run_report(result, slo, target)

    return run


def parse_rates(text: str | None) -> list[float] | None:
    """`"0.5,1,2"` -> [0.5, 1.0, 2.0]; None stays None."""
    return None if not text else [float(x) for x in text.split(",") if x.strip()]


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """Rate-sweep options shared by `bench goodput` and `bench compare`."""
    parser.add_argument("--rates", default=None, help="comma-separated rates (requests/s)")
    parser.add_argument("--rate-start", type=float, default=1.0, help="adaptive: first rate")
    parser.add_argument("--max-points", type=int, default=4, help="adaptive: rate points")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.1,
        help="adaptive: stop bisecting at this bracket width relative to its upper rate",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per rate point")
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET, help="attainment goal")
    parser.add_argument(
        "--stop-below", type=float, default=0.0, help="--rates: stop after attainment below this"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench goodput", description=__doc__)
    add_target_args(parser)
    add_sweep_args(parser)
    parser.add_argument("--num-units", type=float, default=None, help="normalize goodput by")
    parser.add_argument("--unit", default="cores", help="what --num-units counts")
    parser.add_argument("--json", type=Path, default=None, help="write everything here")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    if args.workload == "trace":
        parser.error("goodput sweeps a rate; use --workload fixed or mixed")

    target = target_from_args(args)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    runner = point_runner(
        target,
        lambda rate: _requests_from_args(args, rate, args.duration),
        slo,
        args.concurrency,
        args.warmup,
        not args.no_progress,
    )
    results = sweep(
        runner,
        parse_rates(args.rates),
        args.rate_start,
        args.max_points,
        args.target,
        args.stop_below,
        args.tolerance,
    )
    goodput = goodput_report(results, args.target, args.num_units, args.unit)
    run = {"url": target.base_url, "model": target.model, "duration_s": args.duration}
    document = {"run": {**run, **describe_workload(args)}, "goodput": goodput, "points": results}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(finite_or_none(document), indent=1) + "\n")
    rates = [
        {
            "rate": r["rate"],
            "attainment": r["attainment"],
            "usd_per_1m_tokens": r.get("server", {}).get("cost", {}).get("usd_per_1m_tokens"),
        }
        for r in results
    ]
    print(json.dumps(finite_or_none({**goodput, "points": rates})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
