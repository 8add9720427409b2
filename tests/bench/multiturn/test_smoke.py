"""`pdserve bench multiturn` end to end on the tiny model: two conversations of three turns
against cpu-adaptive (prompts long enough to be prefilled remotely), its JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main as bench_main

pytestmark = pytest.mark.slow


def test_multiturn_smoke(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "multiturn.json"
    argv = ["multiturn", "--configs", "cpu-adaptive", "--model", str(tiny_model_dir)]
    argv += ["--conversations", "2", "--turns", "3", "--first-len", "200", "--user-len", "20"]
    argv += ["--turn-output-len", "6", "--think-s", "0.2", "--json", str(out), "--no-progress"]
    assert bench_main(argv) == 0
    document = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == document
    report = document["configs"]["cpu-adaptive"]
    assert report["failed"] == 0 and report["wrong"] == 0, report["errors"]
    assert [row["turn"] for row in report["turns"]] == [1, 2, 3]
    assert all(row["num_completed"] == 2 for row in report["turns"])
    assert report["turns"][0]["computed_fraction"] == 1.0  # a first turn finds nothing cached
    assert report["computed_fraction_later_turns"] < 1.0  # later turns find their history
    assert report["hit_rate"] is not None
    assert "decode" in report["prefix_routing"]
    assert Path(document["plot"]).read_bytes()[:4] == b"\x89PNG"
