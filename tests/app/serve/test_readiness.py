"""Readiness of the app's pools from Serve's status: by the app's own name, cached, shared by
concurrent callers, and logged once per change of state."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.common import ReplicaState

from app.serve.readiness import Readiness, logger, num_running, pool_replicas

POOLS = ("prefill", "decode")


def _status(app_name: str, running: dict[str, int]) -> Any:
    """A `serve.status()` stand-in: app `app_name` with each pool's RUNNING replicas."""
    deployments = {
        name: SimpleNamespace(replica_states={ReplicaState.RUNNING: n, ReplicaState.STARTING: 1})
        for name, n in running.items()
    }
    return SimpleNamespace(applications={app_name: SimpleNamespace(deployments=deployments)})


class Controller:
    """Answers `serve.status()` with what the test sets; counts the calls."""

    def __init__(self, status: Any) -> None:
        self.status = status
        self.num_calls = 0
        self.error: Exception | None = None

    def __call__(self) -> Any:
        self.num_calls += 1
        if self.error is not None:
            raise self.error
        return self.status


def test_counts_only_running_replicas() -> None:
    states = {ReplicaState.RUNNING: 2, ReplicaState.STARTING: 3, ReplicaState.STOPPING: 1}
    assert num_running(states) == 2
    status = _status("default", {"prefill": 1, "decode": 0})
    assert pool_replicas(status, "default", POOLS) == {"prefill": 1, "decode": 0}
    assert pool_replicas(status, "pdserve", POOLS) == {}


def test_ready_under_the_name_serve_gave_the_app() -> None:
    """`serve run app.main:app` names the app "default"; the probe asks about that name."""
    controller = Controller(_status("default", {"prefill": 1, "decode": 1}))
    observed: list[dict[str, int]] = []
    assert asyncio.run(Readiness("default", POOLS, observed.append, controller, ttl_s=0).is_ready())
    assert observed == [{"prefill": 1, "decode": 1}]
    assert not asyncio.run(Readiness("pdserve", POOLS, status=controller, ttl_s=0).is_ready())


def test_probes_are_shared_and_cached() -> None:
    controller = Controller(_status("default", {"prefill": 1, "decode": 1}))
    readiness = Readiness("default", POOLS, status=controller, ttl_s=60)

    async def many() -> list[bool]:
        return list(await asyncio.gather(*(readiness.is_ready() for _ in range(10))))

    assert asyncio.run(many()) == [True] * 10
    assert asyncio.run(readiness.is_ready())
    assert controller.num_calls == 1


def test_one_log_line_per_change_of_state(caplog: pytest.LogCaptureFixture) -> None:
    controller = Controller(_status("default", {"prefill": 1, "decode": 0}))
    readiness = Readiness("default", POOLS, status=controller, ttl_s=0)

    def probe(times: int) -> list[str]:
        caplog.clear()
        # Serve's logger (our logger's parent) does not propagate to caplog's root handler.
        logger.addHandler(caplog.handler)
        try:
            for _ in range(times):
                asyncio.run(readiness.is_ready())
        finally:
            logger.removeHandler(caplog.handler)
        assert all(record.exc_info is None for record in caplog.records)  # no tracebacks
        return [record.getMessage() for record in caplog.records]

    assert probe(3) == [
        "not ready yet: no RUNNING replica in pool(s) decode of Serve app 'default'"
    ]
    controller.status = _status("default", {"prefill": 1, "decode": 1})
    assert probe(3) == ["ready: every pool of Serve app 'default' has a RUNNING replica"]
    controller.error = TimeoutError("no answer")
    assert probe(3) == ["not ready: the Serve controller did not answer: TimeoutError('no answer')"]
    controller.error = None
    assert probe(2) == ["ready: every pool of Serve app 'default' has a RUNNING replica"]
