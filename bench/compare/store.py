"""Where `pdserve bench compare` keeps its results: the final JSON with its plots, and a
checkpoint after every knee point, which `--resume` continues when the settings match (a
comparison of several configs x seeds takes hours; an interrupted session loses at most
the point it was measuring: the interrupted run is redeployed and its recorded points
answer the search's first probes)."""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.compare import report
from bench.serve.metrics import SLO, finite_or_none

SloPlan = dict[str, SLO]  # by class label
Slos = tuple[SloPlan, SLO | None, str]  # every class's SLO, the shared one (if so), how


# The options a run's figures depend on: `--resume` continues a file only if they match.
SETTINGS_EXCLUDED = {"json", "plots_dir", "no_progress", "replot", "resume", "cdf_rate", "seeds"}
SETTINGS_EXCLUDED |= {"bootstrap", "exclude_noisy", "confidence", "names"}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a checkpoint must agree on to be continued (everything but output options), in
    its JSON form (paths and lists as the file holds them), so the two compare equal."""
    kept = {k: v for k, v in sorted(vars(args).items()) if k not in SETTINGS_EXCLUDED}
    return dict(json.loads(json.dumps(kept, default=str)))


# runs by config, the SLOs, and the interrupted runs' partial runs (config, seed, points)
Resumed = tuple[dict[str, list[dict[str, Any]]], Slos | None, list[dict[str, Any]]]


def resumed(args: argparse.Namespace) -> Resumed:
    """With `--resume`: the runs, SLOs and the interrupted runs' points (`in_progress`: a
    run interrupted before another config's started stays there until it is resumed)
    `--json` holds, if it was written with the same settings (else an error naming the
    differences); nothing without `--resume` or without the file. `--configs` may grow
    as `--seeds` may: configs added before the same baseline (the last, whose first run
    set the SLOs) are measured, the file's runs kept."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.names}
    if not args.resume or not args.json.exists():
        return runs, None, []
    saved = load_json(args.json)
    ours = settings(args)
    theirs = saved.get("settings", {})
    if _grown(theirs.get("configs"), ours.get("configs")):
        theirs = {**theirs, "configs": ours["configs"]}
    if diffs := sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)):
        listed = ", ".join(f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in diffs)
        raise SystemExit(f"--resume: {args.json} was written with other settings ({listed})")
    for name in args.names:
        runs[name] = list(saved["runs"].get(name, []))
    slo, started = saved.get("slo"), saved.get("in_progress") or []
    if isinstance(started, dict):  # written before several could be kept
        started = [started]
    if not slo:
        return runs, None, []
    plan = {label: SLO(**values) for label, values in slo["classes"].items()}
    shared = None if slo["shared"] is None else SLO(**slo["shared"])
    return runs, (plan, shared, slo["how"]), started


def _grown(theirs: Any, ours: Any) -> bool:
    """True when `ours` (a `--configs` list) holds every config of `theirs` and ends with
    the same baseline."""
    if not isinstance(theirs, str) or not isinstance(ours, str):
        return False
    old, new = theirs.split(","), ours.split(",")
    return old[-1] == new[-1] and set(old) <= set(new)


def slo_section(slos: Slos | None, baseline: str) -> dict[str, Any] | None:
    if slos is None:
        return None
    plan, shared, how = slos
    return {
        "shared": None if shared is None else vars_slo(shared),
        "classes": {label: vars_slo(slo) for label, slo in plan.items()},
        "how": how,
        "baseline": baseline,
    }


def load_json(path: Path) -> Any:
    """A comparison file, gzip-compressed when its name ends in `.gz` (its records make an
    uncompressed file several MB, so the committed ones are kept compressed)."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def save_json(path: Path, document: Mapping[str, Any]) -> None:
    """Write `document` (non-finite numbers as null; gzip-compressed when the name ends in
    `.gz`) through a temporary file, so an interrupted write never leaves a truncated
    checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    data = (json.dumps(finite_or_none(document), indent=1) + "\n").encode()
    partial.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    partial.replace(path)


def stem(path: Path) -> str:
    """The name plots beside a comparison file start with: `x.json` and `x.json.gz` -> `x`."""
    name = path.name.removesuffix(".gz")
    return name.removesuffix(".json")


def write(
    document: dict[str, Any],
    path: Path,
    plots_dir: Path | None,
    cdf_rate: float | None,
    target: float,
) -> None:
    """The final JSON, with its plots (beside it, or in `plots_dir`) listed in it."""
    points = {name: rs[0]["points"] for name, rs in document["runs"].items() if rs}
    document["common_rate"] = cdf_rate or report.common_rate(points, target)
    document["plots"] = report.plot(document, plots_dir or path.parent, stem(path))
    save_json(path, document)


def replot(path: Path, plots_dir: Path | None, cdf_rate: float | None, target: float) -> int:
    """Redraw the plots of a saved comparison (optionally at another CDF rate)."""
    document = load_json(path)
    write(document, path, plots_dir, cdf_rate, document.get("target", target))
    print(json.dumps({k: v for k, v in document.items() if k != "runs"}))
    return 0


def vars_slo(slo: SLO) -> dict[str, float | None]:
    return {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
