"""Where a benchmark's CPU went: the CPU time each part of the deployment used, per request.

On a small host every process of the deployment shares the same cores: Serve's proxy, the
ingress, each pool's replicas, Ray's own daemons and the load generator. A config that
saturates first may do more work per request, or the same work placed worse; the CPU time
each part used, divided by the requests, tells the two apart (`bench compare` per rate
point, `python -m bench.overload.cost` per kind of request).

`cpu_times()` reads, from `/proc`, the CPU time (user + system) of this process and of
every process descended from it: the private Ray instance the benchmark started
(`bench.serve.deploy.running_app`: GCS, raylet, and the workers the raylet starts). Each
is named by its role:

- `ServeReplica:<app>:<deployment>` -> the deployment (`ingress`, `prefill`, `decode`, ...),
  summed over its replicas;
- `ProxyActor` -> `proxy`; this process -> `client` (the load generator, with the Ray
  driver's own threads);
- any other descendant -> `ray` (GCS, raylet, Serve's controller, the dashboard).

`usage(before, after, num_requests, seconds)` is the difference of two readings: CPU ms per
request and cores used, by role. Linux only; elsewhere the readings are empty.
`cpu_seconds(pid)` is one process's CPU time so far.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

_REPLICA = re.compile(r"ray::ServeReplica:[^:\s]+:([^.\s]+)")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, CPU seconds, start time in ticks) of a live process, None when it is
    gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
        fields = text[text.rfind(")") + 2 :].split()  # the name may hold spaces and parens
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS_PER_S, int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far; OSError when it is gone."""
    stat = _stat(pid)
    if stat is None:
        raise ProcessLookupError(f"no readable process {pid}")
    return stat[1]


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


Process = tuple[int, int]  # (pid, start time): a pid the kernel reuses is another process


def cpu_times() -> dict[Process, tuple[str, float]]:
    """(pid, start time) -> (role, CPU seconds so far) of this process and its
    descendants."""
    if not os.path.isdir("/proc"):
        return {}
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p)))}
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    own = os.getpid()
    found: dict[Process, tuple[str, float]] = {}
    stack, seen = [own], set()
    while stack:
        pid = stack.pop()
        if pid in stats and pid not in seen:
            seen.add(pid)
            _, cpu_s, started = stats[pid]
            found[(pid, started)] = (_role(pid, own), cpu_s)
            stack.extend(children.get(pid, ()))
    return found


def usage(
    before: Mapping[Process, tuple[str, float]],
    after: Mapping[Process, tuple[str, float]],
    num_requests: int,
    seconds: float,
) -> dict[str, Any]:
    """CPU ms per request and cores used by role between two `cpu_times()` readings, with
    their totals. A process that started in between counts from 0; one that changed role
    in between (a Ray worker that became a replica) counts under its later role, or its
    earlier one when the later is unknown (it was exiting); one that ended in between is
    lost, with its last seconds."""
    used: dict[str, float] = {}
    for process, (role, cpu_s) in after.items():
        earlier_role, earlier_s = before.get(process, (role, 0.0))
        if role == "ray" and earlier_role != "ray":
            role = earlier_role
        used[role] = used.get(role, 0.0) + cpu_s - earlier_s
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
    """Each role's CPU ms per request averaged over the points that recorded CPU at all
    (each point has the same number of requests; a role missing from a point counts 0
    there), with `total`; None when none did."""
    recorded = [p["cpu"]["cpu_ms_per_request"] for p in points if p.get("cpu")]
    if not recorded:
        return None
    roles = {role for figures in recorded for role in figures}
    means = {role: sum(f.get(role, 0.0) for f in recorded) / len(recorded) for role in roles}
    out = {role: round(ms, 2) for role, ms in sorted(means.items(), key=lambda kv: -kv[1])}
    return {**out, "total": round(sum(means.values()), 2)}
