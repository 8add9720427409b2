"""Where a rate point's CPU went: the CPU time each part of the deployment used, per request.

On a small host every process of the deployment shares the same cores: Serve's proxy, the
ingress, each pool's replicas, Ray's own daemons and this load generator. A config that
saturates first may do more work per request, or the same work placed worse; the CPU time
each part used over a point, divided by its requests, tells the two apart.

`cpu_times()` reads, from `/proc`, the CPU time (user + system) of this process and of
every process descended from it: the private Ray instance `bench compare` starts for each
point (GCS, raylet, and the workers the raylet starts). Each is named by its role:

- `ServeReplica:<app>:<deployment>` -> the deployment (`ingress`, `prefill`, `decode`, ...),
  summed over its replicas;
- `ProxyActor` -> `proxy`; this process -> `client` (the load generator);
- any other descendant -> `ray` (GCS, raylet, Serve's controller, the dashboard).

`usage(before, after, num_requests, seconds)` is the difference of two readings: CPU ms per
request and cores used, by role. Linux only; elsewhere the readings are empty.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

_REPLICA = re.compile(r"ray::ServeReplica:[^:\s]+:([^.\s]+)")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process, None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the name may hold spaces and parens
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _role(pid: int, own: int) -> str:
    """The role of a descendant process (module docstring)."""
    if pid == own:
        return "client"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "ray"
    if match := _REPLICA.search(cmdline):
        return match.group(1)
    return "proxy" if "ProxyActor" in cmdline else "ray"


def cpu_times() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of this process and its descendants."""
    if not os.path.isdir("/proc"):
        return {}
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p)))}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    own = os.getpid()
    found: dict[int, tuple[str, float]] = {}
    stack = [own]
    while stack:
        pid = stack.pop()
        if pid in stats and pid not in found:
            found[pid] = (_role(pid, own), stats[pid][1])
            stack.extend(children.get(pid, ()))
    return found


def usage(
    before: Mapping[int, tuple[str, float]],
    after: Mapping[int, tuple[str, float]],
    num_requests: int,
    seconds: float,
) -> dict[str, Any]:
    """CPU ms per request and cores used by role between two `cpu_times()` readings (a
    process that started in between counts from 0; one that ended in between is lost, as
    are its last seconds), with their totals."""
    used: dict[str, float] = {}
    for pid, (role, cpu_s) in after.items():
        start = before.get(pid)
        used[role] = used.get(role, 0.0) + cpu_s - (start[1] if start and start[0] == role else 0.0)
    roles = sorted(used, key=lambda role: -used[role])
    per_request = {role: round(1000 * used[role] / max(num_requests, 1), 2) for role in roles}
    cores = {role: round(used[role] / seconds, 3) if seconds > 0 else 0.0 for role in roles}
    return {
        "cpu_ms_per_request": per_request,
        "cores": cores,
        "total_cpu_ms_per_request": round(sum(per_request.values()), 2),
        "total_cores": round(sum(cores.values()), 3),
    }


def mean_per_request(points: list[Mapping[str, Any]]) -> dict[str, float] | None:
    """Each role's CPU ms per request averaged over the points that recorded it (each point
    has the same number of requests), with `total`; None when none did."""
    recorded = [p["cpu"]["cpu_ms_per_request"] for p in points if p.get("cpu")]
    if not recorded:
        return None
    roles = {role for figures in recorded for role in figures}
    means = {role: sum(f.get(role, 0.0) for f in recorded) / len(recorded) for role in roles}
    out = {role: round(ms, 2) for role, ms in sorted(means.items(), key=lambda kv: -kv[1])}
    return {**out, "total": round(sum(means.values()), 2)}
