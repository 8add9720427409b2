"""`EngineReplica` with tensor parallelism on the CPU (gloo): its health check fails once a
worker process has died, and its shutdown stops the worker processes."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

from engine.config import EngineConfig
from replica.engine_replica import EngineReplica
from tests.engine.processes import EXIT_TIMEOUT_S, gone, wait_gone


def _replica() -> EngineReplica:
    config = replace(EngineConfig(model_dir="tiny"), num_threads=1, tensor_parallel_size=2)
    return EngineReplica("decode:test", config)


def _health_error(replica: EngineReplica) -> str | None:
    """The health check's error, waiting up to `EXIT_TIMEOUT_S` for one (a killed process
    can take a moment to be reapable: its threads exit one by one)."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while True:
        try:
            replica.check_health()
        except RuntimeError as exc:
            return str(exc)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


def test_health_check_fails_when_a_tp_worker_dies() -> None:
    replica = _replica()
    try:
        workers = replica.engine.workers
        assert workers is not None
        replica.check_health()  # every rank up: healthy
        os.kill(workers.pids[0], signal.SIGKILL)
        error = _health_error(replica)
        assert error is not None and "tensor-parallel rank 1 exited with -9" in error
    finally:
        replica.shutdown()


def test_shutdown_stops_the_tp_workers() -> None:
    replica = _replica()
    workers = replica.engine.workers
    assert workers is not None
    pids = workers.pids
    assert not any(gone(pid) for pid in pids)
    replica.shutdown()
    assert wait_gone(pids) == []
    replica.shutdown()  # idempotent
