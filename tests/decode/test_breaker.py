"""Circuit breaker state machine and the per-pool/per-replica board (injected clock)."""

from __future__ import annotations

import pytest

from decode.breaker import (
    BreakerBoard,
    BreakerSettings,
    BreakerState,
    CircuitBreaker,
    PrefillPlanner,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


SETTINGS = BreakerSettings(failure_threshold=3, cooldown_s=10.0)


def test_opens_after_n_consecutive_failures_only() -> None:
    clock = Clock()
    breaker = CircuitBreaker(SETTINGS, clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # the run of failures is broken
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.can_send()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert not breaker.can_send() and not breaker.try_send()
    assert breaker.snapshot() == {"state": "open", "consecutive_failures": 3, "num_opened": 1}


def test_half_open_admits_one_probe_then_closes_on_success() -> None:
    clock = Clock()
    breaker = CircuitBreaker(SETTINGS, clock)
    for _ in range(3):
        breaker.record_failure()
    clock.now += 9.9
    assert breaker.state is BreakerState.OPEN
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.try_send()  # the probe
    assert not breaker.try_send() and not breaker.can_send()  # only one at a time
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.try_send() and breaker.try_send()


def test_failed_probe_reopens_for_a_full_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(SETTINGS, clock)
    for _ in range(3):
        breaker.record_failure()
    clock.now += 10
    assert breaker.try_send()
    clock.now += 5
    breaker.record_failure()  # one failure is enough in half-open
    assert breaker.state is BreakerState.OPEN and breaker.num_opened == 2
    clock.now += 9
    assert not breaker.can_send()
    clock.now += 1
    assert breaker.state is BreakerState.HALF_OPEN


def test_a_lost_probe_frees_its_slot_after_a_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(SETTINGS, clock)
    for _ in range(3):
        breaker.record_failure()
    clock.now += 10
    assert breaker.try_send()  # never reports back
    clock.now += 9
    assert not breaker.try_send()
    clock.now += 1
    assert breaker.try_send()


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        BreakerSettings(failure_threshold=0)
    with pytest.raises(ValueError, match="cooldown_s"):
        BreakerSettings(cooldown_s=0)


def test_board_excludes_open_replicas_and_probes_half_open_ones() -> None:
    clock = Clock()
    board = BreakerBoard(BreakerSettings(failure_threshold=2, cooldown_s=5.0), clock)
    board.record("p", "a", ok=True)
    board.record("p", "b", ok=False)
    board.record("p", "b", ok=False)
    plan = board.plan("p")
    assert plan.remote and plan.exclude_replicas == ("b",) and plan.probe_replica is None
    assert "breaker open for b" in plan.reason
    # A retry never goes back to the replica that just failed, whatever its breaker says.
    retry = board.plan("p", failed=("a",))
    assert set(retry.exclude_replicas) == {"a", "b"} and "retry excluding failed a" in retry.reason
    clock.now += 5
    probe = board.plan("p")
    assert probe.probe_replica == "b" and probe.exclude_replicas == ()
    # While the probe is out, b is excluded again for everyone else.
    assert board.plan("p").exclude_replicas == ("b",)
    board.record("p", "b", ok=True)
    assert board.plan("p").exclude_replicas == ()
    snapshot = board.snapshot()
    assert snapshot["p"]["state"] == "closed"
    assert snapshot["p"]["replicas"]["b"] == {
        "state": "closed",
        "consecutive_failures": 0,
        "num_opened": 1,
    }


def test_board_opens_the_pool_only_for_failures_no_replica_took() -> None:
    clock = Clock()
    board = BreakerBoard(BreakerSettings(failure_threshold=2, cooldown_s=5.0), clock)
    board.record("p", "a", ok=False)
    board.record("p", "a", ok=False)  # a's breaker opens; the pool's stays closed
    assert board.plan("p").remote and board.plan("p").exclude_replicas == ("a",)
    board.record("p", None, ok=False)  # timed out before any replica took it
    board.record("p", None, ok=False)
    plan = board.plan("p")
    assert not plan.remote and plan.reason == "breaker of pool p is open"
    clock.now += 5
    assert board.plan("p").remote  # half-open: this attempt is the pool's probe
    assert not board.plan("p").remote
    board.record("p", "b", ok=True)
    assert board.snapshot()["p"]["state"] == "closed"


def test_planner_goes_local_near_the_deadline_or_with_no_replica_left() -> None:
    clock = Clock()
    board = BreakerBoard(BreakerSettings(failure_threshold=1, cooldown_s=5.0), clock)
    known: dict[str, list[str]] = {"p": ["a", "b"]}
    planner = PrefillPlanner(board, known.get)
    assert planner.plan("r1", "p", (), seconds_left=10).remote
    near = planner.plan("r2", "p", (), seconds_left=0.2)
    assert not near.remote and near.deadline_bound
    board.record("p", "b", ok=False)  # b's breaker opens
    retry = planner.plan("r3", "p", ("a",), seconds_left=10)  # a failed r3, b is open
    assert not retry.remote and not retry.deadline_bound
    assert retry.reason.startswith("every replica of pool p is excluded")
    assert planner.plan("r4", "q", (), seconds_left=10).remote  # pool q not seen yet
    snapshot = planner.snapshot()
    assert [d["request_id"] for d in snapshot["prefill_decisions"]] == ["r2", "r3"]
    assert snapshot["prefill_decisions"][0]["reason"].endswith("-> local prefill")
    assert snapshot["breakers"]["p"]["replicas"]["b"]["state"] == "open"
