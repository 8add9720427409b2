"""Reading an upload (`POST /v1/files`, multipart/form-data) within the size limit.

The body is read up to the file limit plus room for the form's own fields (413 past it,
before the rest is read), then split at the form's boundary: fields `file` (with its
filename) and `purpose`, as the `openai` client sends them.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from app.errors import BadRequestError, PayloadTooLargeError

FORM_OVERHEAD_BYTES = 64 * 1024  # the form's headers and other fields
_BOUNDARY = re.compile(r'boundary="?([^";]+)"?')
_PARAM = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True, slots=True)
class Upload:
    filename: str
    purpose: str
    content: bytes


async def read_upload(
    content_type: str, declared: str | None, chunks: AsyncIterator[bytes], max_file_bytes: int
) -> Upload:
    """The uploaded file and its purpose; `PayloadTooLargeError` (413) past the limit,
    `BadRequestError` (400) for a malformed form."""
    limit = max_file_bytes + FORM_OVERHEAD_BYTES
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), max_file_bytes)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise _too_large(size, max_file_bytes)
        parts.append(chunk)
    fields = parse_form(content_type, b"".join(parts))
    if "file" not in fields or fields["file"][0] is None:
        raise BadRequestError("the form has no file field", param="file")
    filename, content = fields["file"]
    if len(content) > max_file_bytes:
        raise _too_large(len(content), max_file_bytes)
    purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
    if not purpose:
        raise BadRequestError("the form has no purpose field", param="purpose")
    return Upload(filename or "upload.jsonl", purpose, content)


def _too_large(size: int, limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"upload of {size} bytes exceeds this service's file limit of {limit} bytes "
        "(batch.max_file_bytes)",
        param="file",
    )


def parse_form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body: field name -> (filename, bytes)."""
    match = _BOUNDARY.search(content_type)
    if not content_type.lower().startswith("multipart/form-data") or match is None:
        raise BadRequestError("upload a file as multipart/form-data")
    delimiter = b"--" + match.group(1).encode()
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in body.split(delimiter)[1:]:
        if part.startswith(b"--"):
            break  # the closing delimiter
        head, sep, content = part.partition(b"\r\n\r\n")
        if not sep:
            raise BadRequestError("malformed multipart/form-data body")
        params: dict[str, str] = {}
        for line in head.decode("utf-8", "replace").split("\r\n"):
            if line.lower().startswith("content-disposition:"):
                params = dict(_PARAM.findall(line))
        if "name" in params:
            fields[params["name"]] = (params.get("filename"), content.removesuffix(b"\r\n"))
    return fields
