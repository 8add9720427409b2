"""`pdserve bench autoscale`'s ramp, arrivals and report (pure; the run itself is a benchmark):
the decision records the policies log are found again, paired with the replica changes they
caused, and the verdict holds a pool to scaling up on its own signal in its own phase."""

from __future__ import annotations

import json

import pytest

from app.serve.autoscaling import SCALING_EVENT
from bench.autoscale.load import Shape, arrival_times, request_body, stress_ramp
from bench.autoscale.report import attribute, replica_changes, scaling_events, verdict

BASE, LONG_PROMPTS, LONG_OUTPUTS = Shape(256, 32), Shape(2048, 4), Shape(48, 192)
RAMP = stress_ramp(
    rate=2.0,
    peaks={"prefill": 8.0, "decode": 6.0},
    low_s=10.0,
    ramp_s=10.0,
    peak_s=20.0,
    base=BASE,
    shapes={"prefill": LONG_PROMPTS, "decode": LONG_OUTPUTS},
)
# Phases: low 0-10, prefill-up 10-20, prefill-peak 20-40, prefill-down 40-50, low 50-60,
# decode-up 60-70, decode-peak 70-90, decode-down 90-100, low 100-110.


def test_ramp_shape() -> None:
    assert RAMP.duration_s == 110.0
    assert [p.name for p in RAMP.phases][:5] == [
        "low",
        "prefill-up",
        "prefill-peak",
        "prefill-down",
        "low",
    ]
    assert RAMP.rate_at(5.0) == 2.0  # low
    assert RAMP.rate_at(15.0) == pytest.approx(5.0)  # halfway up
    assert RAMP.rate_at(25.0) == 8.0 and RAMP.rate_at(39.9) == 8.0  # the prefill peak
    assert RAMP.rate_at(45.0) == pytest.approx(5.0)  # halfway down
    assert RAMP.rate_at(55.0) == 2.0  # low again
    assert RAMP.rate_at(65.0) == pytest.approx(4.0)  # halfway up to the decode peak
    assert RAMP.rate_at(80.0) == 6.0  # the decode peak, at its own rate
    assert RAMP.peak_rate == 8.0
    assert RAMP.rate_at(110.0) == 0.0 and RAMP.rate_at(-1.0) == 0.0
    prefill_peak, _ = RAMP.phase_at(30.0) or (None, 0)
    decode_peak, _ = RAMP.phase_at(80.0) or (None, 0)
    assert prefill_peak is not None and prefill_peak.shape == LONG_PROMPTS
    assert prefill_peak.stresses == "prefill"
    assert decode_peak is not None and decode_peak.shape == LONG_OUTPUTS
    assert RAMP.phase_at(55.0) is not None and RAMP.phase_at(55.0)[0].stresses is None  # type: ignore[index]


def test_arrivals_follow_the_ramp() -> None:
    times = arrival_times(RAMP, seed=1)
    assert times == sorted(times) and times[0] >= 0 and times[-1] < RAMP.duration_s
    assert times == arrival_times(RAMP, seed=1)  # reproducible
    # Expected counts: 20 in the first and last low phases (10 s at 2/s each), 160 in the
    # prefill peak (20 s at 8/s).
    low = sum(1 for t in times if t < 10 or t >= 100)
    peak = sum(1 for t in times if 20 <= t < 40)
    assert 25 <= low <= 60 and 120 <= peak <= 200
    assert peak > 2.5 * low


def test_request_bodies_have_the_shape_and_no_shared_prefix() -> None:
    first, second = (request_body("m", LONG_PROMPTS, i) for i in (1, 2))
    assert len(first["prompt"]) == 2048 and first["max_tokens"] == 4 and first["ignore_eos"]
    assert first["prompt"][:16] != second["prompt"][:16]


def _log_line(t: float, pool: str, current: int, desired: int, signal: str, app: str) -> str:
    record = {"time": t, "app": app, "pool": pool, "current": current, "desired": desired}
    record |= {"signal": signal, "demand_replicas": 1.7}
    return f"INFO 2026-12-01 controller 1 -- {SCALING_EVENT} {json.dumps(record)}"


def test_report_pairs_changes_with_their_decisions_and_judges_each_pool() -> None:
    wall = 1000.0
    lines = [
        "INFO unrelated controller line",
        _log_line(wall + 22, "prefill", 1, 2, "queue_wait", "pdserve"),
        _log_line(wall + 23, "prefill", 1, 2, "queue_wait", "another-app"),
        _log_line(wall + 52, "prefill", 2, 1, "queue_wait", "pdserve"),
        _log_line(wall + 66, "decode", 1, 2, "running_seqs", "pdserve"),
        _log_line(wall + 104, "decode", 2, 1, "running_seqs", "pdserve"),
        f"{SCALING_EVENT} {{not json",
    ]
    events = scaling_events(lines, "pdserve", wall)
    assert [e["t_s"] for e in events] == [22, 52, 66, 104]
    counts = [(0, 1, 1), (30, 2, 1), (60, 1, 1), (75, 1, 2), (110, 1, 1)]
    samples = [{"t_s": t, "prefill": p, "decode": d} for t, p, d in counts]
    changes = replica_changes(samples, ["prefill", "decode"])
    assert [(c["pool"], c["from"], c["to"]) for c in changes] == [
        ("prefill", 1, 2),
        ("prefill", 2, 1),
        ("decode", 1, 2),
        ("decode", 2, 1),
    ]
    scaled = attribute(changes, events, RAMP)
    assert [(s["signal"], s["phase"]) for s in scaled] == [
        ("queue_wait", "prefill-peak"),
        ("queue_wait", "low"),
        ("running_seqs", "decode-up"),
        ("running_seqs", "low"),
    ]
    roles = {"prefill": "prefill", "decode": "decode"}
    mins = {"prefill": 1, "decode": 1}
    result = verdict(scaled, roles, mins, mins, RAMP)
    assert result["prefill"]["ok"] and result["prefill"]["scaled_up_on"] == ["queue_wait"]
    assert result["decode"]["ok"] and result["decode"]["scaled_up_on"] == ["running_seqs"]
    # The decode pool scaling up in the prefill phase (cross-talk) fails its verdict, as does
    # a pool that never came back to its minimum.
    stray = attribute(
        [{"t_s": 35, "pool": "decode", "from": 1, "to": 2}],
        [{"t_s": 33, "pool": "decode", "current": 1, "desired": 2, "signal": "itl_p90"}],
        RAMP,
    )
    bad = verdict([*scaled, *stray], roles, mins, {"prefill": 2, "decode": 1}, RAMP)
    assert not bad["decode"]["ok"] and bad["decode"]["scaled_up_elsewhere"] == [
        {"t_s": 35, "phase": "prefill-peak", "signal": "itl_p90"}
    ]
    assert not bad["prefill"]["ok"] and not bad["prefill"]["back_to_min"]
    # So does a decision to add one there, even if Serve dropped it before a replica ran.
    wanted = {"t_s": 45.0, "pool": "decode", "current": 1, "desired": 2, "signal": "kv_usage"}
    held = verdict(scaled, roles, mins, mins, RAMP, [*events, wanted])
    assert held["prefill"]["ok"] and not held["decode"]["ok"]
    assert held["decode"]["scaled_up_elsewhere"] == [
        {"t_s": 45.0, "phase": "prefill-down", "signal": "kv_usage", "decision_only": True}
    ]
