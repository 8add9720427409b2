"""The request log: one JSON line per finished request, written by the ingress.

Lines carry ids, tenant, route, token counts, latencies and status, never text, unless
`log_content` is on: then a `content_sample_ratio` sample of requests also carries prompt
and completion text, redacted (`Redactor`). Files rotate by size and age, and rotated
files are deleted after `retention_s` (`RotatingJsonlFile`). Writing happens on a thread of
its own, behind a bounded queue, so a slow disk never stalls the event loop (lines that do
not fit are dropped and counted).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.config import RequestLogSettings

logger = logging.getLogger(__name__)

QUEUE_SIZE = 10_000
ROTATED_MARKER = ".rotated-"

_BUILTIN_RULES: dict[str, str] = {
    "emails": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}",
    # Prefixed secrets (sk-..., pk_live_...), and long mixed letter-and-digit tokens.
    "api_keys": r"\b(?:sk|pk|rk|ak|key|token)[-_][A-Za-z0-9_-]{8,}"
    r"|\b(?=[A-Za-z0-9_-]*\d)(?=[A-Za-z0-9_-]*[A-Za-z])[A-Za-z0-9_-]{24,}\b",
}


class Redactor:
    """Replaces what the configured rules match with `[REDACTED:<rule>]`."""

    def __init__(
        self, rules: Sequence[str], min_digits: int = 4, patterns: Sequence[str] = ()
    ) -> None:
        compiled: list[tuple[str, re.Pattern[str]]] = []
        for rule in rules:
            if rule == "digits":
                compiled.append((rule, re.compile(rf"\d{{{min_digits},}}")))
            else:
                compiled.append((rule, re.compile(_BUILTIN_RULES[rule])))
        compiled += [("custom", re.compile(p)) for p in patterns]
        self._rules = compiled

    @classmethod
    def from_settings(cls, settings: RequestLogSettings) -> Redactor:
        return cls(settings.redact, settings.min_redacted_digits, settings.redact_patterns)

    def __call__(self, text: str) -> str:
        for name, pattern in self._rules:
            text = pattern.sub(f"[REDACTED:{name}]", text)
        return text


class RotatingJsonlFile:
    """Appends lines to `<directory>/<stem>.jsonl`; past `max_bytes` or `max_age_s` the file
    becomes `<stem>.rotated-<UTC time>.jsonl` and a new one starts. Rotated files (of any
    process writing into `directory`) older than `retention_s` are deleted at start and at
    every rotation. Not thread-safe: one writer thread owns it."""

    def __init__(
        self,
        directory: Path,
        stem: str,
        max_bytes: int,
        max_age_s: float,
        retention_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.path = directory / f"{stem}.jsonl"
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.retention_s = retention_s
        self.clock = clock
        directory.mkdir(parents=True, exist_ok=True)
        self.purge()
        self._open()

    def _open(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close
        self._size = self._file.tell()
        self._opened_at = self.clock()

    def write(self, line: str) -> None:
        """Append one line (a newline is added), rotating first when the file is full or
        old."""
        data = line + "\n"
        now = self.clock()
        too_big = self._size > 0 and self._size + len(data.encode()) > self.max_bytes
        if too_big or now - self._opened_at >= self.max_age_s:
            self.rotate()
        self._file.write(data)
        self._file.flush()
        self._size += len(data.encode())

    def rotate(self) -> Path:
        """Close the current file under its rotated name, start a new one, purge old ones."""
        self._file.close()
        stamp = datetime.fromtimestamp(self.clock(), timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        rotated = self.path.with_name(f"{self.path.stem}{ROTATED_MARKER}{stamp}.jsonl")
        os.replace(self.path, rotated)
        # Its mtime is the rotation time: retention counts from when its last line was written.
        now = self.clock()
        os.utime(rotated, (now, now))
        self.purge()
        self._open()
        return rotated

    def purge(self) -> list[Path]:
        """Delete rotated files older than the retention; returns what was deleted."""
        cutoff = self.clock() - self.retention_s
        deleted = []
        for path in self.directory.glob(f"*{ROTATED_MARKER}*.jsonl"):
            with contextlib.suppress(FileNotFoundError):  # another process got there first
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    deleted.append(path)
        return deleted

    def close(self) -> None:
        self._file.close()


@dataclass(slots=True)
class LogEntry:
    """One finished request, as the log writes it (plus the token ids of sampled content)."""

    record: dict[str, Any]
    prompt_token_ids: tuple[int, ...] = ()
    completion_token_ids: list[list[int]] = field(default_factory=list)
    with_content: bool = False


class RequestLog:
    """The ingress's request log (settings.enabled must be true)."""

    def __init__(
        self,
        settings: RequestLogSettings,
        detokenize: Callable[[list[int]], Any],
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert settings.enabled and settings.path is not None
        self.settings = settings
        self.detokenize = detokenize
        self.redact = Redactor.from_settings(settings)
        self.num_dropped = 0
        self._random = random.Random()
        self._file = RotatingJsonlFile(
            Path(settings.path),
            f"requests-{socket.gethostname()}-{os.getpid()}",
            settings.max_file_bytes,
            settings.max_file_age_s,
            settings.retention_s,
            clock,
        )
        self._queue: queue.Queue[LogEntry | None] = queue.Queue(QUEUE_SIZE)
        self._thread = threading.Thread(target=self._write_loop, name="pdserve-request-log")
        self._thread.daemon = True
        self._thread.start()

    @property
    def path(self) -> Path:
        """The file being written now."""
        return self._file.path

    def sample_content(self) -> bool:
        """Whether the next request's text is logged (the policy's sampling draw)."""
        return self.settings.log_content and self._random.random() < (
            self.settings.content_sample_ratio
        )

    def submit(self, entry: LogEntry) -> None:
        """Queue one entry for writing; never blocks (dropped and counted when full)."""
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self.num_dropped += 1

    def render(self, entry: LogEntry) -> str:
        """The JSON line of `entry`, its text (if any) detokenized and redacted."""
        record = dict(entry.record)
        if entry.with_content:
            record["content"] = {
                "prompt": self.redact(str(self.detokenize(list(entry.prompt_token_ids)))),
                "completions": [
                    self.redact(str(self.detokenize(list(ids))))
                    for ids in entry.completion_token_ids
                ],
            }
        return json.dumps(record, separators=(",", ":"), default=str)

    def _write_loop(self) -> None:
        while True:
            entry = self._queue.get()
            try:
                if entry is None:
                    break
                self._file.write(self.render(entry))
            except Exception:  # noqa: BLE001 - a bad line or a full disk loses that line only
                logger.exception("request log write failed")
            finally:
                self._queue.task_done()
        self._file.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the writer."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every submitted entry is written (True) or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks
