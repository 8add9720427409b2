"""The rates of `pdserve bench autoscale`, sized from the capacity measured in the same run
(pure, no I/O).

Before the ramp the config is deployed once with every pool fixed at its minimum replicas
(`fixed_at_minimum`: nothing can scale while it is measured) and two closed-loop probes run
on it (`bench/capacity.py`), one per stressing request shape:

- **prefill** (long prompts, short outputs): a saturation search; its capacity is what the
  minimum prefill pool can compute. The prefill peak is `prefill_load` (0.8) x that: the
  queue of prompt tokens, and with it the predicted queue wait that the prefill policy
  scales on, grows well past one replica's share, yet the load stays below what the minimum
  pool drains, so latency stays bounded even where a second replica adds little (a busy
  machine).
- **decode** (short prompts, long outputs): the decode policy scales on running sequences
  against `target_running_seqs` per replica, a count, not a rate. The probe keeps
  `decode_overshoot` (2.5) x that target x the minimum replicas in flight; its throughput is
  the rate that holds that many requests (Little's law), and is the decode peak: the minimum
  pool runs twice its target, a doubled pool about its target. A decode pool without
  `target_running_seqs` (KV or latency only) is driven like prefill: `prefill_load` x the
  decode shape's saturation capacity.
- **low** phases: base requests at `low_load` (0.25) x the lower of the two peaks; a base
  request costs about an eighth of a stressing one in either pool, so neither is loaded.

`RampRates` holds the result; the JSON records it with the probes' points.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PREFILL_LOAD = 0.8
DECODE_OVERSHOOT = 2.5
LOW_LOAD = 0.25


def fixed_at_minimum(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """The app args with every autoscaling pool fixed at its `min_replicas` (autoscaling
    removed), and each pool's replica count: the fleet the ramp starts from."""
    out = copy.deepcopy(dict(args))
    replicas: dict[str, int] = {}
    pools = []
    for pool in out.get("pools") or []:
        pool = dict(pool)
        scaling = pool.pop("autoscaling", None)
        if scaling is not None:
            pool["num_replicas"] = int(scaling.get("min_replicas", 1))
        replicas[pool["name"]] = int(pool.get("num_replicas") or 1)
        pools.append(pool)
    out["pools"] = pools
    return out, replicas


def decode_probe_concurrency(
    target_running_seqs: float, min_replicas: int, overshoot: float = DECODE_OVERSHOOT
) -> int:
    """Requests to keep in flight so that the minimum decode pool runs `overshoot` x its
    target of running sequences."""
    if target_running_seqs <= 0 or min_replicas < 1 or overshoot <= 0:
        raise ValueError("target_running_seqs, min_replicas and overshoot must be positive")
    return max(1, math.ceil(overshoot * target_running_seqs * min_replicas))


@dataclass(frozen=True, slots=True)
class RampRates:
    """Requests/s of the low phases and of each stressed role's peak."""

    low: float
    peaks: dict[str, float]  # role -> peak rate


def ramp_rates(peaks: Mapping[str, float], low_load: float = LOW_LOAD) -> RampRates:
    """The stressed roles' `peaks` (requests/s) and the low rate, `low_load` x the lowest."""
    if not peaks or min(peaks.values()) <= 0:
        raise ValueError(f"the probes found no capacity to size the ramp from: {dict(peaks)}")
    return RampRates(low_load * min(peaks.values()), dict(peaks))


def fixed_rates(rate: float, peak: float, roles: list[str]) -> RampRates:
    """The absolute ramp (`--rate`, `--peak`): low at `rate`, every peak at `peak` x it."""
    return RampRates(rate, {role: rate * peak for role in roles})
