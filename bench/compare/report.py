"""What `pdserve bench compare` concludes from its runs, and its plots.

A *run* is one config at one seed: the knee search's points (each with per-class request
counts) and its goodput. `aggregate` gives, per config, the mean goodput over its runs with
the spread and a bootstrap interval, and for every other config the ratio of its mean goodput
to the baseline's (the last config) with a bootstrap interval: each draw resamples the runs
of both configs and every point's attainment from its request counts (`bench/goodput/knee.py`
`resampled_goodput`), so the interval covers seed-to-seed and within-point variation.
`ratio`/`ratio_ci` at the top level are the first config's. When two configs ran the same
seeds, `per_seed_ratio` and `ratio_ci_paired` pair them by seed (`paired_ratio`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.goodput.knee import PointCounts, resampled_goodput
from bench.goodput.stats import bootstrap_interval, spread
from bench.serve.metrics import RequestRecord

Run = Mapping[str, Any]  # one config at one seed, as `bench/compare/main.py` records it


def point_counts(point: Mapping[str, Any]) -> PointCounts:
    """A recorded point's per-class (met, requests) counts."""
    classes = point["classes"]
    return PointCounts(point["rate"], tuple((c["met"], c["n"]) for c in classes.values()))


def counted_runs(runs: Sequence[Run]) -> list[list[PointCounts]]:
    return [[point_counts(p) for p in run["points"]] for run in runs]


def usable_runs(runs: Sequence[Run], exclude_noisy: bool) -> list[Run]:
    """The runs aggregates use: all, or the quiet ones when asked (all if none is quiet)."""
    quiet = [run for run in runs if not run["noisy"]]
    return quiet if exclude_noisy and quiet else list(runs)


def aggregate(
    runs: Mapping[str, Sequence[Run]],
    names: Sequence[str],
    target: float,
    exclude_noisy: bool = False,
    num_resamples: int = 2000,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Per-config goodput (mean, spread, interval) and each config's ratio to the baseline."""
    used = {name: usable_runs(runs[name], exclude_noisy) for name in names}
    counts = {name: counted_runs(used[name]) for name in names}
    goodput: dict[str, Any] = {}
    for name in names:
        values = [run["goodput"]["goodput"] for run in used[name]]

        def draw_one(rng: Any, runs_of: list[list[PointCounts]] = counts[name]) -> float:
            return resampled_goodput(runs_of, target, rng)

        interval = bootstrap_interval(draw_one, num_resamples, confidence)
        goodput[name] = {
            **spread(values),
            "ci": list(interval),
            "per_run": values,
            "all_bracketed": all(run["goodput"]["bracketed"] for run in used[name]),
            "num_runs": len(runs[name]),
            "num_noisy": sum(run["noisy"] for run in runs[name]),
        }
    baseline = names[-1]
    base_mean = goodput[baseline]["mean"]
    ratios: dict[str, Any] = {}
    for name in names[:-1]:

        def draw(rng: Any, a: list[list[PointCounts]] = counts[name]) -> float:
            low = resampled_goodput(counts[baseline], target, rng)
            return resampled_goodput(a, target, rng) / low if low > 0 else math.inf

        mean = goodput[name]["mean"]
        ratios[name] = {
            "ratio": mean / base_mean if base_mean else None,
            "ratio_ci": list(bootstrap_interval(draw, num_resamples, confidence)),
            **paired_ratio(
                used[name],
                used[baseline],
                counts[name],
                counts[baseline],
                target,
                num_resamples,
                confidence,
            ),
        }
    first = ratios.get(names[0], {"ratio": None, "ratio_ci": [None, None]})
    return {
        "goodput": goodput,
        "ratios": ratios,
        "ratio": first["ratio"],
        "ratio_ci": first["ratio_ci"],
        "ratio_ci_paired": first.get("ratio_ci_paired"),
        "confidence": confidence,
        "excluded_noisy": exclude_noisy,
    }


def paired_ratio(
    runs: Sequence[Run],
    base_runs: Sequence[Run],
    counts: list[list[PointCounts]],
    base_counts: list[list[PointCounts]],
    target: float,
    num_resamples: int,
    confidence: float,
) -> dict[str, Any]:
    """The ratio paired by seed, when both configs ran the same seeds: at one seed they saw
    the same requests, so a swing every config shares (the host, the seed's requests) cancels.
    `per_seed_ratio` lists each seed's; `ratio_ci_paired` resamples seeds jointly (the same
    picks for both configs) and every point's attainment from its counts. Empty otherwise."""
    seeds = [run.get("seed") for run in runs]
    if not seeds or None in seeds or seeds != [run.get("seed") for run in base_runs]:
        return {}

    def draw(rng: Any) -> float:
        picks = rng.integers(0, len(seeds), size=len(seeds))
        low = resampled_goodput(base_counts, target, rng, picks)
        return resampled_goodput(counts, target, rng, picks) / low if low > 0 else math.inf

    pairs = zip(runs, base_runs, strict=True)
    return {
        "per_seed_ratio": [
            a["goodput"]["goodput"] / b["goodput"]["goodput"] if b["goodput"]["goodput"] else None
            for a, b in pairs
        ],
        "ratio_ci_paired": list(bootstrap_interval(draw, num_resamples, confidence)),
    }


def common_rate(points: Mapping[str, Sequence[Mapping[str, Any]]], target: float) -> float:
    """The rate the CDFs compare at: the highest rate every config ran at which at least one
    config still met the target (where the configs differ), else the lowest common rate."""
    shared = sorted(set.intersection(*({p["rate"] for p in pts} for pts in points.values())))
    if not shared:
        return min(p["rate"] for pts in points.values() for p in pts)

    def attainment(pts: Sequence[Mapping[str, Any]], rate: float) -> float:
        return float(next(p["attainment"] for p in pts if p["rate"] == rate))

    passing = [r for r in shared if any(attainment(pts, r) >= target for pts in points.values())]
    return max(passing) if passing else shared[0]


# ------------------------------------------------------------------------------ plots


def plot(document: Mapping[str, Any], out_dir: Path, stem: str) -> list[str]:
    """Attainment vs rate (Wilson bands), goodput per config (spread), and TTFT/TPOT/ITL CDFs
    at `document["common_rate"]` (first seed's runs); returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    runs: Mapping[str, Sequence[Run]] = document["runs"]
    paths = [
        _attainment_plot(plt, document, runs, out_dir / f"{stem}_attainment.png"),
        _goodput_plot(plt, document, out_dir / f"{stem}_goodput.png"),
    ]
    first = {name: config_runs[0]["points"] for name, config_runs in runs.items() if config_runs}
    rate = document["common_rate"]
    slo = document["slo"]["shared"] or {}
    for metric, xlabel in [("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("itl", "ITL (ms)")]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, pts in first.items():
            values = sorted(_metric_ms(_records(pts, rate), metric))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        if slo.get(f"{metric}_ms") is not None:
            ax.axvline(slo[f"{metric}_ms"], color="grey", ls="--", lw=1, label="SLO")
        ax.set(xlabel=xlabel, ylabel="CDF", xscale="log", ylim=(0, 1.01))
        ax.set_title(f"{metric.upper()} CDF at {rate:g} req/s (first seed)", fontsize=10)
        ax.legend()
        paths.append(_save(plt, fig, out_dir / f"{stem}_{metric}_cdf.png"))
    return paths


def _attainment_plot(plt: Any, document: Mapping[str, Any], runs: Any, path: Path) -> str:
    """One line per run (config x seed; one colour per config, one marker per seed), its
    points' Wilson band shaded; dotted: each config's mean goodput."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    markers = "osD^v<>"
    for i, (name, config_runs) in enumerate(runs.items()):
        color = f"C{i}"
        for j, run in enumerate(config_runs):
            points = sorted(run["points"], key=lambda p: p["rate"])
            if not points:
                continue
            rates = [p["rate"] for p in points]
            label = name if j == 0 else None
            marker = markers[j % len(markers)]
            values = [p["attainment"] for p in points]
            ax.plot(rates, values, marker=marker, ms=4, lw=1, color=color, label=label)
            low = [p["attainment_ci"][0] for p in points]
            high = [p["attainment_ci"][1] for p in points]
            ax.fill_between(rates, low, high, color=color, alpha=0.12, lw=0)
        mean = document["goodput"][name]["mean"]
        if mean is not None:
            ax.axvline(mean, color=color, ls=":", lw=1)
    target = document["target"]
    ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target}")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02))
    ax.set_title(
        f"{document['workload']['workload']}: one line per seed, "
        f"{round(document['confidence'] * 100)}% Wilson band; dotted: mean goodput",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _goodput_plot(plt: Any, document: Mapping[str, Any], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(document["goodput"])
    for i, name in enumerate(names):
        g = document["goodput"][name]
        if g["mean"] is None:
            continue
        low, high = g["ci"]
        ax.bar(i, g["mean"], color=f"C{i}", alpha=0.6)
        if low is not None and high is not None:
            ax.errorbar(i, g["mean"], yerr=[[g["mean"] - low], [high - g["mean"]]], color="k")
        ax.plot([i] * len(g["per_run"]), g["per_run"], "k.", ms=6)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("goodput (req/s)")
    ratio, (low, high) = document["ratio"], document["ratio_ci"]
    if ratio is not None and low is not None and high is not None:
        title = f"{names[0]} / {names[-1]} = {ratio:.2f}x, interval [{low:.2f}, {high:.2f}]"
    else:
        title = "goodput per config"
    ax.set_title(f"{title}\nbars: mean; whiskers: interval; dots: seeds", fontsize=9)
    return _save(plt, fig, path)


def _records(points: Sequence[Mapping[str, Any]], rate: float) -> list[RequestRecord]:
    point = next((p for p in points if p["rate"] == rate), None)
    return [] if point is None else [RequestRecord.from_dict(r) for r in point["records"]]


def _metric_ms(records: list[RequestRecord], metric: str) -> list[float]:
    done = [r for r in records if r.success]
    if metric == "itl":
        return [gap * 1000 for r in done for gap in r.itls_s if gap > 0]
    return [v * 1000 for r in done if (v := getattr(r, f"{metric}_s")) is not None]


def _save(plt: Any, fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
