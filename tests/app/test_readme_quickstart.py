"""README.md's quick start, run as written: the code comes out of README.md itself.

`serve run app.main:app` (the quick start's command) in a subprocess; `/health` turns 200;
the README's `openai` snippet gets a completion; its handle-API snippet, run as a script by
a second Ray driver of that cluster, prints text; SIGTERM then ends the run cleanly (exit
status 0 or Ray's 15, never an abort) with no process of the run and none of its KV
segments left. The run gets `RAY_ADDRESS=local` so that it starts its own cluster as on a
fresh machine, never joining one started on this machine with `ray start`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtransfer import shm

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PORT = 8000  # the README's; `serve run app.main:app` takes Serve's default
STARTUP_TIMEOUT_S = 180.0
SNIPPET_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 30.0  # SIGTERM to exit: ray.shutdown() and interpreter teardown
LEFTOVER_TIMEOUT_S = 15.0  # after the exit, every process of the run is gone by then
CLEAN_EXITS = (0, 15)  # 15: Ray's SIGTERM handler exits with the signal's number


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)


def _block(language: str, marker: str) -> str:
    """The one `language` code block of README.md that contains `marker`."""
    blocks = [b for b in _code_blocks(language) if marker in b]
    assert len(blocks) == 1, f"README.md has {len(blocks)} {language} blocks with {marker!r}"
    return blocks[0]


def _quickstart_command() -> list[str]:
    """The serving command of the quick start: the last command of its install line."""
    command = "serve run app.main:app"
    line = next(ln for ln in _block("bash", command).splitlines() if command in ln)
    return shlex.split(line.split("&&")[-1])


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _stat(pid: int) -> list[str] | None:
    """`/proc/<pid>/stat` fields after the command name (state, ppid, ...); None if the
    process is gone (a zombie counts as gone: it runs nothing and holds nothing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _session_processes(session: str) -> list[str]:
    """Live processes whose command line names the Ray session `session`."""
    pids = (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    return [f"{pid}: {_cmdline(pid)[:120]}" for pid in pids if session in _cmdline(pid)]


def _driver_env(gcs_address: str) -> dict[str, str]:
    """The environment of the second driver: `ray.init("auto")` there finds the serve run's
    cluster among any others on this machine. An address given in RAY_ADDRESS does not turn
    on token authentication by itself, as auto-detection would (a new local cluster uses it
    unless RAY_AUTH_MODE says otherwise), so the mode goes with it."""
    return {
        **os.environ,
        "RAY_ADDRESS": gcs_address,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
    }


def _wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


class Run:
    """The quick start's `serve run` subprocess, its log, and the processes it started."""

    def __init__(self, log: Path) -> None:
        self.log = log
        env = {**os.environ, "RAY_ADDRESS": "local"}
        with log.open("wb") as out:
            # Its own session (process group): the cleanup can kill whatever it started.
            self.process = subprocess.Popen(
                _quickstart_command(),
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pids: set[int] = set()

    def tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-num_lines:])

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"serve run exited ({self.process.returncode}):\n{self.tail()}")
        try:
            return httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def cluster_option(self, name: str) -> str:
        """An option of the run's raylet command line (`--gcs-address`, `--session-name`)."""
        self.pids |= _descendants(self.process.pid)
        for pid in self.pids:
            command = _cmdline(pid)
            if "/raylet/raylet" in command and (match := re.search(rf"{name}=(\S+)", command)):
                return match.group(1)
        pytest.fail(f"no raylet with {name} under serve run:\n{self.tail()}")

    def kill(self) -> None:
        """Whatever is left, however the test ended."""
        if self.process.poll() is None:
            self.pids |= _descendants(self.process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        for pid in self.pids:  # workers run in process groups of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    if _port_taken(PORT):
        pytest.skip(f"port {PORT}, where the README's quick start serves, is in use here")
    started = Run(tmp_path / "serve-run.log")
    try:
        yield started
    finally:
        started.kill()


def test_readme_quickstart(run: Run) -> None:
    assert _wait_for(run.healthy, STARTUP_TIMEOUT_S), f"no /health 200:\n{run.tail()}"

    # The openai snippet, in this process (it needs no Ray).
    namespace: dict[str, object] = {}
    exec(_block("python", "from openai import OpenAI"), namespace)
    completion: Any = namespace["out"]
    assert completion.usage.completion_tokens > 0

    # The handle-API snippet as a script: another driver of the cluster serve run started.
    gcs_address = run.cluster_option("--gcs-address")
    snippet = subprocess.run(
        [sys.executable, "-c", _block("python", "from app.handle import")],
        cwd=ROOT,
        env=_driver_env(gcs_address),
        capture_output=True,
        text=True,
        timeout=SNIPPET_TIMEOUT_S,
    )
    assert snippet.returncode == 0, snippet.stderr[-4000:]
    assert snippet.stdout.strip(), f"the handle snippet printed nothing:\n{snippet.stderr}"

    # SIGTERM: a clean exit, then nothing of the run left.
    session = run.cluster_option("--session-name")
    pids = run.pids | _descendants(run.process.pid)
    segments = [s for s in shm.list_segments() if shm.segment_owner(s) in pids]
    assert segments, "the decode replica's KV segment was not found"
    run.process.send_signal(signal.SIGTERM)
    try:
        status = run.process.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve run still running {EXIT_TIMEOUT_S} s after SIGTERM:\n{run.tail()}")
    assert status in CLEAN_EXITS, f"exit status {status} (-6/134: aborted):\n{run.tail()}"
    assert _wait_for(lambda: all(_stat(p) is None for p in pids), LEFTOVER_TIMEOUT_S), (
        f"left running {LEFTOVER_TIMEOUT_S} s after the exit: {_session_processes(session)}"
        f" / {[p for p in pids if _stat(p) is not None]}"
    )
    assert not _session_processes(session)
    assert not set(segments) & set(shm.list_segments()), "KV segments left in /dev/shm"
