"""`cpu_affinity` of a pool: validated against this host's cores, and applied to every thread
of a real replica process (one started before the pin, and those started after it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from app.config import PDServeConfig


def _args(affinity: Any) -> dict[str, Any]:
    return {
        "model": {"model": "tiny"},
        "pools": [
            {"name": "prefill", "role": "prefill", "cpu_affinity": affinity},
            {"name": "decode", "role": "decode"},
        ],
    }


def test_cores_of_this_host_are_accepted() -> None:
    last = (os.cpu_count() or 1) - 1
    config = PDServeConfig.model_validate(_args([last, 0] if last else [0]))
    assert config.pools[0].cpu_affinity == ([last, 0] if last else [0])
    assert config.pools[1].cpu_affinity is None


@pytest.mark.parametrize(
    ("affinity", "message"),
    [
        ([os.cpu_count() or 1], "do not exist on this host"),
        ([-1], "do not exist on this host"),
        ([0, 0], "more than once"),
        ([], "at least 1"),
        (["first"], "valid integer"),
    ],
)
def test_bad_core_lists_are_refused_clearly(affinity: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PDServeConfig.model_validate(_args(affinity))


# A replica process: a thread already running when the replica pins itself, and one started
# afterwards; prints every thread's allowed cores.
_PROBE = """
import json, os, sys, threading
from replica.engine_replica import pin_to_cores

stop = threading.Event()
early = threading.Thread(target=stop.wait)
early.start()
pin_to_cores([int(sys.argv[1])])
late = threading.Thread(target=stop.wait)
late.start()
allowed = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
stop.set()
print(json.dumps(allowed))
"""


def test_pinning_covers_every_thread_of_the_process() -> None:
    core = max(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(core)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    allowed = json.loads(out.stdout)
    assert len(allowed) >= 3  # main, early, late
    assert all(cores == [core] for cores in allowed.values())
