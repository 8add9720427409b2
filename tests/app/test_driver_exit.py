"""A driver's exit: Ray's SIGTERM abort alarm is cancelled (a Python one is not), and KV
segments of replicas the driver started are unlinked once those replicas are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import driver_exit
from kvtransfer import shm


@pytest.fixture
def alarm_free() -> Iterator[None]:
    """SIGALRM as in a fresh driver (no Python handler, no alarm); pytest-timeout's own
    handler and timer come back afterwards."""
    handler = signal.getsignal(signal.SIGALRM)
    timer = signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if handler is not None:  # None: set by native code, which Python cannot restore
            signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, *timer)


@pytest.mark.usefixtures("alarm_free")
def test_cancels_an_alarm_python_did_not_set() -> None:
    signal.alarm(300)  # abseil's is armed from native code: Python sees no handler
    driver_exit.cancel_abort_alarm()
    assert signal.alarm(0) == 0


@pytest.mark.usefixtures("alarm_free")
def test_leaves_an_alarm_with_a_python_handler() -> None:
    signal.signal(signal.SIGALRM, lambda signum, frame: None)
    signal.alarm(300)
    driver_exit.cancel_abort_alarm()
    assert signal.alarm(0) > 0


def _segment_of(pid: int) -> Path:
    path = Path(shm.SHM_DIR) / f"{shm.SEGMENT_PREFIX}{pid}-{os.urandom(8).hex()}"
    path.write_bytes(b"kv")
    return path


def test_unlinks_the_segments_of_replicas_it_started_once_they_are_gone() -> None:
    """A child of ours stands for a replica of the cluster this driver started; pid 1's
    segment for one of somebody else's cluster, which stays."""
    replica = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    ours, theirs = _segment_of(replica.pid), _segment_of(1)
    try:
        assert driver_exit._descends_from_us(replica.pid)
        assert not driver_exit._descends_from_us(1) and not driver_exit._descends_from_us(
            os.getpid()
        )
        assert replica.stdin is not None
        replica.stdin.close()  # the replica exits while the driver waits for it
        driver_exit.exit_cleanly()
        assert not ours.exists()
        assert theirs.exists()
    finally:
        replica.kill()
        replica.wait()
        ours.unlink(missing_ok=True)
        theirs.unlink(missing_ok=True)


def test_nothing_to_do_without_segments_of_ours() -> None:
    theirs = _segment_of(1)
    try:
        driver_exit.exit_cleanly()  # does not stop Ray nor wait: nothing of ours to wait for
        assert theirs.exists()
    finally:
        theirs.unlink(missing_ok=True)
