"""The durable store's jobs: batch objects, their results and who runs them.

    <root>/batches/<batch_id>/batch.json     the batch object (OpenAI's shape, plus tenant
                                             and the runner's own figures under "pdserve")
    <root>/batches/<batch_id>/results.jsonl  one record per finished input line, appended
    <root>/batches/<batch_id>/lease.json     the ingress replica running it, until when
    <root>/active/<batch_id>                 present while the job is not finished

A job's life (OpenAI's statuses):

    validating ──▶ in_progress ──▶ finalizing ──▶ completed
        └──────────────┴── cancel ──▶ cancelling ──▶ cancelled      (expired: past its window)

Exactly once: a line's result is appended (one `write` of one JSON line, O_APPEND) before it
counts, a runner taking the job over skips every line that has a record, and readers keep the
first record of a line (a runner that lost its lease may still finish a line another then
runs again). A record torn by a kill mid-write is cut off when the next runner opens the log.
Every change to `batch.json` is a read-modify-write under the job's `flock`, so the API
(cancel) and the runner never lose each other's updates.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.batch.errors import NotFoundError
from app.batch.store import _safe, locked, new_id, read_json, write_json
from app.errors import BadRequestError

TERMINAL = ("completed", "failed", "expired", "cancelled")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}


class JobStore:
    """Batch jobs of every tenant under `<root>` (blocking I/O: call it off the loop)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "batches"
        self.active_dir = root / "active"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.active_dir.mkdir(parents=True, exist_ok=True)

    def job_dir(self, batch_id: str) -> Path:
        return self.dir / _safe(batch_id)

    # ---- the API's side -----------------------------------------------------------------

    def create(
        self,
        tenant: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> dict[str, Any]:
        """A new job, `validating` until a runner takes it."""
        batch_id = new_id("batch_")
        now = int(time.time())
        record = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + COMPLETION_WINDOW_S[completion_window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": dict(metadata or {}),
            "tenant": tenant,
            "pdserve": {"active_s": 0.0},
        }
        self.job_dir(batch_id).mkdir()
        write_json(self.job_dir(batch_id) / "batch.json", record)
        (self.active_dir / batch_id).touch()
        return public(record)

    def _record(self, batch_id: str) -> dict[str, Any]:
        try:
            record: dict[str, Any] = read_json(self.job_dir(batch_id) / "batch.json")
        except FileNotFoundError:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id") from None
        return record

    def get(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """The tenant's batch object (`NotFoundError` for another tenant's)."""
        record = self._record(batch_id)
        if record["tenant"] != tenant:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id")
        return public(record)

    def of_tenant(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's batches, newest first."""
        records = []
        for path in self.dir.glob("batch_*/batch.json"):
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                record = read_json(path)
                if record["tenant"] == tenant:
                    records.append(public(record))
        return sorted(records, key=lambda r: (r["created_at"], r["id"]), reverse=True)

    def cancel(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """Ask the job to stop: `cancelling` until its runner has stopped every line."""
        self.get(tenant, batch_id)

        def change(record: dict[str, Any]) -> None:
            if record["status"] in ("cancelling", "cancelled"):
                return
            if record["status"] in TERMINAL:
                raise BadRequestError(
                    f"Cannot cancel a batch with status {record['status']!r}.",
                    code="batch_not_cancellable",
                )
            record["status"] = "cancelling"
            record["cancelling_at"] = int(time.time())

        return public(self.update(batch_id, change))

    # ---- the runner's side --------------------------------------------------------------

    def update(self, batch_id: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply `change` to the stored record under the job's lock; the new record. A
        terminal status takes the job out of the active list."""
        with locked(self.job_dir(batch_id) / ".lock"):
            record = self._record(batch_id)
            change(record)
            write_json(self.job_dir(batch_id) / "batch.json", record)
        if record["status"] in TERMINAL:
            (self.active_dir / batch_id).unlink(missing_ok=True)
        return record

    def record(self, batch_id: str) -> dict[str, Any]:
        """The stored record, internal fields included."""
        return self._record(batch_id)

    def active_ids(self) -> list[str]:
        """Jobs not finished yet, oldest first."""
        marked = []
        for path in self.active_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):  # finished meanwhile
                marked.append((path.stat().st_mtime, path.name))
        return [name for _, name in sorted(marked) if name.startswith("batch_")]

    def claim(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        """Take or renew the job's lease for `ttl_s`: True when `owner` holds it now (it was
        free, expired, or already its own)."""
        lease_path = self.job_dir(batch_id) / "lease.json"
        with locked(self.job_dir(batch_id) / ".lock"):
            try:
                lease = read_json(lease_path)
            except (FileNotFoundError, json.JSONDecodeError):
                lease = None
            now = time.time()
            if lease is not None and lease["owner"] != owner and lease["expires_at"] > now:
                return False
            write_json(lease_path, {"owner": owner, "expires_at": now + ttl_s})
            return True

    def release(self, batch_id: str, owner: str) -> None:
        """Give the lease up (if `owner` holds it)."""
        lease_path = self.job_dir(batch_id) / "lease.json"
        with (
            locked(self.job_dir(batch_id) / ".lock"),
            contextlib.suppress(FileNotFoundError, json.JSONDecodeError),
        ):
            if read_json(lease_path)["owner"] == owner:
                lease_path.unlink()

    def results(self, batch_id: str) -> ResultLog:
        return ResultLog(self.job_dir(batch_id) / "results.jsonl")


class ResultLog:
    """A job's finished lines: an append-only JSONL file of records keyed by `index`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self) -> dict[int, dict[str, Any]]:
        """Line index -> its first record (a torn last line is skipped)."""
        records: dict[int, dict[str, Any]] = {}
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return records
        for raw in data.split(b"\n"):
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            records.setdefault(int(record["index"]), record)
        return records

    def open(self) -> None:
        """Open for appending, first cutting off a record torn by a kill mid-write."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        size = os.fstat(fd).st_size
        if size:
            data = self.path.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep != size:
                os.ftruncate(fd, keep)
        self._fd = fd

    def append(self, record: dict[str, Any]) -> None:
        """Record one finished line (one write: another appender cannot interleave)."""
        assert self._fd is not None, "open() first"
        os.write(self._fd, json.dumps(record, separators=(",", ":")).encode() + b"\n")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The batch object as the API shows it (without tenant and the runner's figures)."""
    return {k: v for k, v in record.items() if k not in ("tenant", "pdserve")}
