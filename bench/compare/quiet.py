"""Quieter measurements: replicas on their own cores, the load generator off them, and the
host's state recorded so that a noisy run can be told from a quiet one.

- `split_cores(cores, pools)`: which of `cores` each pool's replicas get (`cpu_affinity`);
- `pin_pools(args, cores)`: an app's args with those affinities set;
- `pin_bench(replica_cores)`: moves this process (and so the Ray processes it starts next:
  GCS, raylet, Serve's controller, proxy and ingress, which inherit its mask) off the replica
  cores, when the host has cores left over;
- `host_state()`: load average and core count, recorded before and after every run;
- `drift(before, after)`: how far a config's isolated TTFT/TPOT moved over a run.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any


def parse_cores(text: str) -> list[int]:
    """`"0,1"` or `"2-5,7"` -> core ids, in order, each once."""
    cores: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            span = range(int(low), int(high or low) + 1)
        except ValueError:
            raise ValueError(f"bad core list {text!r}: use e.g. 0,1 or 2-5") from None
        cores.extend(core for core in span if core not in cores)
    if not cores:
        raise ValueError(f"bad core list {text!r}: no cores")
    return cores


def split_cores(cores: Sequence[int], pools: Sequence[tuple[str, int]]) -> dict[str, list[int]]:
    """Each pool's share of `cores`, by `(name, replicas)` in order: consecutive cores, at
    least one per pool, the rest handed out one by one to the pool with the most replicas
    per core so far. With fewer cores than pools, every pool shares all of them."""
    if not pools:
        return {}
    if len(cores) < len(pools):
        return {name: list(cores) for name, _ in pools}
    counts = {name: 1 for name, _ in pools}
    replicas = dict(pools)
    for _ in range(len(cores) - len(pools)):
        name = max(counts, key=lambda n: replicas[n] / counts[n])  # first wins on a tie
        counts[name] += 1
    out: dict[str, list[int]] = {}
    start = 0
    for name, _ in pools:
        out[name] = list(cores[start : start + counts[name]])
        start += counts[name]
    return out


def _num_replicas(pool: Mapping[str, Any]) -> int:
    scaling = pool.get("autoscaling")
    if scaling:
        return int(scaling.get("max_replicas", 1))
    return int(pool.get("num_replicas") or 1)


def pin_pools(args: Mapping[str, Any], cores: Sequence[int]) -> dict[str, Any]:
    """A copy of an app's args with every pool's `cpu_affinity` set from `split_cores`."""
    out = copy.deepcopy(dict(args))
    pools = out["pools"]
    shares = split_cores(cores, [(p["name"], _num_replicas(p)) for p in pools])
    for pool in pools:
        pool["cpu_affinity"] = shares[pool["name"]]
    return out


def pin_bench(replica_cores: Sequence[int]) -> list[int] | None:
    """Pin this process to the cores not in `replica_cores`; returns them, or None (and
    changes nothing) when the replica cores are all the host has."""
    from replica.engine_replica import pin_to_cores

    rest = sorted(set(range(os.cpu_count() or 1)) - set(replica_cores))
    if not rest:
        return None
    pin_to_cores(rest)
    return rest


def host_state() -> dict[str, Any]:
    """The host's 1/5/15-minute load averages, its cores, and the cores this process may use."""
    one, five, fifteen = os.getloadavg()
    return {
        "load_avg": [round(one, 2), round(five, 2), round(fifteen, 2)],
        "num_cores": os.cpu_count(),
        "bench_cores": sorted(os.sched_getaffinity(0)),
    }


def drift(before: Mapping[str, Any], after: Mapping[str, Any]) -> float | None:
    """The largest relative change |after - before| / before of any class's isolated TTFT
    or TPOT between two measurements (`{label: {"ttft_ms", "tpot_ms"}}`); None if no figure
    was measured both times."""
    changes = [
        abs(b[key] - a[key]) / a[key]
        for label, a in before.items()
        if (b := after.get(label)) is not None
        for key in ("ttft_ms", "tpot_ms")
        if a.get(key) and b.get(key) is not None
    ]
    return max(changes) if changes else None
