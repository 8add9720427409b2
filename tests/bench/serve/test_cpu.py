"""CPU time by role (`bench/serve/cpu.py`): real child processes named as Serve names its
actors, each burning a known share of the CPU, read from `/proc`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.serve.cpu import cpu_times, mean_per_request, usage

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")

# Burns CPU until it has used `seconds` of it, says so, then waits for stdin to close.
BURN = """
import sys, time
seconds = float(sys.argv[1])
while time.process_time() < seconds:
    pass
print("done", flush=True)
sys.stdin.read()
"""


def burner(seconds: float, title: str) -> subprocess.Popen[str]:
    """A child that uses `seconds` of CPU; `title` stands in its command line as Ray's
    process titles do (`ray::ServeReplica:<app>:<deployment>`, `ray::ProxyActor`)."""
    child = subprocess.Popen(
        [sys.executable, "-c", BURN, str(seconds), title],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "done"
    return child


def test_usage_names_each_descendant_by_its_role() -> None:
    before = cpu_times()
    roles = {pid: role for (pid, _), (role, _) in before.items()}
    assert roles[os.getpid()] == "client"
    assert 1 not in roles or os.getpid() == 1  # only this process and its descendants
    children = [
        burner(0.3, "ray::ServeReplica:pdserve:decode.generate"),
        burner(0.2, "ray::ServeReplica:pdserve:decode"),
        burner(0.2, "ray::ProxyActor"),
        burner(0.1, "gcs_server"),
    ]
    try:
        after = cpu_times()
    finally:
        for child in children:
            child.communicate("")
    used = usage(before, after, num_requests=10, seconds=2.0)
    per_request = used["cpu_ms_per_request"]
    assert set(per_request) >= {"decode", "proxy", "ray", "client"}
    # two replicas of one deployment add up; each child used what it burned (the kernel
    # accounts CPU time in clock ticks, sampled: within 20%)
    assert per_request["decode"] >= 0.8 * 1000 * 0.5 / 10
    assert per_request["proxy"] >= 0.8 * 1000 * 0.2 / 10
    assert per_request["ray"] >= 0.8 * 1000 * 0.1 / 10
    assert used["total_cpu_ms_per_request"] == pytest.approx(sum(per_request.values()), abs=0.1)
    assert used["cores"]["decode"] == pytest.approx(per_request["decode"] * 10 / 1000 / 2.0)


def test_processes_new_reused_renamed_or_gone_between_readings() -> None:
    """New (or a reused pid: another start time) counts from zero; a worker that became a
    replica counts under its new role from its earlier reading; one exiting (its command
    line unreadable: `ray`) keeps its role; one gone is lost."""
    before = {
        (10, 1): ("decode", 5.0),
        (11, 1): ("ray", 1.0),  # an idle Ray worker
        (12, 1): ("proxy", 2.0),  # exiting by the second reading
        (13, 1): ("prefill", 9.0),  # gone
    }
    after = {
        (10, 1): ("decode", 5.5),
        (11, 1): ("ingress", 1.25),
        (12, 1): ("ray", 2.5),
        (13, 7): ("decode", 0.5),  # the pid again, another process
    }
    used = usage(before, after, num_requests=5, seconds=1.0)
    assert used["cpu_ms_per_request"] == {"decode": 200.0, "ingress": 50.0, "proxy": 100.0}
    assert used["total_cores"] == 1.75


def test_mean_per_request_over_points() -> None:
    points = [
        {"cpu": {"cpu_ms_per_request": {"decode": 10.0, "ingress": 20.0}}},
        {"cpu": {"cpu_ms_per_request": {"decode": 20.0}}},
        {"rate": 3.0},  # recorded before CPU was: left out
    ]
    assert mean_per_request(points) == {"decode": 15.0, "ingress": 10.0, "total": 25.0}
    assert mean_per_request([{"rate": 1.0}]) is None
