"""`bench compare --resume`: which checkpoints it continues (settings that must match, and
the `--seeds` and `--configs` that may grow), on files written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.compare.main import parse_args
from bench.compare.store import resumed, settings

RUN = {"seed": 0, "goodput": {"goodput": 0.25}, "points": []}
SLO = {
    "shared": {"ttft_ms": 1000.0, "tpot_ms": 50.0},
    "classes": {"short": {"ttft_ms": 1000.0, "tpot_ms": 50.0}},
    "how": "given",
}


def checkpoint(tmp_path: Path, *argv: str) -> Path:
    """A file written by `bench compare <argv>` whose baseline's seed-0 run is done."""
    out = tmp_path / "compare.json"
    args = parse_args([*argv, "--json", str(out)])
    document = {"settings": settings(args), "runs": {"cpu-colocated": [RUN]}, "slo": SLO}
    out.write_text(json.dumps(document))
    return out


def test_configs_may_grow_before_the_same_baseline(tmp_path: Path) -> None:
    out = checkpoint(tmp_path, "--configs", "cpu-disagg,cpu-colocated")
    args = parse_args(
        ["--configs", "cpu-disagg,cpu-adaptive,cpu-colocated", "--json", str(out), "--resume"]
    )
    runs, slos, started = resumed(args)
    assert runs == {"cpu-disagg": [], "cpu-adaptive": [], "cpu-colocated": [RUN]}
    assert slos is not None and slos[2] == "given" and started == []


@pytest.mark.parametrize(
    "configs",
    [
        "cpu-disagg,cpu-adaptive",  # another baseline: the SLOs came from cpu-colocated
        "cpu-adaptive,cpu-colocated",  # cpu-disagg dropped
    ],
)
def test_other_configs_are_refused(tmp_path: Path, configs: str) -> None:
    out = checkpoint(tmp_path, "--configs", "cpu-disagg,cpu-colocated")
    args = parse_args(["--configs", configs, "--json", str(out), "--resume"])
    with pytest.raises(SystemExit, match="configs: 'cpu-disagg,cpu-colocated' ->"):
        resumed(args)


def test_every_interrupted_run_is_kept(tmp_path: Path) -> None:
    """A run interrupted before another config's started stays in `in_progress` beside it
    (a list); a file from before keeps its one run (a dict)."""
    out = checkpoint(tmp_path, "--configs", "cpu-disagg,cpu-colocated")
    partial = {"config": "cpu-disagg", "seed": 0, "rate_start": 0.5, "points": [{"rate": 0.5}]}
    document = json.loads(out.read_text())
    args = parse_args(["--configs", "cpu-disagg,cpu-colocated", "--json", str(out), "--resume"])
    for in_progress, expected in [(partial, [partial]), ([partial, partial], [partial] * 2)]:
        out.write_text(json.dumps({**document, "in_progress": in_progress}))
        assert resumed(args)[2] == expected
    out.write_text(json.dumps({**document, "in_progress": None}))
    assert resumed(args)[2] == []


def test_an_interrupted_search_replays_its_points_then_measures_on() -> None:
    """A run built from a checkpoint answers its search's first probes with the recorded
    points (none deployed again), keeps its isolated figures, and asks next for the rate a
    search that had just measured them would; a point recorded at another rate (settings
    changed since) is measured again."""
    from bench.compare.run import ConfigRun

    argv = ["--configs", "cpu-disagg,cpu-colocated", "--max-points", "3", "--json", "x.json"]
    args = parse_args(argv)
    live = ConfigRun("cpu-disagg", 0, args, 1.0)
    first = {"rate": live.stepper.next_rate(), "attainment": 1.0, "started_at": 1.0}
    live.stepper.record(first["rate"], 1.0)
    isolated = {"short": {"ttft_ms": 10.0, "tpot_ms": 2.0}}
    checkpoint = {"rate_start": 1.0, "points": [first], "isolated_before": isolated}
    run = ConfigRun("cpu-disagg", 0, args, 4.0, checkpoint)
    assert run.resumed_points == 1 and run.points == [first] and run.rate_start == 1.0
    assert run.isolated_before == isolated and not run.done
    assert run.stepper.next_rate() == live.stepper.next_rate() is not None
    assert run.partial()["points"] == [first]

    moved = {**checkpoint, "points": [{**first, "rate": 3.0}]}
    again = ConfigRun("cpu-disagg", 0, args, 1.0, moved)
    assert again.resumed_points == 0 and again.points == []
