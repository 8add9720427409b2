"""The `tenants` section: each tenant's API keys, routing rules and quota (`TenantQuota`:
every limit optional, None = unlimited).
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator

from app.config.base import NAME_PATTERN, _check_inline_keys, _Strict, read_api_keys


class TenantQuota(_Strict):
    """A tenant's limits, held globally (every ingress replica draws on the same ones).

    Exceeding one gives 429 with a `code` naming it and a Retry-After from the bucket's
    refill time. Rates are token buckets: `requests_per_second` refills at that rate up to
    `request_burst`; the per-minute token limits refill at value/60 per second up to one
    minute's worth.
    """

    max_concurrent_sequences: int | None = Field(
        default=None,
        ge=1,
        description="Sequences in flight at once; a request with n choices counts n "
        "(code tenant_concurrent_sequences).",
    )
    requests_per_second: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Sustained request rate (code tenant_rate_limit).",
    )
    request_burst: int | None = Field(
        default=None,
        ge=1,
        description="Requests admitted at once above the rate; default ceil(requests_per_second).",
    )
    prompt_tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Prompt tokens admitted per minute, charged at admission "
        "(code tenant_prompt_tokens_per_minute).",
    )
    output_tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Output tokens per minute, charged as they are produced; a tenant in debt "
        "is refused until the bucket refills (code tenant_output_tokens_per_minute).",
    )
    kv_block_share: float | None = Field(
        default=None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Share of each decode pool's KV blocks the tenant's requests may hold, "
        "counted at admission as n x blocks of (prompt + max_tokens), the most a request can "
        "fill (code tenant_kv_share).",
    )
    max_queued_requests: int = Field(
        default=0,
        ge=0,
        description="Requests that may wait for a concurrency slot (higher class first); "
        "0 = refuse at once. Past it: code tenant_queue_full.",
    )

    @model_validator(mode="after")
    def _check(self) -> TenantQuota:
        if self.request_burst is not None and self.requests_per_second is None:
            raise ValueError("quota.request_burst needs quota.requests_per_second")
        return self

    @property
    def burst(self) -> int | None:
        """Capacity of the request bucket (None without a request rate)."""
        if self.requests_per_second is None:
            return None
        return self.request_burst or max(1, math.ceil(self.requests_per_second))


class TenantConfig(_Strict):
    """A client organisation: its API keys, the pools it may use, and its priority.

    Keys come from `api_keys_env` / `api_keys_file` (read by the ingress replica), or inline
    in `api_keys`, which are stored in the app args and so allowed only on a loopback host.
    """

    name: str = Field(pattern=NAME_PATTERN, description="Unique tenant name.")
    api_keys: list[str] = Field(
        default_factory=list,
        description="Inline API keys (loopback hosts only: app args are visible to operators).",
    )
    api_keys_env: str | None = Field(
        default=None,
        min_length=1,
        description="Environment variable holding the tenant's keys (comma/space separated).",
    )
    api_keys_file: str | None = Field(
        default=None, min_length=1, description="File with the tenant's keys, one per line."
    )
    allowed_pools: list[str] = Field(
        default_factory=list, description="Pool names the tenant may use; empty = all pools."
    )
    priority: int = Field(default=0, description="Scheduling priority; lower = more important.")
    max_concurrent_requests: int | None = Field(
        default=None,
        ge=1,
        description="Requests in flight at once, across ingress replicas; None = unlimited "
        "(code tenant_concurrent_requests). quota.max_concurrent_sequences counts n.",
    )
    quota: TenantQuota = Field(
        default_factory=TenantQuota, description="Rate, token and concurrency limits."
    )
    default_class: str | None = Field(
        default=None,
        description="SLO class (admission.classes) of the tenant's requests; its priority "
        "replaces `priority`. None = no class, `priority` applies.",
    )

    _check_keys = field_validator("api_keys")(_check_inline_keys)

    @model_validator(mode="after")
    def _some_key_source(self) -> TenantConfig:
        if not (self.api_keys or self.api_keys_env or self.api_keys_file):
            raise ValueError(
                f"tenant {self.name!r} has no API key: set api_keys_env, api_keys_file or api_keys"
            )
        return self

    def resolve_api_keys(self) -> list[str]:
        """Every key of this tenant, reading its environment variable and file now."""
        return read_api_keys(
            self.api_keys, self.api_keys_env, self.api_keys_file, f"tenant {self.name!r}"
        )
