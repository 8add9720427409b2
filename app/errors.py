"""Typed API errors and their OpenAI-style JSON bodies.

Every error the HTTP API returns has the body OpenAI's clients parse:

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

| status | class (when) | type (`invalid_request` = `invalid_request_error`) | code |
| --- | --- | --- | --- |
| 400 | `BadRequestError` (bad values, malformed JSON, schema) | invalid_request | caller's |
| 400 | `UnsupportedFeatureError` (echo, batch, tools) | invalid_request | unsupported_feature |
| 400 | `ContextLengthExceededError` (prompt too long) | invalid_request | context_length_exceeded |
| 401 | `AuthenticationError` (missing/unknown key) | authentication_error | invalid_api_key |
| 403 | `PermissionDeniedError` (pool, SLO class²) | permission_error | permission_denied |
| 404 | `ModelNotFoundError` | invalid_request | model_not_found |
| 404 | unknown route | not_found_error | - |
| 405 | wrong method | invalid_request | method_not_allowed |
| 413 | `PayloadTooLargeError` (body too big) | invalid_request | payload_too_large |
| 429 | `RateLimitError` (tenant over quota) | rate_limit_error | the limit: `tenant_*`¹ |
| 503 | `ServiceUnavailableError` (not ready, overloaded) | service_unavailable_error | caller's |
| 503 | `ReplicaLostError` (replica died mid-request) | service_unavailable_error | replica_lost |
| 504 | `DeadlineExceededError` (the request's timeout passed) | timeout_error | deadline_exceeded |
| 500 | `InternalServerError`, any other exception | server_error | internal_error |

¹ `app/admission/quotas.py:Limit`: tenant_concurrent_requests, tenant_concurrent_sequences,
tenant_rate_limit, tenant_prompt_tokens_per_minute, tenant_output_tokens_per_minute,
tenant_kv_share, tenant_queue_full (the default, rate_limit_exceeded, names none).
² A class more important than the tenant's default: code slo_class_not_allowed.

A prompt over the token limit is a 400 `context_length_exceeded`, as OpenAI answers; 413 is
only for a request body over the byte limit, checked before parsing. Out-of-range sampling values
(`engine.request.InvalidRequestError`) are 400, and a malformed body is 400 "malformed JSON: ...".
Schema violations (pydantic errors: wrong types, missing fields, bounds) are 400 with `param` the
offending field's path (`messages.0.role`), as OpenAI and vLLM answer, never FastAPI's 422.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypedDict

import fastapi
import pydantic
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from engine.request import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

_MAX_LISTED_ERRORS = 8
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


class ErrorDetail(TypedDict):
    """The inner object of an error body."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    """An OpenAI-style error body: `{"error": {...}}`."""

    error: ErrorDetail


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> ErrorBody:
    """Build the JSON body for one error."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class APIError(Exception):
    """Base of the errors the API turns into a status code and an OpenAI-style body.

    Subclasses set `status_code`, `error_type` and optionally `default_code`; `headers` are
    added to the HTTP response (e.g. Retry-After).
    """

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers: dict[str, str] = dict(headers or {})

    def to_body(self) -> ErrorBody:
        """This error's JSON body."""
        return error_body(self.message, self.error_type, self.param, self.code)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled across Ray (handle callers): keep message, param and code, whatever the
        # subclass's constructor takes.
        return _rebuild_api_error, (type(self), dict(self.__dict__))


def _rebuild_api_error(cls: type[APIError], state: dict[str, Any]) -> APIError:
    error = cls.__new__(cls)
    Exception.__init__(error, state["message"])
    error.__dict__.update(state)
    return error


class BadRequestError(APIError):
    """400: the request is well-formed but its values are not acceptable."""

    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedFeatureError(BadRequestError):
    """400: the request asks for an OpenAI feature pdserve does not implement."""

    default_code = "unsupported_feature"


class ContextLengthExceededError(BadRequestError):
    """400: the prompt (plus max_tokens) does not fit the model's or pool's context."""

    default_code = "context_length_exceeded"


class AuthenticationError(APIError):
    """401: the API key is missing or unknown."""

    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"

    def __init__(self, message: str = "invalid or missing API key", **kwargs: Any) -> None:
        kwargs.setdefault("headers", {"WWW-Authenticate": "Bearer"})
        super().__init__(message, **kwargs)


class PermissionDeniedError(APIError):
    """403: the tenant is known but may not use what it asked for (e.g. a pool)."""

    status_code = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class ModelNotFoundError(APIError):
    """404: the requested model is not served here (OpenAI's wording and code)."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.", param="model"
        )


class PayloadTooLargeError(APIError):
    """413: the request body is over the configured byte limit."""

    status_code = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


def _retry_after(retry_after_s: float | None) -> dict[str, str]:
    return {} if retry_after_s is None else {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


class RateLimitError(APIError):
    """429: the tenant is over its quota; `retry_after_s` becomes a Retry-After header."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("headers", _retry_after(retry_after_s))
        super().__init__(message, **kwargs)


class ServiceUnavailableError(APIError):
    """503: not ready yet, or overloaded (code "not_ready" / "overloaded")."""

    status_code = 503
    error_type = "service_unavailable_error"
    default_code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("headers", _retry_after(retry_after_s))
        super().__init__(message, **kwargs)


class ReplicaLostError(ServiceUnavailableError):
    """503: the replica serving this request died (the request may be retried as a whole)."""

    default_code = "replica_lost"

    def __init__(
        self, message: str = "the replica serving this request was lost; retry the request"
    ) -> None:
        super().__init__(message)


class DeadlineExceededError(APIError):
    """504: the request's deadline passed before it completed (it was aborted)."""

    status_code = 504
    error_type = "timeout_error"
    default_code = "deadline_exceeded"


class InternalServerError(APIError):
    """500: a bug or an unexpected failure; the message must not leak internals."""

    status_code = 500
    error_type = "server_error"
    default_code = "internal_error"


def _is_type_tag(part: int | str) -> bool:
    """A union member's tag in a loc ("str", "list[int]", "constrained-str"), not a field."""
    return isinstance(part, str) and (
        "[" in part or part in _UNION_TAGS or part.startswith("constrained-")
    )


def _loc_path(loc: Sequence[int | str]) -> str:
    """`("body", "stop", "list[str]", 0)` -> `"stop.0"` (the "body" and union tags dropped)."""
    parts = [str(p) for p in loc if not _is_type_tag(p)]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts)


def _relevant(errors: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Drop a union's "wrong type" errors for members whose type the input did not have.

    `"stop": ["a", "b", "c", "d", "e"]` fails both members of `str | list[str]`; only the
    list member's "at most 4 items" says what is wrong.
    """
    by_field: dict[str, list[Mapping[str, Any]]] = {}
    for err in errors:
        loc = list(err.get("loc", ()))
        field = _loc_path(loc[: next((i for i, p in enumerate(loc) if _is_type_tag(p)), None)])
        by_field.setdefault(field, []).append(err)
    kept: list[Mapping[str, Any]] = []
    for group in by_field.values():
        specific = [e for e in group if not str(e.get("type", "")).endswith("_type")]
        # Else the member that got furthest into the input ("prompt.1: not an int").
        kept += specific or [max(group, key=lambda e: len(e.get("loc", ())))]
    return kept


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """Pydantic error dicts -> ("path: problem; path: problem", path of the first error)."""
    errors = _relevant(errors)
    lines = []
    for err in errors[:_MAX_LISTED_ERRORS]:
        path = _loc_path(err.get("loc", ()))
        lines.append(f"{path}: {err['msg']}" if path else str(err["msg"]))
    if len(errors) > _MAX_LISTED_ERRORS:
        lines.append(f"... and {len(errors) - _MAX_LISTED_ERRORS} more")
    param = _loc_path(errors[0].get("loc", ())) if errors else None
    return "; ".join(lines), param or None


def _validation_response(errors: Sequence[Mapping[str, Any]]) -> tuple[int, ErrorBody]:
    json_errors = [e for e in errors if e.get("type") == "json_invalid"]
    if json_errors:  # FastAPI reports an unparsable body as a validation error
        reason = (json_errors[0].get("ctx") or {}).get("error", "JSON decode error")
        return 400, error_body(f"malformed JSON: {reason}", "invalid_request_error")
    message, param = validation_message(errors)
    return 400, error_body(message, "invalid_request_error", param)


# SamplingParams' messages start with the field's name ("top_p must be in (0, 1], got 2.0").
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_HTTP_STATUS_TYPES = {404: "not_found_error", 401: "authentication_error", 403: "permission_error"}
_HTTP_STATUS_CODES = {405: "method_not_allowed"}


def bad_request(exc: InvalidRequestError) -> BadRequestError:
    """The engine's `InvalidRequestError` as the API's 400, `param` set from its message."""
    message = str(exc)
    first_word = message.split(" ", 1)[0]
    return BadRequestError(message, param=first_word if first_word in _SAMPLING_FIELDS else None)


def error_response(exc: BaseException) -> tuple[int, ErrorBody]:
    """Map any exception to (HTTP status, OpenAI-style body). Unknown ones are a bare 500."""
    if isinstance(exc, APIError):
        return exc.status_code, exc.to_body()
    if isinstance(exc, RequestValidationError):
        return _validation_response(list(exc.errors()))
    if isinstance(exc, pydantic.ValidationError):
        return _validation_response(exc.errors(include_url=False))
    if isinstance(exc, json.JSONDecodeError):  # before InvalidRequestError: both are ValueErrors
        return 400, error_body(f"malformed JSON: {exc}", "invalid_request_error")
    if isinstance(exc, UnicodeDecodeError):
        return 400, error_body("malformed JSON: body is not valid UTF-8", "invalid_request_error")
    if isinstance(exc, InvalidRequestError):
        return error_response(bad_request(exc))
    if isinstance(exc, StarletteHTTPException):
        error_type = _HTTP_STATUS_TYPES.get(
            exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error"
        )
        code = _HTTP_STATUS_CODES.get(exc.status_code)
        return exc.status_code, error_body(str(exc.detail), error_type, None, code)
    return 500, InternalServerError("internal server error").to_body()


def error_json_response(exc: BaseException) -> JSONResponse:
    """`error_response` as a JSONResponse, with the error's headers (Retry-After, Allow, ...)."""
    status, body = error_response(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, APIError):
        headers = exc.headers
    elif isinstance(exc, StarletteHTTPException) and exc.headers:
        headers = dict(exc.headers)
    return JSONResponse(dict(body), status_code=status, headers=headers)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    status, _ = error_response(exc)
    if status >= 500:
        logger.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_json_response(exc)


def install_error_handlers(app: fastapi.FastAPI) -> None:
    """Make every error `app` returns (ours, validation, 404/405 routes, crashes) OpenAI-shaped."""
    for exc_class in (
        APIError,
        RequestValidationError,
        pydantic.ValidationError,
        json.JSONDecodeError,
        InvalidRequestError,
        StarletteHTTPException,
        Exception,
    ):
        app.add_exception_handler(exc_class, _handle)
