"""A Ray driver's exit after SIGTERM: graceful, not aborted, and nothing left in /dev/shm.

**Ray's abort.** Ray installs abseil's failure-signal handler in each driver for SIGTERM as
well as for crashes. On SIGTERM that handler prints a stack trace, arms `alarm(3)` with an
immediate abort as SIGALRM's action, then passes the signal on to Ray's Python handler,
which exits gracefully: `sys.exit(15)`, atexit handlers, `ray.shutdown()` stopping the
local cluster the driver started, interpreter teardown. A driver whose graceful exit takes
longer than 3 s dies of SIGABRT partway (ray-project/ray#37288). `serve run app.main:app`
imports torch and the engine into its driver (the deployment classes are bound there),
which adds about a second of interpreter teardown to the second or two `ray.shutdown()`
takes, more on a busy machine: such runs ended in `Aborted`. `python -m bench.serve.deploy`
calls `serve.shutdown()` first, which waits for the replicas to drain. The exit itself is
right; only the alarm is wrong, so each graceful exit path cancels it as it begins
(`cancel_abort_alarm`).

**KV segments.** When the driver's cluster stops, Ray kills each replica together with its
child processes, the resource tracker that would unlink a dead decode replica's KV segment
among them, so the segment could outlive the run (`kvtransfer/shm.py`). The driver started
those replicas; it unlinks what they leave once they are gone (`exit_cleanly`).
"""

from __future__ import annotations

import os
import signal
import time

OWNERS_EXIT_TIMEOUT_S = 10.0  # how long a stopping cluster's replicas may take to die


def cancel_abort_alarm() -> None:
    """Cancel a pending `alarm()` unless Python code set a SIGALRM handler for it.

    Python does not see handlers native code installs (abseil's abort is one), so an alarm
    without a Python handler is taken to be that one; it would end the process either way.
    """
    if not callable(signal.getsignal(signal.SIGALRM)):
        signal.alarm(0)


def exit_cleanly() -> None:
    """The atexit handler of a process that imported `app.main` (registered after Ray's
    own, so it runs first): cancel Ray's abort; then, where this process started the
    replicas that own KV segments (the local cluster of `serve run`), stop Ray now (what
    Ray's handler would do next), wait for them to die and unlink their segments."""
    from kvtransfer import shm

    cancel_abort_alarm()
    owners = {
        pid
        for segment in shm.list_segments()
        if (pid := shm.segment_owner(segment)) is not None and _descends_from_us(pid)
    }
    if not owners:
        return
    import ray

    ray.shutdown()
    deadline = time.monotonic() + OWNERS_EXIT_TIMEOUT_S
    while any(_parent(pid) is not None for pid in owners) and time.monotonic() < deadline:
        time.sleep(0.1)
    shm.sweep_orphans()  # only segments whose owner is gone and that nobody serves


def _parent(pid: int) -> int | None:
    """`pid`'s parent pid; None once `pid` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            state, ppid = stat.read().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return None
    return None if state in ("Z", "X") else int(ppid)


def _descends_from_us(pid: int) -> bool:
    """Whether this process is an ancestor of `pid` (a replica of the cluster it started)."""
    me = os.getpid()
    parent = _parent(pid)
    while parent is not None and parent > 1:
        if parent == me:
            return True
        parent = _parent(parent)
    return False
