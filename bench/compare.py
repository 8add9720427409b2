"""`pdserve bench compare`: goodput of several configs, deployed in turn on this machine.

Each config (`configs/<name>.yaml`) runs on its own private Ray instance with the same CPUs
(`--num-cpus`, default 2), the same model (`--model`, default the built-in `small`) and dtype
(`--dtype`, default float32). For each: a few isolated requests (one at a time) measure the
unloaded TTFT/TPOT of every workload class, then the goodput sweep of `bench goodput` runs
the same rate points. `ratio` is the first config's goodput over the baseline's (the last
config): `--configs cpu-disagg,cpu-colocated` gives disagg / colocated. Goodput is also
reported per core (goodput / `--num-cpus`; both configs use the same cores, so the ratio is
the same either way).

SLOs: given with `--slo-ttft/--slo-tpot` (ms), or (each one not given) derived from the
baseline's isolated requests: TTFT SLO = `--k-ttft` (3) x the worst class's isolated TTFT (the
longest prompt), TPOT SLO = `--k-tpot` (1.5, tight) x the best class's isolated TPOT (batch-1
decode). The JSON records the SLOs and how they were chosen.

PNG plots beside the JSON (or in `--plots-dir`): attainment vs rate, and TTFT, TPOT and ITL
CDFs at a common rate (`--cdf-rate`, or the highest rate all configs ran at which at least one
still met the target). `--replot` redraws the plots of an existing `--json` without running.

    pdserve bench compare --configs cpu-disagg,cpu-colocated --model small --workload mixed \
        --rates 0.1,0.2,0.3,0.4 --duration 45 --json docs/bench/compare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.goodput import add_sweep_args, goodput_report, parse_rates, point_runner, sweep
from bench.loadgen import Target, run_load_sync
from bench.metrics import SLO, RequestRecord, finite_or_none
from bench.serve_app import app_args, free_port, running_app
from bench.workloads import (
    FixedWorkload,
    ScheduledRequest,
    add_workload_args,
    describe_workload,
    requests_from_args,
)


def isolated_specs(args: argparse.Namespace) -> list[FixedWorkload]:
    """One fixed shape per workload class: the nominal short turn and the longest prompt."""
    if args.workload == "fixed":
        return [FixedWorkload(args.input_len, args.output_len, args.special_tokens)]
    short = FixedWorkload(args.short_input_len, args.short_output_len, args.special_tokens)
    if args.long_share <= 0:
        return [short]
    long = FixedWorkload(args.long_input_max, args.long_output_len, args.special_tokens)
    return [short, long]


def measure_isolated(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    """Median TTFT/TPOT (ms) of each class, requests sent one at a time (no contention)."""
    import numpy as np

    rng = np.random.default_rng(args.seed + 1)
    out: dict[str, Any] = {}
    for shape in isolated_specs(args):
        name = f"{shape.input_len}in/{shape.output_len}out"
        requests = [
            ScheduledRequest(i, 0.0, shape.sample(rng)) for i in range(args.isolated_repeats)
        ]
        result = run_load_sync(target, requests, concurrency=1, warmup=1, progress=False)
        done = [r for r in result.records if r.success]
        ttfts = [r.ttft_s * 1000 for r in done if r.ttft_s is not None]
        tpots = [r.tpot_s * 1000 for r in done if r.tpot_s is not None]
        out[name] = {
            "input_len": shape.input_len,
            "output_len": shape.output_len,
            "num_requests": len(done),
            "ttft_ms": statistics.median(ttfts) if ttfts else None,
            "tpot_ms": statistics.median(tpots) if tpots else None,
        }
    return out


def derive_slo(isolated: dict[str, Any], k_ttft: float, k_tpot: float) -> tuple[SLO, str]:
    """SLOs from isolated measurements, and a sentence saying how."""
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


def common_rate(points: dict[str, list[dict[str, Any]]], target: float) -> float:
    """The rate the CDFs compare at: the highest rate every config ran at which at least one
    config still met the target (where the configs differ), else the lowest common rate."""
    shared = sorted(set.intersection(*({p["rate"] for p in pts} for pts in points.values())))
    if not shared:
        return min(p["rate"] for pts in points.values() for p in pts)
    passing = [r for r in shared if any(_attainment(pts, r) >= target for pts in points.values())]
    return max(passing) if passing else shared[0]


def _attainment(points: list[dict[str, Any]], rate: float) -> float:
    return next(p["attainment"] for p in points if p["rate"] == rate)


def _records(points: list[dict[str, Any]], rate: float) -> list[RequestRecord]:
    point = next((p for p in points if p["rate"] == rate), None)
    return [] if point is None else [RequestRecord.from_dict(r) for r in point["records"]]


def plot(
    result: dict[str, Any], points: dict[str, list[dict[str, Any]]], out_dir: Path, stem: str
) -> list[str]:
    """Attainment-vs-rate and CDF PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    slo = result["slo"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in points.items():
        line = ax.plot([p["rate"] for p in pts], [p["attainment"] for p in pts], "o-", label=name)
        ax.axvline(result["goodput"][name], color=line[0].get_color(), ls=":", lw=1)
    ax.axhline(result["target"], color="grey", ls="--", lw=1, label=f"target {result['target']}")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02))
    ax.set_title(f"TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms", fontsize=10)
    ax.legend()
    paths.append(_save(fig, out_dir / f"{stem}_attainment.png"))
    rate = result["common_rate"]
    for metric, xlabel, limit in [
        ("ttft", "TTFT (ms)", slo["ttft_ms"]),
        ("tpot", "TPOT (ms)", slo["tpot_ms"]),
        ("itl", "ITL (ms)", None),
    ]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, pts in points.items():
            values = sorted(_metric_ms(_records(pts, rate), metric))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        if limit is not None:
            ax.axvline(limit, color="grey", ls="--", lw=1, label="SLO")
        ax.set(xlabel=xlabel, ylabel="CDF", xscale="log", ylim=(0, 1.01))
        ax.set_title(f"{metric.upper()} CDF at {rate:g} req/s", fontsize=10)
        ax.legend()
        paths.append(_save(fig, out_dir / f"{stem}_{metric}_cdf.png"))
    return paths


def _metric_ms(records: list[RequestRecord], metric: str) -> list[float]:
    done = [r for r in records if r.success]
    if metric == "itl":
        return [gap * 1000 for r in done for gap in r.itls_s if gap > 0]
    return [v * 1000 for r in done if (v := getattr(r, f"{metric}_s")) is not None]


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def replot(path: Path, plots_dir: Path | None, cdf_rate: float | None) -> int:
    """Redraw the plots of a saved comparison (optionally at another CDF rate)."""
    document = json.loads(path.read_text())
    points = {name: config["points"] for name, config in document["configs"].items()}
    document["common_rate"] = cdf_rate or common_rate(points, document["target"])
    stem = path.with_suffix("").name
    document["plots"] = plot(document, points, plots_dir or path.parent, stem)
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(json.dumps({k: v for k, v in document.items() if k != "configs"}))
    return 0


def run_config(
    name: str, args: argparse.Namespace, slo: SLO
) -> tuple[dict[str, Any], SLO, str | None]:
    """Deploy one config, measure isolated requests, derive the SLOs `slo` leaves unset, and
    sweep; returns the config's results, the SLOs used, and how they were derived (if so)."""
    config_args = app_args(name, args.model, args.dtype, free_port())
    print(f"== {name}: starting", file=sys.stderr)
    how = None
    with running_app(config_args, args.num_cpus) as app:
        target = Target(app.base_url, app.model_name, timeout_s=args.timeout)
        isolated = measure_isolated(target, args)
        print(json.dumps({"config": name, "isolated": isolated}), file=sys.stderr)
        if slo.ttft_ms is None or slo.tpot_ms is None:
            derived, how = derive_slo(isolated, args.k_ttft, args.k_tpot)
            if slo.ttft_ms is not None or slo.tpot_ms is not None:
                how += "; the SLO given on the command line replaces its derived value"
            slo = SLO(
                slo.ttft_ms if slo.ttft_ms is not None else derived.ttft_ms,
                slo.tpot_ms if slo.tpot_ms is not None else derived.tpot_ms,
            )
        runner = point_runner(
            target,
            lambda rate: requests_from_args(args, rate, args.duration),
            slo,
            args.concurrency,
            warmup=1,
            progress=not args.no_progress,
            label=name,
        )
        rates = parse_rates(args.rates)
        results = sweep(
            runner, rates, args.rate_start, args.max_points, args.target, args.stop_below
        )
    report = goodput_report(results, args.target, args.num_cpus, "cores")
    return (
        {"args": config_args, "isolated": isolated, "goodput": report, "points": results},
        slo,
        how,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve bench compare",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--configs", default="cpu-disagg,cpu-colocated", help="last = baseline")
    parser.add_argument("--model", default="small", help="model dir or built-in name")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of each Ray instance")
    parser.add_argument("--slo-ttft", type=float, default=None, help="ms; default: derived")
    parser.add_argument("--slo-tpot", type=float, default=None, help="ms; default: derived")
    parser.add_argument("--k-ttft", type=float, default=3.0, help="derived TTFT SLO factor")
    parser.add_argument("--k-tpot", type=float, default=1.5, help="derived TPOT SLO factor")
    parser.add_argument("--isolated-repeats", type=int, default=2, help="isolated runs/class")
    parser.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", type=Path, required=True, help="write the result here")
    parser.add_argument("--plots-dir", type=Path, default=None, help="default: beside --json")
    parser.add_argument("--cdf-rate", type=float, default=None, help="rate of the CDF plots")
    parser.add_argument("--replot", action="store_true", help="only redraw --json's plots")
    add_sweep_args(parser)
    add_workload_args(parser)
    args = parser.parse_args(argv)
    if args.workload == "trace":
        parser.error("compare sweeps a rate; use --workload fixed or mixed")
    if args.replot:
        return replot(args.json, args.plots_dir, args.cdf_rate)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if len(names) < 2:
        parser.error("--configs needs at least two configs")
    baseline = names[-1]

    slo = SLO(args.slo_ttft, args.slo_tpot)
    how: str | None = "given on the command line"
    configs: dict[str, Any] = {}
    for name in [baseline, *names[:-1]]:  # the baseline first: it may set the SLOs
        configs[name], slo, derived = run_config(name, args, slo)
        how = derived or how
    points = {name: configs[name]["points"] for name in names}
    goodput = {name: configs[name]["goodput"]["goodput"] for name in names}
    result: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "num_cpus": args.num_cpus,
        "duration_s": args.duration,
        "workload": describe_workload(args),
        "target": args.target,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "how": how, "baseline": baseline},
        "goodput": goodput,
        "goodput_per_core": {n: configs[n]["goodput"]["goodput_per_unit"] for n in names},
        "ratio": goodput[names[0]] / goodput[baseline] if goodput[baseline] else None,
        "common_rate": args.cdf_rate or common_rate(points, args.target),
    }
    stem = args.json.with_suffix("").name
    result["plots"] = plot(result, points, args.plots_dir or args.json.parent, stem)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    document = {**result, "configs": {n: configs[n] for n in names}}
    args.json.write_text(json.dumps(finite_or_none(document), indent=1) + "\n")
    print(json.dumps(finite_or_none(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
