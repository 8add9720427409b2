"""What both pools' servers share: an engine on its own thread, stats for routing, and the
whole-request local path (prompt and decode on this replica, no KV transfer).

Prefill and decode servers are plain classes (Ray Serve wraps them in `app/`), so they are
constructible and testable without Ray.

Stats and health never wait on the engine thread: they read what the loop published after
its latest iteration (`AsyncEngine.occupancy`, `seconds_since_progress`), so a replica's
event loop (the one streaming tokens) answers them at once however busy the engine is.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Protocol

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv_cache import KVCache
from engine.outputs import RequestOutput
from engine.request import Request, RequestSpec
from engine.tp_worker import RankEndpoints
from replica.calibration import measure_prefill_rate
from replica.prefix_digest import PrefixDigest
from replica.protocol import GenerationSpec
from replica.signals import MAX_SAMPLES, SIGNAL_WINDOW_S, busy_share

# A loop iteration (one step, or the commands between steps) taking longer than this means
# the engine thread is stuck: the replica reports unhealthy and Serve replaces it.
STALL_TIMEOUT_S = 120.0


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


class PrefillRate:
    """Prompt tokens prefilled per second: the tokens of the prompts that finished within
    the last `window_s` seconds over the time at least one of them was being computed
    (the union of their (start, end) intervals), so prompts computed in the same steps
    share that time instead of each counting it whole (four prompts in one step read as a
    quarter of the rate). Once measured, the latest rate outlives the window (a replica's
    speed outlasts its traffic). Event loop only."""

    def __init__(self, window_s: float = SIGNAL_WINDOW_S) -> None:
        self.window_s = window_s
        # (start, end, num_tokens) of recent prompts, in the order they ended
        self._prompts: deque[tuple[float, float, int]] = deque(maxlen=MAX_SAMPLES)
        self._latest = 0.0

    def add(self, num_tokens: int, start: float, end: float) -> None:
        """One prompt: `num_tokens` computed from `start` to `end` (monotonic seconds;
        ignored unless both the tokens and the span are positive)."""
        if num_tokens > 0 and end > start:
            self._prompts.append((start, end, num_tokens))

    def tokens_per_s(self, now: float | None = None) -> float:
        """The window's rate, else the latest one measured; 0.0 until the first sample."""
        since = (time.monotonic() if now is None else now) - self.window_s
        while self._prompts and self._prompts[0][1] < since:
            self._prompts.popleft()
        if self._prompts:
            tokens = sum(num_tokens for _, _, num_tokens in self._prompts)
            spans = sorted((start, end) for start, end, _ in self._prompts)
            busy, covered = 0.0, spans[0][0]
            for start, end in spans:
                if end > covered:
                    busy += end - max(start, covered)
                    covered = end
            self._latest = tokens / busy
        return self._latest


def pin_to_cores(cores: Sequence[int]) -> None:
    """Restrict this whole process to `cores`: every thread it has now (sched_setaffinity
    applies per thread), and so every thread started later, which inherits its creator's
    mask (the engine loop and torch's intra-op pool)."""
    allowed = set(cores)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), allowed)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


class ReplicaObserver(Protocol):
    """Watches one replica from inside its process (e.g. exports its metrics)."""

    def observe(self, name: str, value: float) -> None:
        """One sample of a named measurement, e.g. "queue_seconds"; never blocks."""

    def close(self) -> None:
        """The replica is shutting down (called once)."""


# Made by the server once it is built, given the server's `stats` (never blocks).
ObserverFactory = Callable[[Callable[[], dict[str, Any]]], ReplicaObserver]


class EngineReplica:
    """An engine plus its loop thread; counts what it served."""

    def __init__(
        self,
        role: str,
        config: EngineConfig,
        kv_cache: KVCache | None = None,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        cpu_affinity: Sequence[int] | None = None,
        rank_endpoints: RankEndpoints | None = None,
        calibrate: bool = False,
    ) -> None:
        """`cpu_affinity`: cores to pin the process to before the engine starts (None: as is);
        `rank_endpoints`: the TP workers' own KV transfer endpoints (`Engine`); `calibrate`:
        measure the engine's prefill rate before its loop starts
        (`replica/calibration.py`; `calibrated_tokens_per_s`, 0.0 without)."""
        if cpu_affinity is not None:
            pin_to_cores(cpu_affinity)
        self.role = role
        self.stall_timeout_s = stall_timeout_s
        self.name = replica_name(role)
        self.engine = Engine(config, kv_cache=kv_cache, rank_endpoints=rank_endpoints)
        try:
            self.calibrated_tokens_per_s = measure_prefill_rate(self.engine) if calibrate else 0.0
        except BaseException:
            self.engine.close()  # its TP workers, if any
            raise
        self.loop = AsyncEngine(self.engine)
        self.counters: Counter[str] = Counter()
        self.observers: list[ReplicaObserver] = []
        self.started_at = time.time()
        # Prompts this replica computed for whole requests, from first scheduled to first
        # token; prompts computed together share that time (event loop).
        self.local_prefill = PrefillRate()
        self._num_routing_reports = 0
        # Which prefixes this replica caches, for prefix-aware routing (routing stats).
        pool = self.engine.kv_manager.pool
        self.prefix_digest = (
            PrefixDigest(pool, self.loop.call) if pool.enable_prefix_caching else None
        )

    @property
    def model_id(self) -> str:
        return model_id_for(self.engine.model_config, self.engine.model_dir)

    def stats(self) -> dict[str, Any]:
        """Occupancy as of the engine loop's latest iteration, step timings and counters.
        Never waits on the engine thread (safe on an event loop)."""
        return {
            "replica": self.name,
            "role": self.role,
            **self.loop.occupancy,
            # deque.copy() is one C call: atomic against the engine thread's appends.
            **_step_ms(self.engine.step_times.copy()),
            # Engine time in steps, and in steps on `model.spare_num_threads` (the cores
            # other replicas leave idle, for batch lines sent on an idle service).
            "step_s": self.engine.step_seconds,
            "spare_step_s": self.engine.spare_step_seconds,
            "engine_alive": self.loop.is_alive,
            "seconds_since_progress": self.loop.seconds_since_progress,
            "counters": dict(self.counters),
        }

    async def routing_stats(self) -> dict[str, Any]:
        """What the replica-choosing router reads (`record_routing_stats` in Serve); never
        waits on the engine thread. `num_reports` makes every report differ, so Serve
        passes each on and a live idle replica's load never looks stale to the ingress
        (adaptive disaggregation and decode overflow ignore loads older than `max_age_s`)."""
        occupancy = self.loop.occupancy
        self._num_routing_reports += 1
        return {
            "replica": self.name,  # the name circuit breakers and exclusions use
            "num_reports": self._num_routing_reports,
            "queued_tokens": occupancy["queued_tokens"],
            "num_free_blocks": occupancy["num_free_blocks"],
            "num_blocks": occupancy["num_blocks"],
            "num_running": occupancy["num_running"],
            # Requests the engine holds that still compute (running, queued, awaiting KV):
            # decode overflow compares pools by it (`app/routing/overflow.py`).
            "num_sequences": occupancy["num_running"]
            + occupancy["num_waiting"]
            + occupancy["num_waiting_for_kv"],
            # Share of the recent window spent computing prompts: streams here stall then.
            "prompt_busy": busy_share(
                self.engine.prompt_steps.copy(),
                time.perf_counter(),
                SIGNAL_WINDOW_S,
                observed_since=self.engine.started_at,
            ),
            # The prefix cache's most durable blocks (`replica/prefix_digest.py`): routers
            # prefer the replica holding the longest prefix of a prompt.
            "block_size": self.engine.kv_manager.block_size,
            "prefix_digest": self.prefix_digest.current() if self.prefix_digest else b"",
        }

    def make_request(
        self, spec: RequestSpec, request_id: str | None = None, prefill_only: bool = False
    ) -> Request:
        """`spec` as an engine request (under `request_id`, default `spec.request_id`),
        checked by `Engine.make_request`: raises `InvalidRequestError` on bad input. A
        `GenerationSpec`'s `delta_interval_s` and `spare` become the request's
        `output_interval_s` and `spare`."""
        interval_s, spare = 0.0, False
        if isinstance(spec, GenerationSpec):
            interval_s, spare = spec.delta_interval_s, spec.spare
        return self.engine.make_request(
            list(spec.prompt_token_ids),
            spec.sampling_params,
            request_id=request_id or spec.request_id,
            tenant=spec.tenant,
            priority=spec.priority,
            prefill_only=prefill_only,
            output_interval_s=interval_s,
            spare=spare,
        )

    async def generate_whole(self, request: Request) -> AsyncGenerator[RequestOutput]:
        """Serve `request` whole on this engine: its prompt is computed here, then decoded;
        no KV transfer. Each prompt's span feeds `local_prefill`, from which the ingress
        weighs a local prefill's cost (not a spare request's: it may have run on more
        threads than others get): tokens computed over the time from its first step to its
        first token (prompts computed in the same steps share their time: `PrefillRate`),
        the steps of other requests it shared included, its wait before that step not. The
        ingress adds that wait itself (the replica's `queued_tokens` at this rate); a rate
        over submit-to-first-token counted it twice, and one burst (a prompt queued behind
        a dozen) left a rate 5-10x too low that no later prompt came to correct, since the
        cost it predicted kept every prompt off the replica. A prompt preempted before its
        first token is not timed either (its time would hold the wait to be scheduled
        again)."""
        timed = not request.spare
        async with contextlib.aclosing(self.loop.generate(request)) as deltas:
            async for delta in deltas:
                first = delta.new_token_ids and delta.num_output_tokens == len(delta.new_token_ids)
                scheduled = request.first_scheduled_time
                if timed and first and scheduled is not None and not request.num_preemptions:
                    # The first token: the prompt was computed by now.
                    computed = len(request.prompt_token_ids) - delta.num_cached_tokens
                    self.local_prefill.add(computed, scheduled, time.monotonic())
                yield delta

    def check_health(self) -> None:
        """Raise unless the engine loop is alive and not stuck, and every tensor-parallel
        worker process still runs (cheap: reads a few fields, polls the worker processes)."""
        if not self.loop.is_alive:
            raise RuntimeError(f"{self.role} engine loop is dead")
        workers = self.engine.workers
        problem = workers.problem() if workers is not None else None
        if problem is not None:
            raise RuntimeError(f"{self.role} engine cannot serve: {problem}")
        stalled_s = self.loop.seconds_since_progress
        if stalled_s > self.stall_timeout_s:
            raise RuntimeError(
                f"{self.role} engine loop has made no progress for {stalled_s:.0f} s "
                f"(limit {self.stall_timeout_s:.0f} s)"
            )

    def observe(self, name: str, value: float) -> None:
        """Hand one sample (e.g. a latency in seconds) to every observer."""
        for observer in self.observers:
            observer.observe(name, value)

    def shutdown(self) -> None:
        """Close the observers, stop the engine loop, then the engine's tensor-parallel
        workers (idempotent; the prefill and decode servers' `shutdown` call it)."""
        for observer in self.observers:
            observer.close()
        self.observers.clear()
        self.loop.shutdown()
        self.engine.close()
