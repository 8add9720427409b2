"""`pdserve bench compare`: goodput of several configs on this machine, with intervals.

Configs (`--configs a,b,c`, any number >= 2; the last is the baseline) are compared seed by
seed. At each of `--seeds` seeds every config runs a knee search (`bench/goodput/knee.py`): from
`--rate-start` (later seeds start at 0.75x the config's mean goodput so far), doubling
until attainment < `--target`, then bisecting to `--tolerance`, at most `--max-points`
points, each exactly `--requests-per-point` requests (default 100) with a Wilson interval
on its attainment. The configs take turns point by point: the first point of every config,
then the second of every config still searching, and so on; each point is measured on a
fresh deployment of its config on a private Ray instance (`--num-cpus`, default 2; model
`--model`, default the built-in `small`; `--dtype`). So configs are compared minutes
apart, not an hour apart, on a host whose speed drifts (`bench/compare/run.py`).

Each run records the host's load average and each workload class's isolated TTFT/TPOT
(requests one at a time, median of `--isolated-repeats`) before its first point and after
its last: a run whose isolated figures moved by more than `--drift-threshold` (relative) is
marked `noisy` (`--exclude-noisy` leaves noisy runs out of the aggregates while a quiet one
remains).

Seeds fix the requests (contents and arrival pattern): at one seed every config and every
rate sees the same requests. `--replica-cores 0-3` pins the configs' pools to those cores
(`cpu_affinity`, split among pools by replica count) and this process, with the Ray
processes it starts (proxy, ingress, controller), to the host's other cores.

SLOs: `--slo-ttft/--slo-tpot` (ms), or derived from the baseline's first isolated requests:
shared (fixed, mixed, chat, long-context): TTFT = `--k-ttft` x the slowest class's isolated
TTFT, TPOT = `--k-tpot` x the fastest class's TPOT. Per class (multi-tenant): each class
`--k-ttft`/`--k-tpot` x its own isolated figures, the batch class `--batch-slo-factor` x
looser; a point's attainment is then the lowest class's.

The JSON holds per config the mean goodput with spread and interval, `ratio` (first config /
baseline) with `ratio_ci` (low, high) and, paired by seed, `ratio_ci_paired`, `ratios` of
every config to the baseline (with `per_seed_ratio`), every run
(host state, drift, points with records). PNGs beside it (or in `--plots-dir`): attainment vs
rate with bands, goodput per config, TTFT/TPOT/ITL CDFs; `--replot` redraws them.

    pdserve bench compare --configs cpu-disagg,cpu-colocated --workload mixed --seeds 3 \
        --short-input-len 64 --short-output-len 32 --long-input-min 512 \
        --long-input-max 1024 --long-output-len 16 --json docs/bench/compare-mixed.json.gz
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.compare import quiet, report, store
from bench.compare.run import ConfigRun
from bench.compare.store import Slos, resumed, settings, slo_section
from bench.goodput.sweep import add_sweep_args
from bench.serve import cpu
from bench.serve.deploy import app_args, free_port
from bench.serve.metrics import finite_or_none
from bench.serve.workloads import add_workload_args, describe_workload


def step_with_retry(run: ConfigRun, slos: Slos | None, *rest: Any) -> Slos:
    """`run.step`, once more if it raised (a Ray instance that did not start on a busy host,
    a replica that died): a long comparison should not end on one transient failure."""
    try:
        return run.step(slos, *rest)
    except Exception as e:  # noqa: BLE001 - any failure of the deployment or the point
        print(f"== {run.name} seed {run.seed} failed ({e!r}); trying again", file=sys.stderr)
        import ray

        ray.shutdown()  # whatever a failed start left behind (a no-op if nothing)
        return run.step(slos, *rest)


def next_start(runs: Sequence[Mapping[str, Any]], rate_start: float) -> float:
    """Where a config's next seed starts: 0.75x its mean bracketed goodput so far."""
    found = [r["goodput"]["goodput"] for r in runs if r["goodput"]["bracketed"]]
    return 0.75 * statistics.fmean(found) if found and min(found) > 0 else rate_start


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdserve bench compare",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--configs", default="cpu-disagg,cpu-colocated", help="last = baseline")
    p.add_argument("--model", default="small", help="model dir or built-in name")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of each Ray instance")
    p.add_argument("--seeds", type=int, default=3, help="runs per config (seed, seed+1, ...)")
    p.add_argument("--requests-per-point", type=int, default=100, help="requests per rate")
    p.add_argument("--confidence", type=float, default=0.95, help="of every interval")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--slo-ttft", type=float, default=None, help="ms; default: derived")
    p.add_argument("--slo-tpot", type=float, default=None, help="ms; default: derived")
    p.add_argument("--k-ttft", type=float, default=3.0, help="derived TTFT SLO factor")
    p.add_argument("--k-tpot", type=float, default=1.5, help="derived TPOT SLO factor")
    p.add_argument("--batch-slo-factor", type=float, default=4.0, help="multi-tenant batch")
    p.add_argument("--isolated-repeats", type=int, default=2, help="isolated runs/class")
    p.add_argument("--drift-threshold", type=float, default=0.25, help="noisy above this")
    p.add_argument("--exclude-noisy", action="store_true", help="aggregate quiet runs only")
    p.add_argument("--replica-cores", type=quiet.parse_cores, default=None, help="e.g. 0-3")
    p.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    p.add_argument("--no-progress", action="store_true", help="no per-point request bars")
    p.add_argument("--json", type=Path, required=True, help="write the result here")
    p.add_argument("--plots-dir", type=Path, default=None, help="default: beside --json")
    p.add_argument("--cdf-rate", type=float, default=None, help="rate of the CDF plots")
    p.add_argument("--replot", action="store_true", help="only redraw --json's plots")
    p.add_argument(
        "--resume", action="store_true", help="keep the runs --json holds (same settings)"
    )
    add_sweep_args(p)
    add_workload_args(p)
    p.set_defaults(rate_start=0.25, max_points=10)
    args = p.parse_args(argv)
    if args.workload == "trace":
        p.error("compare sweeps a rate; use another --workload")
    for flag in ("seeds", "requests_per_point", "max_points", "isolated_repeats", "bootstrap"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.rates:
        p.error("compare searches the knee itself (--rate-start, --tolerance); drop --rates")
    args.names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if len(args.names) < 2 and not args.replot:
        p.error("--configs needs at least two configs (the last is the baseline)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return store.replot(args.json, args.plots_dir, args.cdf_rate, args.target)
    names, baseline = args.names, args.names[-1]
    for name in names:  # a missing or invalid config fails now, not an hour in
        app_args(name, args.model, args.dtype, free_port())
    bench_cores = quiet.pin_bench(args.replica_cores) if args.replica_cores else None
    seeds = list(range(args.seed, args.seed + args.seeds))
    runs, slos, started = resumed(args)
    runs = {name: [run for run in kept if run["seed"] in seeds] for name, kept in runs.items()}
    header: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "num_cpus": args.num_cpus,
        "workload": describe_workload(args),
        "target": args.target,
        "requests_per_point": args.requests_per_point,
        "seeds": seeds,
        "tolerance": args.tolerance,
        "drift_threshold": args.drift_threshold,
        "replica_cores": args.replica_cores,
        "bench_cores": bench_cores,
        "settings": settings(args),
    }
    order = [baseline, *names[:-1]]  # the baseline first: it sets the derived SLOs
    active: list[ConfigRun] = []  # the runs of the seed being measured

    def save(slos: Slos) -> None:
        """A checkpoint (after every point): `--resume` continues from it. Interrupted
        runs not resumed yet are kept beside the ones being measured."""
        here = {(run.name, run.seed) for run in active}
        kept = [p for p in started if (p["config"], p["seed"]) not in here]
        in_progress = kept + [run.partial() for run in active if not run.done]
        checkpoint = {**header, "complete": False, "slo": slo_section(slos, baseline)}
        store.save_json(args.json, {**checkpoint, "runs": runs, "in_progress": in_progress or None})

    def interrupted(name: str, seed: int) -> dict[str, Any] | None:
        return next((p for p in started if (p["config"], p["seed"]) == (name, seed)), None)

    done = sum(len(runs[name]) for name in names)
    with tqdm(total=len(seeds) * len(names), initial=done, desc="compare", file=sys.stderr) as bar:
        for seed in seeds:
            active[:] = [
                ConfigRun(
                    name,
                    seed,
                    args,
                    next_start(runs[name], args.rate_start),
                    interrupted(name, seed),
                )
                for name in order
                if not any(run["seed"] == seed for run in runs[name])  # kept (--resume)
            ]
            while pending := [run for run in active if not run.done]:
                for run in pending:  # one point each, in turn
                    slos = step_with_retry(run, slos, bar, save)
                    if run.done:
                        runs[run.name].append(run.report())
                        save(slos)
                        bar.update(1)
            started = [p for p in started if p["seed"] != seed]
    assert slos is not None  # set by the first run (seeds >= 1)
    summary = report.aggregate(
        runs, names, args.target, args.exclude_noisy, args.bootstrap, args.confidence
    )
    document: dict[str, Any] = {
        **header,
        "complete": True,
        "slo": slo_section(slos, baseline),
        **summary,
        "goodput_per_core": {
            n: None if (m := summary["goodput"][n]["mean"]) is None else m / args.num_cpus
            for n in names
        },
        # where each config's CPU went, per request, over all its points
        "cpu_ms_per_request": {
            n: cpu.mean_per_request([p for run in runs[n] for p in run["points"]]) for n in names
        },
        "runs": runs,
    }
    store.write(document, args.json, args.plots_dir, args.cdf_rate, args.target)
    print(json.dumps(finite_or_none({k: v for k, v in document.items() if k != "runs"})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
