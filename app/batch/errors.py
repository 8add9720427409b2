"""The batch API's own errors (the rest are `app.errors`')."""

from __future__ import annotations

from app.errors import APIError


class NotFoundError(APIError):
    """404: no such file or batch, or one of another tenant (the two look the same)."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"
