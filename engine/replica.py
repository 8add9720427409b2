"""What both pools' servers share: an engine on its own thread, plus stats for routing.

Prefill and decode servers are plain classes (Ray Serve wraps them in `app/`), so they are
constructible and testable without Ray.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv_cache import KVCache


def _step_ms(step_times: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Mean step duration, and mean time from one step's start to the next one's when the
    steps ran back to back (the difference is time the loop spent outside steps)."""
    if not step_times:
        return {"mean_step_ms": 0.0, "mean_step_interval_ms": 0.0}
    durations = [seconds for _, seconds in step_times]
    starts = [start for start, _ in step_times]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False) if b - a < 1.0]
    return {
        "mean_step_ms": 1000 * sum(durations) / len(durations),
        "mean_step_interval_ms": 1000 * sum(gaps) / len(gaps) if gaps else 0.0,
    }


def model_id_for(model_config: ModelConfig, model_dir: str) -> str:
    """What both ends of a KV transfer must agree on: the model and its shape."""
    mc = model_config
    name = os.path.basename(model_dir.rstrip("/"))
    return f"{name}/{mc.architecture}/{mc.num_hidden_layers}x{mc.hidden_size}/{mc.vocab_size}"


def replica_name(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


class EngineReplica:
    """An engine plus its loop thread; counts what it served."""

    def __init__(self, role: str, config: EngineConfig, kv_cache: KVCache | None = None):
        self.role = role
        self.name = replica_name(role)
        self.engine = Engine(config, kv_cache=kv_cache)
        self.loop = AsyncEngine(self.engine)
        self.counters: Counter[str] = Counter()
        self.started_at = time.time()

    @property
    def model_id(self) -> str:
        return model_id_for(self.engine.model_config, self.engine.model_dir)

    def kv_stats(self) -> dict[str, Any]:
        """Block pool occupancy; read on the engine thread so the numbers are consistent."""
        return self.loop.call(self._read_kv_stats).result(timeout=30)

    async def kv_stats_async(self) -> dict[str, Any]:
        """`kv_stats` without blocking the caller's event loop."""
        return await self.loop.call_async(self._read_kv_stats)

    def _read_kv_stats(self) -> dict[str, Any]:
        """Engine thread only."""
        scheduler = self.engine.scheduler
        return {
            "num_blocks": self.engine.kv_spec.num_blocks,
            "num_free_blocks": self.engine.kv_manager.num_free_blocks,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_waiting_for_kv": len(scheduler.waiting_for_kv),
            "num_held": len(scheduler.held),
            "num_preemptions": scheduler.num_preemptions,
            **_step_ms(list(self.engine.step_times)),
            "queued_tokens": sum(r.num_uncomputed_tokens for r in scheduler.waiting)
            + sum(r.num_uncomputed_tokens for r in scheduler.running),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "replica": self.name,
            "role": self.role,
            **self.kv_stats(),
            "counters": dict(self.counters),
        }

    async def routing_stats(self) -> dict[str, Any]:
        """What the replica-choosing router reads (`record_routing_stats` in Serve)."""
        kv = await self.kv_stats_async()
        return {
            "queued_tokens": kv["queued_tokens"],
            "num_free_blocks": kv["num_free_blocks"],
            "num_blocks": kv["num_blocks"],
            "num_running": kv["num_running"],
        }

    def shutdown(self) -> None:
        self.loop.shutdown()
