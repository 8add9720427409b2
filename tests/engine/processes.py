"""Process checks shared by the tensor-parallel tests: has a worker exited, and waiting
(with a deadline) until a set of them has."""

from __future__ import annotations

import time

EXIT_TIMEOUT_S = 30.0


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout_s: float = EXIT_TIMEOUT_S) -> list[int]:
    """The pids still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
        time.sleep(0.2)
    return [pid for pid in pids if not gone(pid)]
