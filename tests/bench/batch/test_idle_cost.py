"""`pdserve bench idle-cost`'s /proc accounting: process names and CPU seconds by name."""

from __future__ import annotations

import os
import time

from bench.batch.idle_cost import cpu_used, process_cpu_s, process_name


def test_ray_titles_lose_their_task_and_others_keep_their_executable() -> None:
    assert process_name("ray::ServeController.listen_for_change") == "ray::ServeController"
    assert process_name("ray::ServeReplica:pdserve:decode") == "ray::ServeReplica:pdserve:decode"
    assert process_name("/usr/bin/python3.11") == "python3.11"


def test_this_process_is_charged_the_cpu_it_spends() -> None:
    before = process_cpu_s()
    name, _ = before[os.getpid()]
    spin_until = time.process_time() + 0.3
    while time.process_time() < spin_until:
        pass
    used = cpu_used(before, process_cpu_s())
    assert used[name] >= 0.2  # clock ticks of 10 ms: 0.3 s spent reads 0.29 at least
    assert list(used.values()) == sorted(used.values(), reverse=True)


def test_a_process_keeps_the_name_it_had_when_first_read() -> None:
    before = {7: ("ray::ServeController", 1.0), 8: ("python3", 2.0)}
    after = {7: ("ray::ServeController.run", 1.5), 8: ("python3", 2.0), 9: ("new", 0.25)}
    assert cpu_used(before, after) == {"ray::ServeController": 0.5, "new": 0.25}
