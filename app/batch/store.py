"""The durable store's files: uploaded inputs and produced outputs, owned by one tenant.

    <root>/files/<file_id>.json   the file object (OpenAI's shape, plus its tenant)
    <root>/files/<file_id>.data   its bytes

Every write is atomic (a temporary file, then `os.replace`): a reader sees the old state or
the new, never a torn one, and a process killed mid-write leaves at most a stray temporary
file. The content is written before the object, so an object listed always has its bytes.
A tenant sees only its own files: another tenant's id answers 404, as an unknown one does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.batch.errors import NotFoundError

FILE_PURPOSES = ("batch", "batch_output")


def new_id(prefix: str) -> str:
    """A fresh object id (`file-...`, `batch_...`)."""
    return f"{prefix}{secrets.token_hex(12)}"


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one step (readers never see part of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, separators=(",", ":")).encode())


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if absent) across processes."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class FileStore:
    """Files of every tenant under `<root>/files` (blocking I/O: call it off the loop)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)

    def create(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        content: bytes,
        file_id: str | None = None,
    ) -> dict[str, Any]:
        """Store `content`; its file object (`file_id`: a fixed id, for outputs written
        again after a restart)."""
        file_id = file_id or new_id("file-")
        write_atomic(self.dir / f"{file_id}.data", content)
        record = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "tenant": tenant,
        }
        write_json(self.dir / f"{file_id}.json", record)
        return public(record)

    def _record(self, tenant: str, file_id: str) -> dict[str, Any]:
        path = self.dir / f"{_safe(file_id)}.json"
        try:
            record: dict[str, Any] = read_json(path)
        except FileNotFoundError:
            raise NotFoundError(f"No such File object: {file_id}", param="file_id") from None
        if record.get("tenant") != tenant:
            raise NotFoundError(f"No such File object: {file_id}", param="file_id")
        return record

    def get(self, tenant: str, file_id: str) -> dict[str, Any]:
        """The tenant's file object (`NotFoundError` for another tenant's)."""
        return public(self._record(tenant, file_id))

    def content(self, tenant: str, file_id: str) -> bytes:
        """The tenant's file's bytes."""
        self._record(tenant, file_id)
        return (self.dir / f"{file_id}.data").read_bytes()

    def path(self, tenant: str, file_id: str) -> Path:
        """Where the tenant's file's bytes are (to stream them)."""
        self._record(tenant, file_id)
        return self.dir / f"{file_id}.data"

    def delete(self, tenant: str, file_id: str) -> dict[str, Any]:
        """Remove the tenant's file; OpenAI's deletion object."""
        self._record(tenant, file_id)
        (self.dir / f"{file_id}.json").unlink(missing_ok=True)
        (self.dir / f"{file_id}.data").unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def of_tenant(self, tenant: str, purpose: str | None = None) -> list[dict[str, Any]]:
        """The tenant's files, newest first."""
        records = []
        for path in self.dir.glob("file-*.json"):
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                record = read_json(path)
                if record.get("tenant") == tenant and purpose in (None, record["purpose"]):
                    records.append(public(record))
        return sorted(records, key=lambda r: (r["created_at"], r["id"]), reverse=True)


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The object as the API shows it (without its tenant)."""
    return {k: v for k, v in record.items() if k != "tenant"}


def _safe(object_id: str) -> str:
    """An id from a URL, refused when it could name a path outside the store."""
    if not object_id or "/" in object_id or object_id.startswith("."):
        raise NotFoundError(f"No such object: {object_id}")
    return object_id
