"""Each pool scales on its own signal: Serve custom autoscaling policies and their math.

Replicas report signals through `record_autoscaling_stats` (`engine/signals.py` names
them); Serve averages each over `look_back_period_s` per replica and calls the pool's
policy about every 100 ms:

    per-replica signals ──demand (pure)──▶ replicas needed, SLO breached?, safe to shrink?
      ──decide (pure: hysteresis, cool-downs, min/max)──▶ desired replicas
      ──Serve: upscale/downscale delays, min/max──▶ target replicas

- **prefill** (`prefill_demand`): predicted queue wait = queued prompt tokens / (replicas x
  measured prefill tokens/s) must stay under `queue_wait_fraction x ttft_slo_ms`; a TTFT p90
  over the SLO adds a replica.
- **decode** (`decode_demand`): KV blocks in use over `target_kv_usage` of the pool's blocks
  (and, if set, running sequences over `target_running_seqs` per replica); an ITL p90 over
  `tpot_slo_ms`, or requests queued for admission, adds a replica.

Hysteresis: the pool grows as soon as demand exceeds its replicas, but shrinks (one replica
at a time) only when the remaining replicas would be loaded at most `downscale_utilization`
of target and latency is that far under its SLO. Cool-downs count from Serve's own record of
the last scale-up / scale-down, so a decision that Serve's delay holds back is not lost.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ReplicaSignals = Mapping[str, float]  # one replica's averaged signals, by name


@dataclass(frozen=True, slots=True)
class PolicyKnobs:
    """The SLO policies' settings (`AutoscalingSettings.policy_knobs()`, passed by Serve
    as `policy_kwargs`); descriptions are on `AutoscalingSettings`."""

    ttft_slo_ms: float = 1000.0
    queue_wait_fraction: float = 0.5
    prefill_tokens_per_s: float = 1000.0
    tpot_slo_ms: float = 100.0
    target_kv_usage: float = 0.7
    target_running_seqs: float | None = None
    downscale_utilization: float = 0.6
    upscale_cooldown_s: float = 10.0
    downscale_cooldown_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Demand:
    """What a pool's signals ask for."""

    replicas: float  # replicas that would bring the load signal to its target
    breached: bool  # latency over its SLO (or work queued unadmitted): at least one more
    calm: bool  # latency well under its SLO: removing a replica is allowed


def prefill_demand(replicas: Sequence[ReplicaSignals], knobs: PolicyKnobs) -> Demand:
    """Replicas that keep the predicted queue wait under `queue_wait_fraction` of the TTFT
    SLO. The rate is the median measured tokens/s (the configured guess until measured)."""
    queued = sum(r.get("queued_prompt_tokens", 0.0) for r in replicas)
    measured = [r["prefill_tokens_per_s"] for r in replicas if r.get("prefill_tokens_per_s")]
    rate = statistics.median(measured) if measured else knobs.prefill_tokens_per_s
    wait_budget_s = knobs.queue_wait_fraction * knobs.ttft_slo_ms / 1000
    ttft_ms = max((r.get("ttft_p90_ms", 0.0) for r in replicas), default=0.0)
    return Demand(
        replicas=queued / (rate * wait_budget_s),
        breached=ttft_ms > knobs.ttft_slo_ms,
        calm=ttft_ms <= knobs.downscale_utilization * knobs.ttft_slo_ms,
    )


def decode_demand(replicas: Sequence[ReplicaSignals], knobs: PolicyKnobs) -> Demand:
    """Replicas that hold the KV in use at `target_kv_usage` (and the running sequences at
    `target_running_seqs` each, if set); ITL p90 over the TPOT SLO, or on average a request
    or more per replica queued for admission, is a breach."""
    if not replicas:
        return Demand(replicas=0.0, breached=False, calm=True)
    used = sum(r.get("kv_blocks_used", 0.0) for r in replicas)
    total = sum(r.get("kv_blocks_total", 0.0) for r in replicas)
    blocks_per_replica = total / len(replicas)
    needed = used / (blocks_per_replica * knobs.target_kv_usage) if blocks_per_replica else 0.0
    if knobs.target_running_seqs is not None:
        running = sum(r.get("num_running", 0.0) for r in replicas)
        needed = max(needed, running / knobs.target_running_seqs)
    itl_ms = max(r.get("itl_p90_ms", 0.0) for r in replicas)
    waiting = sum(r.get("num_waiting", 0.0) for r in replicas) / len(replicas)
    return Demand(
        replicas=needed,
        breached=itl_ms > knobs.tpot_slo_ms or waiting >= 1.0,
        calm=itl_ms <= knobs.downscale_utilization * knobs.tpot_slo_ms and waiting < 0.5,
    )


def decide(
    demand: Demand,
    current: int,
    *,
    now: float,
    last_scale_up: float | None,
    last_scale_down: float | None,
    knobs: PolicyKnobs,
    min_replicas: int,
    max_replicas: int,
) -> int:
    """The replica count to ask for, given `demand` and the `current` target count.

    Up: to `ceil(demand.replicas)` (at least one more on a breach), unless a scale-up
    happened within `upscale_cooldown_s`. Down: by one, when `demand.calm`, the demand fits
    `current - 1` replicas at `downscale_utilization` of target, and no scaling happened
    within `downscale_cooldown_s`. Always within `min_replicas..max_replicas`.
    """
    wanted = math.ceil(demand.replicas - 1e-9)
    if demand.breached:
        wanted = max(wanted, current + 1)
    if wanted > current:
        cooling = last_scale_up is not None and now - last_scale_up < knobs.upscale_cooldown_s
        desired = current if cooling else wanted
    else:
        last_change = max(
            (t for t in (last_scale_up, last_scale_down) if t is not None), default=None
        )
        cooling = last_change is not None and now - last_change < knobs.downscale_cooldown_s
        fits_fewer = demand.replicas <= (current - 1) * knobs.downscale_utilization
        desired = current - 1 if demand.calm and fits_fewer and not cooling else current
    return min(max(desired, min_replicas), max_replicas)


def per_replica(aggregated: Mapping[str, Mapping[Any, float]] | None) -> list[dict[str, float]]:
    """Serve's `aggregated_metrics` (signal -> replica -> value) as one dict per replica."""
    by_replica: dict[Any, dict[str, float]] = {}
    for name, values in (aggregated or {}).items():
        for replica, value in values.items():
            by_replica.setdefault(replica, {})[name] = value
    return list(by_replica.values())


class _PoolPolicy:
    """A Serve custom autoscaling policy (class form: Serve builds it once per deployment
    with `policy_kwargs` and calls it with an `AutoscalingContext` each control tick)."""

    _demand = staticmethod(prefill_demand)

    def __init__(self, **knobs: Any) -> None:
        self.knobs = PolicyKnobs(**knobs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """`ctx`: Serve's `AutoscalingContext`. Returns (desired replicas, policy state);
        Serve then applies its up/down delays and the min/max bounds."""
        signals = per_replica(ctx.aggregated_metrics)
        current = ctx.target_num_replicas
        if not signals:  # no replica has reported yet: hold
            return current, dict(ctx.policy_state)
        demand = self._demand(signals, self.knobs)
        desired = decide(
            demand,
            current,
            now=ctx.current_time,
            last_scale_up=ctx.last_scale_up_time,
            last_scale_down=ctx.last_scale_down_time,
            knobs=self.knobs,
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas,
        )
        state = {**ctx.policy_state, "demand_replicas": demand.replicas}
        return desired, state


class PrefillPolicy(_PoolPolicy):
    """Prefill pools: queue wait against the TTFT SLO (`prefill_demand`)."""

    _demand = staticmethod(prefill_demand)


class DecodePolicy(_PoolPolicy):
    """Decode pools: KV occupancy and ITL against the TPOT SLO (`decode_demand`)."""

    _demand = staticmethod(decode_demand)
