"""What the batch API reads of the fleet it runs on: how busy more important work keeps it
(for pacing) and what a job's share of it costs (for the batch's metadata).

Unit cost: a job is charged the whole fleet (every pool's replicas, as the ingress last saw
them, at `observability.cost` prices) for the seconds it was running. That is exact on a
service the job has to itself and an upper bound when it shares one with interactive work.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from app.batch.execute import LineExecutor
from app.batch.pacing import Load, queued_ahead
from app.batch.service import BatchService, line_executor
from app.config import PDServeConfig
from app.frontend import Frontend
from app.observability.cost import PER_MILLION


def batch_service(
    config: PDServeConfig, frontend: Frontend, pools: Mapping[str, Any]
) -> BatchService:
    """The batch API of an ingress replica running lines through `frontend`; `pools`: every
    pool's handle (their routing stats show what is queued)."""
    executor = line_executor(frontend, config.batch)
    if executor.slo_class is not None:  # pacing reads the pools' queues by priority
        frontend.overload.monitor.watch(pools)
    service = BatchService(
        config.batch,
        executor,
        LoadObserver(frontend, executor, list(pools)),
        lambda active_s, num_in, num_out: unit_cost(frontend, active_s, num_in, num_out),
        {
            tenant.name: tenant.max_concurrent_requests
            for tenant in config.tenants
            if tenant.max_concurrent_requests is not None
        },
    )
    executor.idle = lambda: service.pacer.idle  # short lines prefill where they decode then
    return service


class LoadObserver:
    """More important requests running through this replica or arrived since the last
    look (shed ones included: a request shed because the job fills the pools must still
    make it back off), and whether any pool holds more important work waiting. With no
    batch class configured nothing is more important."""

    def __init__(self, frontend: Frontend, executor: LineExecutor, pools: list[str]) -> None:
        self.frontend = frontend
        self.executor = executor
        self.pools = pools
        # More important arrivals counted so far; None until the first look, which takes
        # them as its baseline (those before it are not new; the running ones still count)
        self._seen: int | None = None

    def __call__(self) -> Load:
        now = time.monotonic()
        if self.executor.slo_class is None:
            return Load(0, False, now)
        slo = self.frontend.config.admission.slo_class(self.executor.slo_class)
        assert slo is not None  # line_executor keeps only a configured class
        running = self.frontend.runner.in_flight_by_priority
        num_running = sum(n for p, n in running.items() if p < slo.priority)
        arrived = self.frontend.arrivals_by_priority
        num_arrived = sum(n for p, n in arrived.items() if p < slo.priority)
        num_new = 0 if self._seen is None else num_arrived - self._seen
        self._seen = num_arrived
        stats: list[Mapping[str, Any]] = []
        for pool in self.pools:
            snapshot = self.frontend.overload.monitor.snapshot(pool)
            if snapshot is not None:
                stats.extend(snapshot.replicas.values())
        return Load(num_running + num_new, queued_ahead(stats, slo.priority), now, num_new)


def unit_cost(frontend: Frontend, active_s: float, num_in: int, num_out: int) -> dict[str, str]:
    """The batch's cost figures, as metadata strings (module docstring)."""
    meter = frontend.telemetry.cost
    replicas = meter.replicas()
    replica_s = sum(replicas.values()) * active_s
    usd = sum(meter.usd_per_hour().values()) * active_s / 3600
    num_tokens = num_in + num_out
    figures = {
        "pdserve_active_s": f"{active_s:.3f}",
        "pdserve_replica_seconds": f"{replica_s:.3f}",
        "pdserve_usd": f"{usd:.6f}",
        "pdserve_tokens_per_s": f"{num_tokens / active_s:.1f}" if active_s > 0 else "",
        "pdserve_output_tokens_per_s": f"{num_out / active_s:.1f}" if active_s > 0 else "",
        "pdserve_usd_per_1m_tokens": f"{usd / num_tokens * PER_MILLION:.6f}" if num_tokens else "",
    }
    return {key: value for key, value in figures.items() if value}
