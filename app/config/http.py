"""The `http` and `limits` sections: the HTTP listener and request size limits."""

from __future__ import annotations

import ipaddress

from pydantic import Field

from app.config.base import _Strict


class LimitSettings(_Strict):
    """Request size limits enforced at the ingress."""

    max_prompt_tokens: int = Field(default=4096, ge=1, description="Longest prompt, in tokens.")
    max_output_tokens: int = Field(default=1024, ge=1, description="Largest max_tokens allowed.")
    max_body_bytes: int = Field(
        default=1024**2, ge=1, description="Largest HTTP request body, bytes."
    )


class HttpSettings(_Strict):
    """Where the HTTP proxy listens (keep equal to the Serve file's `http_options`)."""

    host: str = Field(default="127.0.0.1", min_length=1, description="Listen address.")
    port: int = Field(default=8000, ge=1, le=65535, description="Listen port.")
    enable_docs: bool = Field(
        default=False, description="Serve FastAPI's /docs, /redoc and /openapi.json."
    )

    @property
    def is_loopback(self) -> bool:
        """True when only this machine can reach the listener."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: assume it is reachable from elsewhere
            return False
