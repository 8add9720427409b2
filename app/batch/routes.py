"""The HTTP routes of the Files and Batch API (OpenAI's paths and shapes).

Thin: authenticate (401), read and check the input (400/413), call the replica's
`BatchService` (404 for what is not the tenant's). The ingress includes `router` and binds
its service when it starts (`bind`); until then, or with `batch.enabled` off, they answer 404.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.batch.service import BatchService
from app.batch.upload import read_upload
from app.errors import BadRequestError, PayloadTooLargeError
from app.protocol import parse_json_object

router = APIRouter()


@dataclass(slots=True)
class _Bound:
    service: BatchService | None = None
    authenticate: Callable[[str | None], str] | None = None
    max_body_bytes: int = 1024**2


_bound = _Bound()


def bind(
    service: BatchService, authenticate: Callable[[str | None], str], max_body_bytes: int
) -> None:
    """Serve the routes of this process with `service` (one ingress replica per process)."""
    _bound.service = service
    _bound.authenticate = authenticate
    _bound.max_body_bytes = max_body_bytes
    service.ensure_started()


def _api_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return None


def _open(request: Request) -> tuple[BatchService, str]:
    """The service and the caller's tenant."""
    if _bound.service is None or _bound.authenticate is None:
        raise StarletteHTTPException(status_code=404, detail="Not Found")
    tenant = _bound.authenticate(_api_key(request))
    _bound.service.ensure_started()
    return _bound.service, tenant


def _limit(request: Request) -> int | None:
    raw = request.query_params.get("limit")
    if raw is None:
        return None
    if not raw.isdigit():
        raise BadRequestError("limit must be a positive integer", param="limit")
    return int(raw)


@router.post("/v1/files")
async def create_file(request: Request) -> JSONResponse:
    service, tenant = _open(request)
    upload = await read_upload(
        request.headers.get("content-type", ""),
        request.headers.get("content-length"),
        request.stream(),
        service.settings.max_file_bytes,
    )
    file = await service.create_file(tenant, upload.filename, upload.purpose, upload.content)
    return JSONResponse(file)


@router.get("/v1/files")
async def list_files(request: Request) -> dict[str, Any]:
    service, tenant = _open(request)
    params = request.query_params
    return await service.list_files(
        tenant, params.get("purpose"), params.get("after"), _limit(request)
    )


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> dict[str, Any]:
    service, tenant = _open(request)
    return await service.get_file(tenant, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> FileResponse:
    service, tenant = _open(request)
    path = await service.file_path(tenant, file_id)
    return FileResponse(path, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    service, tenant = _open(request)
    return await service.delete_file(tenant, file_id)


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict[str, Any]:
    service, tenant = _open(request)
    body = await _json_body(request)
    return await service.create_batch(tenant, body)


@router.get("/v1/batches")
async def list_batches(request: Request) -> dict[str, Any]:
    service, tenant = _open(request)
    return await service.list_batches(tenant, request.query_params.get("after"), _limit(request))


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
    service, tenant = _open(request)
    return await service.get_batch(tenant, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    service, tenant = _open(request)
    return await service.cancel_batch(tenant, batch_id)


async def _json_body(request: Request) -> dict[str, Any]:
    limit = _bound.max_body_bytes
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))
