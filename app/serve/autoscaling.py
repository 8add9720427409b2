"""Each pool scales on its own signal: Serve custom autoscaling policies and their math.

Replicas report signals through `record_autoscaling_stats` (`replica/signals.py` names
them); Serve averages each over `look_back_period_s` per replica and calls the pool's
policy about every 100 ms:

    per-replica signals ──demand (pure)──▶ replicas needed, SLO breached?, safe to shrink?
      ──decide (pure: hysteresis, cool-downs, min/max)──▶ desired replicas
      ──Serve: upscale/downscale delays, min/max──▶ target replicas

- **prefill** (`prefill_demand`): predicted queue wait = queued prompt tokens / (replicas x
  measured prefill tokens/s) must stay under `queue_wait_fraction x ttft_slo_ms`; a TTFT p90
  over the SLO adds a replica while the queue is past the hysteresis band.
- **decode** (`decode_demand`): KV blocks in use over `target_kv_usage` of the pool's blocks
  (and, if set, running sequences over `target_running_seqs` per replica); requests queued
  for admission, or an ITL p90 over `tpot_slo_ms` while the batch (running sequences if
  `target_running_seqs` is set, else KV) is past the hysteresis band, add a replica.

Hysteresis: the pool grows as soon as demand exceeds its replicas, but shrinks (one replica
at a time) only when the remaining replicas would be loaded at most `downscale_utilization`
of target and nothing breaches. Latency counts only under load: over its SLO while the load
signal is inside that band, it is a slow or cold replica (a fresh replica's first requests,
a busy machine), which another replica would not fix, so it adds none. A pool that grew on a
latency breach shrinks only once latency is under `downscale_utilization` of its SLO (else
it would flap: the load that breached fits one replica fewer).
Cool-downs count from Serve's own record of the last scale-up / scale-down, so a decision
that Serve's delay holds back is not lost.

Every decision to change the replica count is logged once (on the Serve controller's log,
`SCALING_EVENT` then JSON: pool, current and desired count, the `signal` that drove it and
the metric values), until the decision changes; `pdserve bench autoscale` reads these.
Cold-start artefacts are kept out of the signals where they are made (`replica/signals.py`:
latency percentiles and the measured rate need several samples).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ReplicaSignals = Mapping[str, float]  # one replica's averaged signals, by name

# A child of Serve's logger: inside the controller (where policies run) it lands in the
# controller's log file (`logs/serve/controller_<pid>.log`).
logger = logging.getLogger("ray.serve.pdserve.autoscaling")
SCALING_EVENT = "pdserve-scaling-decision"  # marks a decision's log line (then its JSON)
LATENCY_SIGNALS = frozenset({"ttft_p90", "itl_p90"})


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
    calm: bool  # no breach and nothing queued unadmitted: removing a replica is allowed
    load_signal: str = ""  # the signal `replicas` comes from (the largest demand)
    breach_signal: str | None = None  # the signal over its SLO when `breached`
    latency_calm: bool = True  # latency at most `downscale_utilization` of its SLO
    values: Mapping[str, float] = field(default_factory=dict)  # the inputs, for the record

    def signal(self, current: int, desired: int) -> str:
        """The signal that drove a change from `current` to `desired` replicas: the load
        signal when its demand alone asks for more (or fits fewer), else the breach."""
        if desired > current and math.ceil(self.replicas - 1e-9) <= current:
            return self.breach_signal or self.load_signal
        return self.load_signal


def _loaded(needed: float, num_replicas: int, knobs: PolicyKnobs) -> bool:
    """Whether the load signal is past the hysteresis band (`downscale_utilization` of
    target per replica). Only then does a latency breach count: latency over its SLO with no
    load to share out is a slow or cold replica (its first requests), not a missing one."""
    return needed > knobs.downscale_utilization * num_replicas


def prefill_demand(replicas: Sequence[ReplicaSignals], knobs: PolicyKnobs) -> Demand:
    """Replicas that keep the predicted queue wait under `queue_wait_fraction` of the TTFT
    SLO. The rate is the median measured tokens/s (the configured guess until measured). A
    TTFT p90 over the SLO is a breach while the queue is past the hysteresis band."""
    queued = sum(r.get("queued_prompt_tokens", 0.0) for r in replicas)
    measured = [r["prefill_tokens_per_s"] for r in replicas if r.get("prefill_tokens_per_s")]
    rate = statistics.median(measured) if measured else knobs.prefill_tokens_per_s
    wait_budget_s = knobs.queue_wait_fraction * knobs.ttft_slo_ms / 1000
    needed = queued / (rate * wait_budget_s)
    ttft_ms = max((r.get("ttft_p90_ms", 0.0) for r in replicas), default=0.0)
    breached = ttft_ms > knobs.ttft_slo_ms and _loaded(needed, len(replicas), knobs)
    return Demand(
        replicas=needed,
        breached=breached,
        calm=not breached,
        latency_calm=ttft_ms <= knobs.downscale_utilization * knobs.ttft_slo_ms,
        load_signal="queue_wait",
        breach_signal="ttft_p90" if breached else None,
        values={
            "queued_prompt_tokens": queued,
            "prefill_tokens_per_s": rate,
            "predicted_wait_ms": queued / (rate * max(len(replicas), 1)) * 1000,
            "ttft_p90_ms": ttft_ms,
        },
    )


def decode_demand(replicas: Sequence[ReplicaSignals], knobs: PolicyKnobs) -> Demand:
    """Replicas that hold the KV in use at `target_kv_usage` (and the running sequences at
    `target_running_seqs` each, if set). A breach: on average a request or more per replica
    queued for admission, or ITL p90 over the TPOT SLO while the batch load (the running
    sequences if `target_running_seqs` is set, else the KV) is past the hysteresis band."""
    if not replicas:
        return Demand(replicas=0.0, breached=False, calm=True)
    used = sum(r.get("kv_blocks_used", 0.0) for r in replicas)
    total = sum(r.get("kv_blocks_total", 0.0) for r in replicas)
    blocks_per_replica = total / len(replicas)
    needed = used / (blocks_per_replica * knobs.target_kv_usage) if blocks_per_replica else 0.0
    load_signal = "kv_usage"
    running = sum(r.get("num_running", 0.0) for r in replicas)
    # ITL grows with the batch: the running sequences are the load it answers to (the KV in
    # use also holds blocks reserved for prompts still being prefilled elsewhere).
    batch = needed
    if knobs.target_running_seqs is not None:
        batch = running / knobs.target_running_seqs
        if batch > needed:
            needed, load_signal = batch, "running_seqs"
    itl_ms = max(r.get("itl_p90_ms", 0.0) for r in replicas)
    waiting = sum(r.get("num_waiting", 0.0) for r in replicas) / len(replicas)
    slow = itl_ms > knobs.tpot_slo_ms and _loaded(batch, len(replicas), knobs)
    breach_signal = "waiting" if waiting >= 1.0 else "itl_p90" if slow else None
    return Demand(
        replicas=needed,
        breached=breach_signal is not None,
        calm=not slow and waiting < 0.5,
        latency_calm=itl_ms <= knobs.downscale_utilization * knobs.tpot_slo_ms,
        load_signal=load_signal,
        breach_signal=breach_signal,
        values={
            "kv_usage": used / total if total else 0.0,
            "num_running": running,
            "num_waiting": waiting,
            "itl_p90_ms": itl_ms,
        },
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
        # A pool that grew for latency shrinks only once latency is well under its SLO:
        # its load alone (inside the band) did not ask for the replica, so it cannot say
        # the replica is no longer needed.
        if ctx.policy_state.get("grew_for_latency") and not demand.latency_calm:
            demand = dataclasses.replace(demand, calm=False)
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
        decision = None
        if desired != current:
            decision = [desired, demand.signal(current, desired)]
            if decision != ctx.policy_state.get("decision"):
                logger.info("%s %s", SCALING_EVENT, json.dumps(event(ctx, desired, demand)))
            state["grew_for_latency"] = desired > current and decision[1] in LATENCY_SIGNALS
        state["decision"] = decision
        return desired, state


def event(ctx: Any, desired: int, demand: Demand) -> dict[str, Any]:
    """The record of one scaling decision (`ctx`: the `AutoscalingContext` it was made in)."""
    current = ctx.target_num_replicas
    return {
        "time": ctx.current_time,
        "app": ctx.app_name,
        "pool": ctx.deployment_name,
        "current": current,
        "desired": desired,
        "signal": demand.signal(current, desired),
        "demand_replicas": round(demand.replicas, 3),
        **{name: round(value, 3) for name, value in demand.values.items()},
    }


class PrefillPolicy(_PoolPolicy):
    """Prefill pools: queue wait against the TTFT SLO (`prefill_demand`)."""

    _demand = staticmethod(prefill_demand)


class DecodePolicy(_PoolPolicy):
    """Decode pools: KV occupancy and ITL against the TPOT SLO (`decode_demand`)."""

    _demand = staticmethod(decode_demand)
