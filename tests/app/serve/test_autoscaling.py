"""The autoscaling policies' math on recorded metric series: ramp up, spike, ramp down,
noisy flat; plus the Serve entry points on a real `AutoscalingContext`."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence

import pytest
from ray.serve.config import AutoscalingContext

from app.config import AutoscalingSettings, PoolConfig
from app.serve.autoscaling import (
    SCALING_EVENT,
    DecodePolicy,
    Demand,
    PolicyKnobs,
    PrefillPolicy,
    decide,
    decode_demand,
    logger,
    per_replica,
    prefill_demand,
)

KNOBS = PolicyKnobs(
    ttft_slo_ms=1000,
    queue_wait_fraction=0.5,
    prefill_tokens_per_s=1000,
    tpot_slo_ms=100,
    target_kv_usage=0.7,
    downscale_utilization=0.6,
    upscale_cooldown_s=10,
    downscale_cooldown_s=30,
)
TICK_S = 1.0
MIN, MAX = 1, 4


def _prefill_signals(queued_total: float, ttft_ms: float, n: int) -> list[dict[str, float]]:
    """`n` replicas sharing the queue evenly, each measuring 1000 tokens/s."""
    return [
        {
            "queued_prompt_tokens": queued_total / n,
            "prefill_tokens_per_s": 1000.0,
            "ttft_p90_ms": ttft_ms,
        }
        for _ in range(n)
    ]


def _decode_signals(used_total: float, itl_ms: float, n: int) -> list[dict[str, float]]:
    """`n` replicas of 100 blocks sharing `used_total` blocks evenly."""
    return [
        {
            "kv_blocks_used": used_total / n,
            "kv_blocks_total": 100.0,
            "num_running": 1.0,
            "num_waiting": 0.0,
            "num_waiting_for_kv": 0.0,
            "itl_p90_ms": itl_ms,
        }
        for _ in range(n)
    ]


def _run(
    series: Sequence[float],
    demand_of: Callable[[float, int], Demand],
    start: int = MIN,
) -> list[int]:
    """Replay `series` (one load value per tick) through `decide`, as Serve would with no
    extra delay: scaling happens at once and is recorded as the last scale-up/down."""
    current, last_up, last_down = start, None, None
    counts = []
    for tick, load in enumerate(series):
        now = tick * TICK_S
        desired = decide(
            demand_of(load, current),
            current,
            now=now,
            last_scale_up=last_up,
            last_scale_down=last_down,
            knobs=KNOBS,
            min_replicas=MIN,
            max_replicas=MAX,
        )
        if desired > current:
            last_up = now
        elif desired < current:
            last_down = now
        current = desired
        counts.append(current)
    return counts


def _prefill(load: float, n: int) -> Demand:
    # load: queued prompt tokens; TTFT modelled as the queue wait plus a small compute time
    ttft_ms = load / (n * 1000) * 1000 + 50
    return prefill_demand(_prefill_signals(load, ttft_ms, n), KNOBS)


def _decode(load: float, n: int) -> Demand:
    # load: KV blocks in use; ITL grows with each replica's occupancy
    itl_ms = 20 + 60 * (load / n) / 100
    return decode_demand(_decode_signals(load, itl_ms, n), KNOBS)


def _steps_apart(counts: list[int], down: bool) -> list[int]:
    changes = [
        i
        for i in range(1, len(counts))
        if (counts[i] < counts[i - 1]) == down and counts[i] != counts[i - 1]
    ]
    return [b - a for a, b in zip(changes, changes[1:], strict=False)]


def test_prefill_demand_is_queue_wait_over_budget() -> None:
    # 1500 queued tokens at 1000 tok/s = 1.5 s of work; budget 0.5 s per replica -> 3
    demand = prefill_demand(_prefill_signals(1500, 400, 2), KNOBS)
    assert demand.replicas == 3.0 and not demand.breached and demand.calm
    unmeasured = [{"queued_prompt_tokens": 1000.0, "prefill_tokens_per_s": 0.0}]
    assert prefill_demand(unmeasured, PolicyKnobs(prefill_tokens_per_s=500)).replicas == 4.0
    # TTFT over the SLO is a breach while the queue is past the hysteresis band (0.6 of
    # the 500-token budget per replica), not with nothing queued (a slow or cold replica).
    slow = prefill_demand(_prefill_signals(400, 1500, 1), KNOBS)
    assert slow.breached and not slow.calm and slow.replicas == 0.8
    assert slow.signal(1, 2) == "ttft_p90" and slow.breach_signal == "ttft_p90"
    idle_but_slow = prefill_demand(_prefill_signals(0, 1500, 1), KNOBS)
    assert not idle_but_slow.breached and idle_but_slow.calm
    assert demand.load_signal == "queue_wait" and demand.signal(2, 3) == "queue_wait"
    assert demand.values["predicted_wait_ms"] == 750.0  # 1500 tokens / (2 x 1000 tok/s)


def test_decode_demand_is_kv_usage_over_target() -> None:
    demand = decode_demand(_decode_signals(140, 30, 2), KNOBS)  # 140 of 200 blocks at 0.7
    assert demand.replicas == 2.0 and not demand.breached and demand.calm
    assert demand.load_signal == "kv_usage" and demand.values["kv_usage"] == 0.7
    slow = decode_demand(_decode_signals(50, 150, 1), KNOBS)  # ITL over SLO, KV past band
    assert slow.breached and slow.signal(1, 2) == "itl_p90"
    assert not decode_demand(_decode_signals(10, 150, 1), KNOBS).breached  # nearly idle
    queued = _decode_signals(10, 30, 1)
    queued[0]["num_waiting"] = 3.0
    assert decode_demand(queued, KNOBS).breached
    assert decode_demand(queued, KNOBS).signal(1, 2) == "waiting"
    seqs = [{**s, "num_running": 12.0} for s in _decode_signals(10, 30, 2)]
    knobs = PolicyKnobs(target_running_seqs=8)
    assert decode_demand(seqs, knobs).replicas == 3.0
    assert decode_demand(seqs, knobs).signal(2, 3) == "running_seqs"


def test_ramp_up_scales_up_to_max_and_never_down() -> None:
    for run, top in ((_prefill, 3000.0), (_decode, 400.0)):
        series = [top * i / 40 for i in range(41)] + [top] * 20
        counts = _run(series, run)
        assert counts[0] == MIN and counts[-1] == MAX
        assert all(b >= a for a, b in zip(counts, counts[1:], strict=False)), counts
        assert all(gap >= KNOBS.upscale_cooldown_s for gap in _steps_apart(counts, down=False))


def test_spike_scales_up_then_back_down_after_cooldown() -> None:
    for run, high in ((_prefill, 2500.0), (_decode, 300.0)):
        series = [10.0] * 5 + [high] + [10.0] * 120
        counts = _run(series, run)
        assert counts[:5] == [MIN] * 5
        assert counts[5] > MIN  # the spike's tick
        peak_at = 5
        first_down = next(i for i in range(peak_at, len(counts)) if counts[i] < counts[peak_at])
        assert first_down - peak_at >= KNOBS.downscale_cooldown_s
        assert counts[-1] == MIN


def test_ramp_down_removes_one_replica_per_cooldown() -> None:
    for run, top in ((_prefill, 3000.0), (_decode, 400.0)):
        series = [top * (1 - i / 60) for i in range(61)] + [0.0] * 120
        counts = _run(series, run, start=MAX)
        assert counts[0] == MAX and counts[-1] == MIN
        assert all(a - b in (0, 1) for a, b in zip(counts, counts[1:], strict=False)), counts
        assert all(gap >= KNOBS.downscale_cooldown_s for gap in _steps_apart(counts, down=True))


def test_noisy_flat_load_holds_steady() -> None:
    rng = random.Random(7)
    # 2 replicas' worth of demand at ~80% of target: inside the hysteresis band
    for run, level in ((_prefill, 800.0), (_decode, 112.0)):
        series = [level * (1 + rng.uniform(-0.15, 0.15)) for _ in range(300)]
        counts = _run(series, run, start=2)
        assert set(counts) == {2}, counts


def test_cold_start_latency_at_low_load_never_scales() -> None:
    # A fresh pool's first requests are slow (lazy initialisation): its latency p90 sits
    # far over the SLO for a window's length while hardly anything is queued or running.
    cold = [1] * 30 + [0] * 30  # 1: the window still holds the cold samples

    def prefill_run(is_cold: float, n: int) -> Demand:
        return prefill_demand(_prefill_signals(40.0, 2500.0 if is_cold else 80.0, n), KNOBS)

    def decode_run(is_cold: float, n: int) -> Demand:
        return decode_demand(_decode_signals(8.0, 400.0 if is_cold else 15.0, n), KNOBS)

    for run in (prefill_run, decode_run):
        assert set(_run([float(c) for c in cold], run)) == {MIN}
        # Nor does a fresh replica's cold latency keep a pool up once its load is gone.
        after_peak = _run([float(c) for c in cold], run, start=2)
        assert after_peak[-1] == MIN and after_peak.index(MIN) < len(cold)


def test_a_prefill_backlog_does_not_scale_decode() -> None:
    # Recorded by `pdserve bench autoscale` (cpu-autoscale) during the long-prompt phase:
    # decode KV held for prompts queued at prefill, nothing running, ITL p90 inflated by the
    # busy machine. It must not add a decode replica (it did while ITL was gated on KV).
    knobs = PolicyKnobs(tpot_slo_ms=40, target_running_seqs=6, downscale_utilization=0.5)
    signals = {
        "kv_blocks_used": 422.0,
        "kv_blocks_total": 1000.0,
        "num_running": 0.0,
        "num_waiting": 0.0,
        "itl_p90_ms": 59.8,
    }
    demand = decode_demand([signals], knobs)
    assert not demand.breached and demand.replicas == pytest.approx(0.603, abs=1e-3)
    assert (
        decide(
            demand,
            1,
            now=0,
            last_scale_up=None,
            last_scale_down=None,
            knobs=knobs,
            min_replicas=1,
            max_replicas=2,
        )
        == 1
    )
    # Its own load does: the batch past the band with ITL over the SLO, or many sequences.
    busy = {**signals, "num_running": 4.0}
    assert decode_demand([busy], knobs).signal(1, 2) == "itl_p90"
    assert decode_demand([{**busy, "num_running": 9.0}], knobs).signal(1, 2) == "running_seqs"


def test_a_real_overload_still_breaches_on_latency() -> None:
    # The queue is past the band but the measured rate is optimistic: the demand alone
    # fits one replica, the TTFT over the SLO adds the second.
    signals = _prefill_signals(450.0, 1800.0, 1)
    demand = prefill_demand(signals, KNOBS)
    assert demand.replicas < 1 and demand.breached
    assert _run([1.0] * 3, lambda _, n: prefill_demand(signals, KNOBS)) == [2, 2, 2]


def test_a_pool_grown_for_latency_shrinks_once_latency_is_calm() -> None:
    # Recorded (cpu-autoscale, long-prompt phase): one prefill replica, the queue inside the
    # band but TTFT p90 over the 300 ms SLO -> a second replica; with two, the same load fits
    # one replica fewer. It must not drop back while TTFT is still high (that flaps).
    knobs = {**AutoscalingSettings(max_replicas=2).policy_knobs(), "ttft_slo_ms": 300.0}
    knobs |= {"queue_wait_fraction": 0.25, "downscale_utilization": 0.5}
    policy = PrefillPolicy(**knobs)

    def signals(queued: float, ttft_ms: float) -> dict[str, dict[str, float]]:
        return {
            "queued_prompt_tokens": {"r": queued},
            "prefill_tokens_per_s": {"r": 14000.0},
            "ttft_p90_ms": {"r": ttft_ms},
        }

    up, state = policy(_context(signals(700, 330), 1, capacity_adjusted_max_replicas=2))
    assert up == 2 and state["grew_for_latency"]
    long_ago = {"last_scale_up_time": 0.0, "current_time": 1000.0, "policy_state": state}
    assert policy(_context(signals(180, 330), 2, **long_ago))[0] == 2  # still slow: hold
    assert policy(_context(signals(180, 120), 2, **long_ago))[0] == 1  # calm: shrink
    # A pool that grew on its load signal shrinks on the load signal alone.
    up, state = policy(_context(signals(3000, 100), 1, capacity_adjusted_max_replicas=2))
    assert up == 2 and not state["grew_for_latency"]
    long_ago["policy_state"] = state
    assert policy(_context(signals(180, 330), 2, **long_ago))[0] == 1


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_policy_logs_each_decision_once_with_its_signal() -> None:
    policy = DecodePolicy(**{**AutoscalingSettings(max_replicas=4).policy_knobs()})
    full = {
        "kv_blocks_used": {"a": 90.0},
        "kv_blocks_total": {"a": 100.0},
        "itl_p90_ms": {"a": 5.0},
    }
    state: dict[str, object] = {}
    handler = _Lines()  # Serve's logger does not propagate to the root (caplog's) handler
    logger.addHandler(handler)
    try:
        for tick in range(3):  # Serve calls again while its upscale delay holds the decision
            desired, state = policy(_context(full, 1, policy_state=state, current_time=tick))
            assert desired == 2
        calm = {"kv_blocks_used": {"a": 1.0}, "kv_blocks_total": {"a": 100.0}}
        assert policy(_context(calm, 1, policy_state=state))[1]["decision"] is None
    finally:
        logger.removeHandler(handler)
    lines = [line for line in handler.lines if SCALING_EVENT in line]
    assert len(lines) == 1
    record = json.loads(lines[0].split(SCALING_EVENT, 1)[1])
    assert record["pool"] == "p" and record["app"] == "pdserve"
    assert (record["current"], record["desired"], record["signal"]) == (1, 2, "kv_usage")
    assert record["kv_usage"] == 0.9 and record["demand_replicas"] == pytest.approx(1.286, 1e-3)


def _context(metrics: dict[str, dict[str, float]], current: int, **kwargs: object) -> object:
    fields: dict[str, object] = {
        "deployment_id": None,
        "deployment_name": "p",
        "app_name": "pdserve",
        "current_num_replicas": current,
        "target_num_replicas": current,
        "running_replicas": [],
        "total_num_requests": 0.0,
        "total_queued_requests": 0.0,
        "aggregated_metrics": metrics,
        "raw_metrics": None,
        "capacity_adjusted_min_replicas": 1,
        "capacity_adjusted_max_replicas": 4,
        "policy_state": {},
        "last_scale_up_time": None,
        "last_scale_down_time": None,
        "current_time": 1000.0,
        "config": None,
    }
    return AutoscalingContext(**{**fields, **kwargs})  # type: ignore[arg-type]


def test_serve_policies_read_aggregated_metrics() -> None:
    knobs = AutoscalingSettings(max_replicas=4).policy_knobs()
    prefill = PrefillPolicy(**knobs)
    busy = {
        "queued_prompt_tokens": {"r1": 2000.0},
        "prefill_tokens_per_s": {"r1": 1000.0},
        "ttft_p90_ms": {"r1": 300.0},
    }
    desired, state = prefill(_context(busy, 1))
    assert desired == 4 and state["demand_replicas"] == 4.0
    idle = {"queued_prompt_tokens": {"r1": 0.0, "r2": 0.0}, "ttft_p90_ms": {"r1": 0.0, "r2": 0}}
    assert prefill(_context(idle, 2))[0] == 1
    assert prefill(_context({}, 3))[0] == 3  # nothing reported yet: hold
    decode = DecodePolicy(**knobs)
    full = {"kv_blocks_used": {"a": 90.0}, "kv_blocks_total": {"a": 100.0}, "itl_p90_ms": {"a": 5}}
    assert decode(_context(full, 1, last_scale_up_time=995.0))[0] == 1  # cooling down
    assert decode(_context(full, 1, last_scale_up_time=980.0))[0] == 2
    assert per_replica({"x": {"a": 1.0, "b": 2.0}, "y": {"a": 3.0}}) == [
        {"x": 1.0, "y": 3.0},
        {"x": 2.0},
    ]


def test_pool_serve_options_name_the_policy_and_drain() -> None:
    prefill = PoolConfig(
        name="p", role="prefill", autoscaling={"max_replicas": 3}, drain_timeout_s=300
    ).serve_options()
    config = prefill["autoscaling_config"]
    assert config["policy"]["policy_function"] == "app.serve.autoscaling:PrefillPolicy"
    assert PolicyKnobs(**config["policy"]["policy_kwargs"]) == PolicyKnobs()
    assert prefill["graceful_shutdown_timeout_s"] == 300
    decode = PoolConfig(name="d", role="decode", autoscaling={"max_replicas": 2}).serve_options()
    assert decode["autoscaling_config"]["policy"]["policy_function"].endswith(":DecodePolicy")
    builtin = PoolConfig(
        name="d", role="decode", autoscaling={"policy": "ongoing_requests", "max_replicas": 2}
    ).serve_options()
    assert "policy" not in builtin["autoscaling_config"]


def test_serve_accepts_the_options_and_loads_the_policy() -> None:
    from ray import serve

    from app.config import load_config
    from tests.app.test_config import CONFIGS

    config = load_config(CONFIGS / "cpu-autoscale.yaml")
    for pool, policy_class in zip(config.pools, (PrefillPolicy, DecodePolicy), strict=True):

        @serve.deployment
        class Pool:
            pass

        deployment = Pool.options(**pool.serve_options())
        autoscaling = deployment._deployment_config.autoscaling_config
        assert autoscaling is not None and autoscaling.max_replicas == 2
        policy = autoscaling.policy.get_policy()
        assert policy.__name__ == policy_class.__name__
        instance = policy(**autoscaling.policy.policy_kwargs)
        assert instance.knobs == PolicyKnobs(**pool.autoscaling.policy_knobs())
