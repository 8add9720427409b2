"""`pdserve bench compare`: goodput of several configs on this machine, with intervals.

Configs (`--configs a,b,c`, any number ≥ 2; the last is the baseline) run in turn, seed by
seed: for each of `--seeds` seeds, every config is deployed on its own private Ray instance
(`--num-cpus`, default 2; model `--model`, default the built-in `small`; `--dtype`), then

1. the host's load average and each workload class's isolated TTFT/TPOT (requests one at a
   time, median of `--isolated-repeats`) are recorded;
2. the knee search (`bench/knee.py`) probes rates from `--rate-start` (later seeds start at
   0.75x the config's mean goodput so far): doubling until attainment < `--target`, then
   bisecting to `--tolerance`, at most `--max-points` points, each exactly
   `--requests-per-point` requests (default 100) with a Wilson interval on its attainment;
3. isolated TTFT/TPOT and the load average again: a run whose isolated figures moved by more
   than `--drift-threshold` (relative) is marked `noisy` (`--exclude-noisy` leaves noisy runs
   out of the aggregates while a quiet one remains).

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
        --long-input-max 1024 --long-output-len 16 --json docs/bench/compare-mixed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import compare_report, compare_store, quiet
from bench.compare_store import SloPlan, Slos, resumed, settings, slo_section
from bench.goodput import add_sweep_args
from bench.knee import find_knee
from bench.loadgen import RunResult, Target, run_load_sync, run_report
from bench.metrics import SLO, finite_or_none, meets_slo
from bench.serve_app import app_args, free_port, running_app
from bench.stats import wilson_interval
from bench.workloads import (
    PER_CLASS_SLO,
    ScheduledRequest,
    add_workload_args,
    class_shapes,
    describe_workload,
    requests_from_args,
)


def measure_isolated(
    target: Target, args: argparse.Namespace, seed: int, phase: int = 0
) -> dict[str, Any]:
    """Median TTFT/TPOT (ms) of each class, requests sent one at a time (no contention).

    Every prompt is new to the server (`phase` 0 before the knee search, 1 after it draws
    other prompts), and the warm-up request is one more new prompt: a repeated prompt would
    hit the prefix cache and measure a shorter prefill than the workload's."""
    import numpy as np

    rng = np.random.default_rng([seed + 1, phase])
    out: dict[str, Any] = {}
    for label, shape in class_shapes(args).items():
        warm = [ScheduledRequest(0, 0.0, shape.sample(rng))]
        run_load_sync(target, warm, concurrency=1, warmup=0, progress=False)
        requests = [
            ScheduledRequest(i, 0.0, shape.sample(rng)) for i in range(args.isolated_repeats)
        ]
        result = run_load_sync(target, requests, concurrency=1, warmup=0, progress=False)
        done = [r for r in result.records if r.success]
        ttfts = [r.ttft_s * 1000 for r in done if r.ttft_s is not None]
        tpots = [r.tpot_s * 1000 for r in done if r.tpot_s is not None]
        out[label] = {
            "input_len": shape.input_len,
            "output_len": shape.output_len,
            "num_requests": len(done),
            "ttft_ms": statistics.median(ttfts) if ttfts else None,
            "tpot_ms": statistics.median(tpots) if tpots else None,
        }
    return out


def derive_slo(isolated: Mapping[str, Any], k_ttft: float, k_tpot: float) -> tuple[SLO, str]:
    """One shared SLO from isolated measurements, and a sentence saying how."""
    ttfts = [c["ttft_ms"] for c in isolated.values() if c["ttft_ms"] is not None]
    tpots = [c["tpot_ms"] for c in isolated.values() if c["tpot_ms"] is not None]
    if not ttfts or not tpots:
        raise RuntimeError(f"isolated requests failed, cannot derive SLOs: {isolated}")
    slo = SLO(round(k_ttft * max(ttfts), 1), round(k_tpot * min(tpots), 1))
    how = (
        f"TTFT SLO = {k_ttft} x max isolated TTFT ({max(ttfts):.1f} ms, longest prompt); "
        f"TPOT SLO = {k_tpot} x min isolated TPOT ({min(tpots):.1f} ms, batch-1 decode)"
    )
    return slo, how


def plan_slos(args: argparse.Namespace, isolated: Mapping[str, Any]) -> Slos:
    """Every class's SLO (and the shared one, if shared): given values win, the rest derived."""
    labels = list(class_shapes(args))
    given = SLO(args.slo_ttft, args.slo_tpot)
    if args.workload not in PER_CLASS_SLO:
        how = "given on the command line"
        slo = given
        if given.ttft_ms is None or given.tpot_ms is None:
            derived, how = derive_slo(isolated, args.k_ttft, args.k_tpot)
            slo = SLO(
                given.ttft_ms if given.ttft_ms is not None else derived.ttft_ms,
                given.tpot_ms if given.tpot_ms is not None else derived.tpot_ms,
            )
        return {label: slo for label in labels}, slo, how
    plan: SloPlan = {}
    for i, label in enumerate(labels):
        factor = 1.0 if i == 0 else args.batch_slo_factor
        c = isolated[label]
        if c["ttft_ms"] is None or c["tpot_ms"] is None:
            raise RuntimeError(f"isolated {label} requests failed, cannot derive SLOs: {c}")
        ttft = given.ttft_ms if given.ttft_ms is not None else args.k_ttft * c["ttft_ms"]
        tpot = given.tpot_ms if given.tpot_ms is not None else args.k_tpot * c["tpot_ms"]
        plan[label] = SLO(round(factor * ttft, 1), round(factor * tpot, 1))
    how = (
        f"per class: TTFT {args.k_ttft} x and TPOT {args.k_tpot} x the class's isolated figures "
        f"(or the given SLOs), the classes after the first {args.batch_slo_factor} x looser"
    )
    return plan, None, how


def point(
    result: RunResult,
    plan: SloPlan,
    shared: SLO | None,
    target: Target | None,
    confidence: float,
) -> dict[str, Any]:
    """One rate point's report (with the server's side if `target`) and per-class counts;
    `attainment` is the lowest class's share (with a shared SLO: all requests, one class)."""
    report = run_report(result, shared or SLO(), target)
    records = result.records
    groups = {"all": records} if shared else {k: [r for r in records if r.label == k] for k in plan}
    classes: dict[str, Any] = {}
    for label, group in groups.items():
        met = sum(meets_slo(r, plan[r.label]) for r in group)
        ci = wilson_interval(met, len(group), confidence) if group else (0.0, 1.0)
        classes[label] = {"met": met, "n": len(group), "share": met / max(1, len(group))}
        classes[label]["ci"] = list(ci)
    worst = min(classes.values(), key=lambda c: c["share"] if c["n"] else 2.0)
    return {
        "attainment": worst["share"],
        "attainment_ci": worst["ci"],
        "num_requests": len(records),
        "classes": classes,
        **report,
    }


def point_seed(seed: int, points: list[dict[str, Any]]) -> int:
    """The workload seed of the next knee point of a run at `seed`: distinct for every point
    of every seed, the same for the k-th point of every config."""
    return 1000 * (seed + 1) + len(points)


def run_once(
    name: str,
    seed: int,
    args: argparse.Namespace,
    slos: Slos | None,
    rate_start: float,
    bar: tqdm,
    started: Mapping[str, Any] | None = None,
    on_point: Callable[[dict[str, Any], Slos], None] | None = None,
) -> tuple[dict[str, Any], Slos]:
    """Deploy `name`, measure isolated requests, search the knee at `seed`, measure again.
    `slos` is `(plan, shared, how)` or None (derive them here); returns the run and slos.

    `on_point(partial_run, slos)` is called after every point measured (a checkpoint).
    `started` is such a partial run of an interrupted session (`--resume`): the search,
    being deterministic, asks for the same rates again, and its recorded points answer them
    instead of new measurements (`resumed_points` says how many)."""
    replay = list(started["points"]) if started else []
    if started:
        rate_start = started["rate_start"]
    config_args = app_args(name, args.model, args.dtype, free_port())
    if args.replica_cores:
        config_args = quiet.pin_pools(config_args, args.replica_cores)
    seeded = argparse.Namespace(**{**vars(args), "seed": seed})
    with running_app(config_args, args.num_cpus) as app:
        target = Target(app.base_url, app.model_name, timeout_s=args.timeout)
        host_before, iso_before = quiet.host_state(), measure_isolated(target, seeded, seed)
        slos = slos or plan_slos(args, iso_before)
        plan, shared, how = slos
        points: list[dict[str, Any]] = []

        def attainment_at(rate: float) -> float:
            bar.set_postfix_str(f"{name} seed {seed} rate {rate:.3g}")
            if len(points) < len(replay) and replay[len(points)]["rate"] == rate:
                points.append(replay[len(points)])  # measured before the interruption
                return float(points[-1]["attainment"])
            # New prompts at every point (the k-th point of every config gets the same ones):
            # repeating a point's prompts would let the prefix cache serve their prefill.
            point_args = argparse.Namespace(**{**vars(seeded), "seed": point_seed(seed, points)})
            requests = requests_from_args(point_args, rate, 0.0, args.requests_per_point)
            progress = not args.no_progress
            result = run_load_sync(target, requests, args.concurrency, 1, progress, name)
            points.append({"rate": rate, **point(result, plan, shared, target, args.confidence)})
            value = float(points[-1]["attainment"])
            line = {"config": name, "seed": seed, "rate": rate, "attainment": value}
            print(json.dumps(line), file=sys.stderr)
            if on_point is not None:
                partial = {"config": name, "seed": seed, "rate_start": rate_start}
                on_point({**partial, "points": points}, (plan, shared, how))
            return value

        search = find_knee(attainment_at, rate_start, args.target, args.tolerance, args.max_points)
        iso_after, host_after = measure_isolated(target, seeded, seed, 1), quiet.host_state()
    moved = quiet.drift(iso_before, iso_after)
    run = {
        "config": name,
        "seed": seed,
        "args": config_args,
        "rate_start": rate_start,
        "host_before": host_before,
        "host_after": host_after,
        "isolated_before": iso_before,
        "isolated_after": iso_after,
        "drift": moved,
        "noisy": moved is None or moved > args.drift_threshold,
        "goodput": {
            "goodput": search.estimate.goodput,
            "low_rate": search.estimate.low_rate,
            "high_rate": search.estimate.high_rate,
            "bracketed": search.estimate.bracketed,
            "converged": search.converged,
        },
        "points": points,
        "resumed_points": sum(p is q for p, q in zip(points, replay, strict=False)),
    }
    return run, slos


def run_with_retry(name: str, seed: int, *rest: Any) -> tuple[dict[str, Any], Slos]:
    """`run_once`, run again once if it raised (a Ray instance that did not start on a busy
    host, a replica that died): a long comparison should not end on one transient failure."""
    try:
        return run_once(name, seed, *rest)
    except Exception as e:  # noqa: BLE001 - any failure of the deployment or the run
        print(f"== {name} seed {seed} failed ({e!r}); running it again", file=sys.stderr)
        import ray

        ray.shutdown()  # whatever a failed start left behind (a no-op if nothing)
        return run_once(name, seed, *rest)


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
        return compare_store.replot(args.json, args.plots_dir, args.cdf_rate, args.target)
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

    def save(partial: dict[str, Any] | None, slos: Slos) -> None:
        """A checkpoint (after every point): `--resume` continues from it. Interrupted
        runs not resumed yet are kept beside the one being measured."""
        here = None if partial is None else (partial["config"], partial["seed"])
        kept = [p for p in started if (p["config"], p["seed"]) != here]
        in_progress = [*kept, partial] if partial is not None else kept
        checkpoint = {**header, "complete": False, "slo": slo_section(slos, baseline)}
        compare_store.save_json(
            args.json, {**checkpoint, "runs": runs, "in_progress": in_progress or None}
        )

    done = sum(len(runs[name]) for name in names)
    with tqdm(total=len(seeds) * len(names), initial=done, desc="compare", file=sys.stderr) as bar:
        for seed in seeds:
            for name in order:
                if any(run["seed"] == seed for run in runs[name]):
                    continue  # kept from the checkpoint (--resume)
                start = next_start(runs[name], args.rate_start)
                mine = next((p for p in started if (p["config"], p["seed"]) == (name, seed)), None)
                run, slos = run_with_retry(name, seed, args, slos, start, bar, mine, save)
                runs[name].append(run)
                started = [p for p in started if p is not mine]
                save(None, slos)
                bar.update(1)
    assert slos is not None  # set by the first run (seeds >= 1)
    summary = compare_report.aggregate(
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
        "runs": runs,
    }
    compare_store.write(document, args.json, args.plots_dir, args.cdf_rate, args.target)
    print(json.dumps(finite_or_none({k: v for k, v in document.items() if k != "runs"})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
