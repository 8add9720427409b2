"""`pdserve bench summary`: the config x workload table of several `bench compare` files.

Each file is one workload (`pdserve bench compare --json`); finished or still checkpointed
(`"complete": false`), in which case the runs finished so far count. Only the seeds that
every config of the file finished are used, so every figure pairs configs at the same seeds
(the same requests). Per workload and config the table gives the mean goodput with its spread
over seeds, the ratio to the file's baseline (its last config) with the bootstrap interval of
`bench/compare/report.py` (unpaired and paired by seed), and, for the file's first config,
the ratio to the **best of the others** (`vs_best`: per seed, and an interval that resamples
seeds jointly and every point's attainment from its counts, each draw dividing by whichever
other config did best in that draw). Issue 14 asks the adaptive default (listed first) to be
within 10% of the better of disaggregated and colocated on every workload: `vs_best` >= 0.9.

    pdserve bench summary docs/bench/compare-mixed-3.json.gz \
        docs/bench/compare-long-context-4.json.gz \
        --markdown /tmp/summary.md --plot docs/bench/summary.png

Prints the markdown table (stdout) and, with `--json`, writes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.compare import store
from bench.compare.report import aggregate, counted_runs
from bench.goodput.knee import interpolate_goodput, resampled_goodput
from bench.goodput.stats import bootstrap_interval
from bench.serve.metrics import finite_or_none


def config_names(document: Mapping[str, Any]) -> list[str]:
    """The file's configs in `--configs` order (the last is the baseline)."""
    return [n for n in str(document["settings"]["configs"]).split(",") if n]


def common_seeds(runs: Mapping[str, Sequence[Mapping[str, Any]]], names: Sequence[str]) -> list:
    """Seeds every config finished, in order."""
    seen = [{run["seed"] for run in runs.get(name, [])} for name in names]
    return sorted(set.intersection(*seen)) if seen else []


def vs_best(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    names: Sequence[str],
    target: float,
    num_resamples: int,
    confidence: float,
) -> dict[str, Any]:
    """The first config's goodput over the best other config's: per seed, of the means,
    and a bootstrap interval paired by seed (runs listed in the same seed order)."""
    first, others = names[0], names[1:]

    def goodput(name: str, i: int) -> float:
        return float(runs[name][i]["goodput"]["goodput"])

    num_seeds = len(runs[first])
    per_seed = []
    for i in range(num_seeds):
        best = max(goodput(o, i) for o in others)
        per_seed.append(goodput(first, i) / best if best > 0 else None)
    means = {n: sum(goodput(n, i) for i in range(num_seeds)) / num_seeds for n in names}
    best_mean = max(means[o] for o in others)
    counts = {name: counted_runs(runs[name]) for name in names}

    def draw(rng: Any) -> float:
        picks = rng.integers(0, num_seeds, size=num_seeds)
        mine = resampled_goodput(counts[first], target, rng, picks)
        best = max(resampled_goodput(counts[o], target, rng, picks) for o in others)
        return mine / best if best > 0 else math.inf

    return {
        "config": first,
        "best_other": max(others, key=lambda o: means[o]),
        "ratio": means[first] / best_mean if best_mean > 0 else None,
        "per_seed": per_seed,
        "ci_paired": list(bootstrap_interval(draw, num_resamples, confidence)),
    }


def summarize(
    document: Mapping[str, Any], num_resamples: int = 2000, confidence: float = 0.95
) -> dict[str, Any]:
    """One workload's figures over the seeds every config finished (module docstring)."""
    names = config_names(document)
    all_runs: Mapping[str, Sequence[Mapping[str, Any]]] = document.get("runs", {})
    seeds = common_seeds(all_runs, names)
    runs = {
        name: sorted(
            (run for run in all_runs.get(name, []) if run["seed"] in seeds),
            key=lambda run: run["seed"],
        )
        for name in names
    }
    workload = document["workload"]
    summary: dict[str, Any] = {
        "workload": workload["workload"] if isinstance(workload, Mapping) else workload,
        "model": document["model"],
        "complete": bool(document.get("complete")),
        "seeds": seeds,
        "slo": document.get("slo"),
        "configs": names,
    }
    target = float(document["target"])
    summary["in_progress"] = [
        interim(run, target) for run in document.get("in_progress") or [] if run["points"]
    ]
    summary["unpaired"] = [  # finished, at a seed another config has not finished yet
        {**interim(run, target), "goodput": run["goodput"]["goodput"]}
        for name in names
        for run in all_runs.get(name, [])
        if run["seed"] not in seeds
    ]
    if not seeds:
        return summary
    figures = aggregate(runs, names, target, False, num_resamples, confidence)
    summary["goodput"] = figures["goodput"]
    summary["ratios"] = figures["ratios"]
    summary["vs_best"] = vs_best(runs, names, target, num_resamples, confidence)
    summary["noisy_runs"] = sum(run["noisy"] for name in names for run in runs[name])
    return summary


def interim(run: Mapping[str, Any], target: float) -> dict[str, Any]:
    """A checkpointed run's search so far: its points and the goodput they bracket."""
    points = sorted((p["rate"], p["attainment"]) for p in run["points"])
    estimate = interpolate_goodput(points, target)
    return {
        "config": run["config"],
        "seed": run["seed"],
        "points": [list(p) for p in points],
        "goodput": estimate.goodput,
        "bracket": [estimate.low_rate, estimate.high_rate],
    }


def _interval(values: Sequence[float | None] | None) -> str:
    if not values or any(v is None or not math.isfinite(v) for v in values):
        return "n/a"
    low, high = values
    return f"[{low:.2f}, {high:.2f}]"


def markdown(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The config x workload table (one row per workload and config)."""
    lines = [
        "| workload (model) | file | seeds | config | goodput (req/s): mean ± std | "
        "/ baseline [interval; paired] | first config / best other [paired interval] |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summaries:
        state = "" if s["complete"] else ", partial"
        where = f"{s['workload']} (`{s['model']}`{state}) | {Path(s.get('file', '-')).name}"
        seeds = ",".join(str(seed) for seed in s["seeds"]) or "none"
        partial = [(run, "finished, unpaired") for run in s.get("unpaired", [])]
        partial += [(run, "in progress") for run in s.get("in_progress", [])]
        for run, state in partial:
            low, high = run["bracket"]
            bracket = f"[{low:.3g}, {'none' if high is None else f'{high:.3g}'}]"
            searched = ", ".join(f"{rate:.3g}: {value:.2f}" for rate, value in run["points"])
            so_far = "" if state.startswith("finished") else " so far"
            lines.append(
                f"| {where} | {run['seed']} ({state}) | `{run['config']}` | "
                f"{run['goodput']:.3f}{so_far}, bracket {bracket} | points {searched} | |"
            )
        if "goodput" not in s:
            continue
        baseline = s["configs"][-1]
        for name in s["configs"]:
            g = s["goodput"][name]
            std = "" if g["std"] is None else f" ± {g['std']:.3f}"
            cell = f"{g['mean']:.3f}{std}" + ("" if g["all_bracketed"] else " (lower bound)")
            if name == baseline:
                ratio = "baseline"
            else:
                r = s["ratios"][name]
                paired = _interval(r.get("ratio_ci_paired"))
                ratio = f"{r['ratio']:.2f}× {_interval(r['ratio_ci'])}; {paired}"
            best = ""
            if name == s["vs_best"]["config"]:
                v = s["vs_best"]
                best = f"{v['ratio']:.2f}× vs `{v['best_other']}` {_interval(v['ci_paired'])}"
            lines.append(f"| {where} | {seeds} | `{name}` | {cell} | {ratio} | {best} |")
    return "\n".join(lines) + "\n"


def plot(summaries: Sequence[Mapping[str, Any]], path: Path) -> str:
    """Goodput relative to each workload's baseline: bars (mean), dots (seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in summaries if "goodput" in s]
    names: list[str] = []
    for s in shown:
        names += [n for n in s["configs"] if n not in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(shown)), 4))
    width = 0.8 / max(len(names), 1)
    labelled: set[str] = set()  # each config in the legend once, wherever it first appears
    for w, s in enumerate(shown):
        base = s["goodput"][s["configs"][-1]]["mean"]
        for c, name in enumerate(names):
            if name not in s["goodput"] or not base:
                continue
            g = s["goodput"][name]
            x = w + (c - (len(names) - 1) / 2) * width
            label = None if name in labelled else name
            labelled.add(name)
            ax.bar(x, g["mean"] / base, width, color=f"C{c}", alpha=0.6, label=label)
            ax.plot([x] * len(g["per_run"]), [v / base for v in g["per_run"]], "k.", ms=4)
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xticks(range(len(shown)), [f"{s['workload']}\n({s['model']})" for s in shown])
    ax.set_ylabel("goodput / baseline's mean")
    ax.set_title("goodput per workload, relative to its baseline; dots: seeds", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve bench summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="+", type=Path, help="bench compare JSON files")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    parser.add_argument("--plot", type=Path, help="PNG of goodput relative to the baseline")
    parser.add_argument("--bootstrap", type=int, default=2000, help="resamples per interval")
    parser.add_argument("--confidence", type=float, default=0.95)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summaries = []
    for path in args.files:
        document = store.load_json(path)
        if not isinstance(document.get("settings"), dict) or "runs" not in document:
            print(f"skipped {path}: not a `bench compare` file of this format", file=sys.stderr)
            continue
        summary = summarize(document, args.bootstrap, args.confidence)
        summaries.append({"file": str(path), **summary})
    table = markdown(summaries)
    sys.stdout.write(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.plot:
        print(f"plot: {plot(summaries, args.plot)}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(finite_or_none(summaries), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
