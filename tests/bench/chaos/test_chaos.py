"""`pdserve bench chaos` end to end: a short run on the tiny model with one real fault.

`cpu-disagg` on the built-in tiny model for 25 s at 2 requests/s; 8 s in, the prefill
replica process is SIGKILLed (Serve restarts it; decode retries or prefills locally). Every
request must be answered correctly, nothing may hang or leak, and the JSON must carry the
documented fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main

pytestmark = pytest.mark.slow

SUMMARY_INTS = ("sent", "completed", "failed_clean", "failed_unclean", "hung", "wrong")


def test_bench_chaos_prefill_kill(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chaos.json"
    argv = ["bench", "chaos", "--config", "cpu-disagg", "--model", str(tiny_model_dir)]
    argv += ["--duration", "25", "--rate", "2", "--seed", "1", "--no-progress"]
    argv += ["--faults", "kill", "--targets", "prefill", "--first-fault", "8"]
    argv += ["--fault-every", "100", "--quiet-tail", "5", "--num-short", "6", "--num-long", "6"]
    argv += ["--json", str(out)]
    assert main(argv) == 0

    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    document = json.loads(out.read_text())
    for field in (*SUMMARY_INTS, "leaked_blocks", "failed_on_killed_decode", "failed_elsewhere"):
        assert isinstance(document[field], int), field
        assert printed[field] == document[field], field
    requests = document["requests"]
    assert document["sent"] == len(requests) > 10
    outcomes = [r["outcome"] for r in requests]
    assert document["sent"] == sum(
        document[k] for k in ("completed", "failed_clean", "failed_unclean", "hung")
    )
    assert {r["label"] for r in requests} == {"short", "long"}
    assert {r["stream"] for r in requests} == {True, False}

    [fault] = document["faults"]
    assert (fault["what"], fault["target"]) == ("SIGKILL", "prefill")
    assert fault["at_s"] >= 8
    assert fault["restart_s"] is not None and fault["recovery_s"] is not None

    # A prefill replica's death costs no request: retried or prefilled on decode.
    assert outcomes == ["completed"] * len(requests), [r for r in requests if r["error"]][:3]
    assert document["wrong"] == 0
    assert document["hung"] == 0
    assert document["leaked_blocks"] == 0
    assert document["probes"].get("wrong", 0) == 0
    assert Path(document["plot"]).is_file()
