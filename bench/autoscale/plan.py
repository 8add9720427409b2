"""The rates of `pdserve bench autoscale`, sized from the capacity measured in the same run
(pure, no I/O).

Before the ramp the config is deployed once with every pool fixed at its minimum replicas
(`fixed_at_minimum`: nothing can scale while it is measured) and each stressing request shape
gets a closed-loop saturation search on it (`bench/serve/capacity.py`):

- **prefill** (long prompts, short outputs): from 1 in flight. The prefill peak is `load`
  (0.8) x the capacity found: past what the minimum pool serves within the TTFT SLO (its
  queue and TTFT grow, the signals the prefill policy scales on), yet below what it drains,
  so latency stays bounded where a second replica adds little (a busy machine). The prompts
  are long (4,000 tokens by default) so that computing them, not the per-request overhead
  every process of the path shares, is what saturates; with short ones the whole machine
  saturates while the prefill queue stays near empty, and a grown pool flaps.
- **decode** (short prompts, long outputs): the decode policy scales on running sequences
  against `target_running_seqs` per replica, a count, not a rate, and how many requests in
  flight make one running sequence depends on the machine (where streaming the tokens out
  costs more than computing them, a sequence leaves the engine well before its stream
  ends). So the search starts at the target's worth of requests in flight and reads the
  pool's running sequences at every point; the decode peak (`decode_peak`) is the rate at
  which the minimum pool runs `decode_overshoot` (3) x its target, at most `load` x the
  decode shape's capacity. The minimum pool then runs well over its target and a doubled
  pool still over it, with room for the machine to speed up (a neighbour's job ending)
  between the probe and the peak. A decode pool without `target_running_seqs` (KV or
  latency only) is driven like prefill.
- **low** phases: base requests at `low_load` (0.25) x the lower of the two peaks; a base
  request costs a fraction of a stressing one in either pool, so neither is loaded.

`RampRates` holds the result; the JSON records it with the probes' points.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PEAK_LOAD = 0.8
DECODE_OVERSHOOT = 3.0
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
    target_running_seqs: float, min_replicas: int, overshoot: float = 1.0
) -> int:
    """Requests in flight that would make the minimum decode pool run `overshoot` x its
    target of running sequences if every request in flight were running there (the decode
    search's first point)."""
    if target_running_seqs <= 0 or min_replicas < 1 or overshoot <= 0:
        raise ValueError("target_running_seqs, min_replicas and overshoot must be positive")
    return max(1, math.ceil(overshoot * target_running_seqs * min_replicas))


def decode_peak(
    points: Sequence[tuple[float, float]],
    running: float,
    capacity: float,
    load: float = PEAK_LOAD,
) -> float:
    """The rate at which the minimum decode pool runs `running` sequences, from the decode
    probe's `points` (mean running sequences, throughput) in order of concurrency: linear
    between the two points around it, else in proportion to the nearest end point (running
    sequences grow with the rate: Little's law), at most `load` x `capacity`. Where the
    pool never ran a sequence in the probe, `load` x `capacity`."""
    usable = [(r, x) for r, x in points if r > 0]
    cap = load * capacity
    if not usable:
        return cap
    for (r0, x0), (r1, x1) in zip(usable, usable[1:], strict=False):
        if r0 <= running <= r1 and r1 > r0:
            return min(x0 + (running - r0) / (r1 - r0) * (x1 - x0), cap)
    r, x = usable[0] if running < usable[0][0] else usable[-1]
    return min(x * running / r, cap)


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
