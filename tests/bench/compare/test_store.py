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
