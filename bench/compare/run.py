"""One config's run in `pdserve bench compare`: isolated requests, the SLOs they give, and
the knee search, measured one rate point per deployment.

`ConfigRun(name, seed, args, rate_start)` owns a `KneeStepper` (`bench/goodput/knee.py`). Each
`step()` deploys the config on a fresh private Ray instance and measures on it:

- on its first deployment, the host's load average and each workload class's isolated
  TTFT/TPOT (`measure_isolated`: requests one at a time, median of `--isolated-repeats`);
- the next rate the search asks for: exactly `--requests-per-point` requests, the same ones
  for the k-th point of every config at a seed (`point_seed`), with a Wilson interval on
  the attainment (`point`) and the CPU each part of the deployment used per request
  (`bench/serve/cpu.py`);
- on its last, isolated TTFT/TPOT and the load average again (`drift`).

One point per deployment lets `bench/compare/main.py` take the configs in turn, point by point:
on a host whose speed drifts by 10-20% over an hour, configs measured minutes apart compare
far better than knee searches run one after another (BENCHMARKS.md). Every point also
starts on an idle replica with empty caches, whatever the previous point left behind.

`partial()` is the checkpoint of an unfinished run; a `ConfigRun` built from it replays the
recorded points into its (deterministic) search instead of measuring them again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from tqdm import tqdm

from bench.compare import quiet
from bench.compare.store import SloPlan, Slos
from bench.goodput.knee import KneeStepper
from bench.goodput.stats import wilson_interval
from bench.serve import cpu
from bench.serve.deploy import app_args, free_port, running_app
from bench.serve.loadgen import RunResult, Target, run_load_sync, run_report
from bench.serve.metrics import SLO, meets_slo
from bench.serve.workloads import PER_CLASS_SLO, ScheduledRequest, class_shapes, requests_from_args


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


class ConfigRun:
    """One config's knee search at one seed (module docstring)."""

    def __init__(
        self,
        name: str,
        seed: int,
        args: argparse.Namespace,
        rate_start: float,
        started: Mapping[str, Any] | None = None,
    ) -> None:
        """`started`: this run's `partial()` from an interrupted session (`--resume`)."""
        self.name, self.seed, self.args = name, seed, args
        self.seeded = argparse.Namespace(**{**vars(args), "seed": seed})
        self.rate_start = started["rate_start"] if started else rate_start
        self.stepper = KneeStepper(self.rate_start, args.target, args.tolerance, args.max_points)
        self.points: list[dict[str, Any]] = []
        for recorded in started["points"] if started else []:
            if self.stepper.next_rate() != recorded["rate"]:
                break  # settings changed since: measure from here
            self.points.append(recorded)
            self.stepper.record(recorded["rate"], float(recorded["attainment"]))
        self.resumed_points = len(self.points)
        started = started or {}
        self.host_before: Any = started.get("host_before")
        self.isolated_before: dict[str, Any] | None = started.get("isolated_before")
        self.host_after: Any = None
        self.isolated_after: dict[str, Any] | None = None
        self.config_args: dict[str, Any] | None = None  # the last deployment's

    @property
    def done(self) -> bool:
        """The search is over and the isolated figures after it are measured."""
        return self.isolated_after is not None

    def _deployment_args(self) -> dict[str, Any]:
        """The config's app args on a free port (pinned with `--replica-cores`)."""
        args = app_args(self.name, self.args.model, self.args.dtype, free_port())
        return quiet.pin_pools(args, self.args.replica_cores) if self.args.replica_cores else args

    def step(
        self,
        slos: Slos | None,
        bar: tqdm,
        on_point: Callable[[Slos], None],
    ) -> Slos:
        """Deploy, measure what is due (module docstring), tear down; returns the SLOs
        (derived from this run's isolated figures when `slos` is None: the baseline's first
        run). `on_point(slos)` is called after the point is recorded (a checkpoint)."""
        rate = self.stepper.next_rate()
        self.config_args = self._deployment_args()
        with running_app(self.config_args, self.args.num_cpus, any_port=True) as app:
            self.config_args = app.args  # its port, if the one picked was taken meanwhile
            target = Target(app.base_url, app.model_name, timeout_s=self.args.timeout)
            if self.isolated_before is None:
                self.host_before = quiet.host_state()
                self.isolated_before = measure_isolated(target, self.seeded, self.seed)
            slos = slos or plan_slos(self.args, self.isolated_before)
            if rate is not None:
                bar.set_postfix_str(f"{self.name} seed {self.seed} rate {rate:.3g}")
                self._measure(target, rate, slos)
                on_point(slos)
            if self.stepper.next_rate() is None:
                self.isolated_after = measure_isolated(target, self.seeded, self.seed, 1)
                self.host_after = quiet.host_state()
        return slos

    def _measure(self, target: Target, rate: float, slos: Slos) -> None:
        """One knee point: new prompts (the k-th point of every config gets the same ones)."""
        plan, shared, _ = slos
        point_args = argparse.Namespace(
            **{**vars(self.seeded), "seed": point_seed(self.seed, self.points)}
        )
        requests = requests_from_args(point_args, rate, 0.0, self.args.requests_per_point)
        started_at = time.time()  # when, to show configs were measured side by side
        progress = not self.args.no_progress
        cpu_before, clock = cpu.cpu_times(), time.monotonic()
        result = run_load_sync(target, requests, self.args.concurrency, 1, progress, self.name)
        used = cpu.usage(cpu_before, cpu.cpu_times(), len(result.records), time.monotonic() - clock)
        measured = point(result, plan, shared, target, self.args.confidence)
        self.points.append({"rate": rate, "started_at": started_at, **measured, "cpu": used})
        self.stepper.record(rate, float(measured["attainment"]))
        line = {"config": self.name, "seed": self.seed, "rate": rate}
        print(json.dumps({**line, "attainment": measured["attainment"]}), file=sys.stderr)

    def partial(self) -> dict[str, Any]:
        """The checkpoint of this unfinished run (`--resume` continues from it)."""
        return {
            "config": self.name,
            "seed": self.seed,
            "rate_start": self.rate_start,
            "host_before": self.host_before,
            "isolated_before": self.isolated_before,
            "points": self.points,
        }

    def report(self) -> dict[str, Any]:
        """The finished run, as the JSON's `runs` hold it."""
        search = self.stepper.result()
        assert self.isolated_before is not None and self.isolated_after is not None
        moved = quiet.drift(self.isolated_before, self.isolated_after)
        return {
            "config": self.name,
            "seed": self.seed,
            "args": self.config_args,
            "rate_start": self.rate_start,
            "host_before": self.host_before,
            "host_after": self.host_after,
            "isolated_before": self.isolated_before,
            "isolated_after": self.isolated_after,
            "drift": moved,
            "noisy": moved is None or moved > self.args.drift_threshold,
            "goodput": {
                "goodput": search.estimate.goodput,
                "low_rate": search.estimate.low_rate,
                "high_rate": search.estimate.high_rate,
                "bracketed": search.estimate.bracketed,
                "converged": search.converged,
            },
            "points": self.points,
            "resumed_points": self.resumed_points,
        }
