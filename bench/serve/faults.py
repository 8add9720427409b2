"""Real faults for real replica processes: find a Serve replica's pid, then signal it.

Ray Serve runs each replica as a Ray actor named `SERVE_REPLICA::<app>#<deployment>#<id>`;
the GCS knows the pid of its worker process. `SIGKILL` is a crash (Serve notices through its
health check and starts a replacement), `SIGSTOP` a frozen process (a GC pause, a swapped-out
host), `SIGCONT` thaws it. Used by `pdserve bench chaos` and the fault drills
(`tests/app/test_serve_drills.py`); only the driver of the Ray instance that runs the app can
see its actors, and every signal goes to a pid that instance reported.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

REPLICA_PREFIX = "SERVE_REPLICA::"


def replica_pids(app: str, deployment: str) -> list[int]:
    """Pids of the live replicas of `deployment` in `app` (this driver's Ray instance)."""
    from ray._private import state  # the GCS actor table; ray.util.state needs a dashboard

    prefix = f"{REPLICA_PREFIX}{app}#{deployment}#"
    actors = state.actors(actor_state_name="ALIVE")
    return sorted(
        int(info["Pid"])
        for info in actors.values()
        if str(info.get("Name") or "").startswith(prefix) and info.get("Pid")
    )


def wait_for_new_replica(
    app: str, deployment: str, old_pids: set[int], timeout_s: float
) -> int | None:
    """Poll until a live replica whose pid is not in `old_pids` exists; its pid, or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fresh = [pid for pid in replica_pids(app, deployment) if pid not in old_pids]
        if fresh:
            return fresh[0]
        time.sleep(0.2)
    return None


def signal_pid(pid: int, sig: signal.Signals) -> bool:
    """Send `sig` to `pid`; False when the process is already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size (`VmHWM`), in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def serve_log_dir() -> Path:
    """This driver's Ray session's Serve log directory (replica logs: `replica_<app>_*.log`).

    Not `/tmp/ray/session_latest`: other Ray instances on the host may have started later.
    """
    from ray._private import worker

    node = worker._global_node
    if node is None:
        raise RuntimeError("ray is not initialized in this process")
    return Path(node.get_session_dir_path()) / "logs" / "serve"


def replica_log_lines(app: str, deployment: str, needle: str) -> list[str]:
    """Lines containing `needle` in the logs of `deployment`'s replicas (all incarnations)."""
    lines: list[str] = []
    for path in sorted(serve_log_dir().glob(f"replica_{app}_{deployment}_*.log")):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines += [f"{path.name}: {line.rstrip()}" for line in f if needle in line]
    return lines
