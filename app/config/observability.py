"""The `observability` section of the configuration: tracing, the request log, unit cost.

`PDServeConfig.observability` holds
one `ObservabilitySettings`, and `PDServeConfig` checks that `cost` names existing pools.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from app.config.base import _Strict

RedactionRule = Literal["emails", "api_keys", "digits"]


_ALL_RULES: tuple[RedactionRule, ...] = ("emails", "api_keys", "digits")


class TracingSettings(_Strict):
    """OpenTelemetry tracing: one trace per request, across the ingress and both pools."""

    exporter: Literal["none", "jsonl", "otlp"] = Field(
        default="none",
        description="Where finished spans go: none (trace ids are still made and returned "
        "in x-trace-id), jsonl (one span per line, one file per process under `path`), or "
        "otlp (OTLP/HTTP to `endpoint`; needs the `otlp` extra).",
    )
    endpoint: str | None = Field(
        default=None,
        min_length=1,
        description="OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces.",
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        description="jsonl: a directory every replica can write; each process appends to "
        "its own <role>-<pid>.jsonl there.",
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Fraction of new traces recorded (by trace id); a sampled incoming "
        "traceparent is always followed.",
    )
    service_name: str = Field(
        default="pdserve", min_length=1, description="The service.name resource attribute."
    )
    export_delay_ms: int = Field(
        default=1000, gt=0, description="Longest a finished span waits before it is exported."
    )

    @model_validator(mode="after")
    def _check_destination(self) -> TracingSettings:
        if self.exporter == "jsonl" and self.path is None:
            raise ValueError("tracing.exporter 'jsonl' needs tracing.path (a directory)")
        if self.exporter == "otlp" and self.endpoint is None:
            raise ValueError("tracing.exporter 'otlp' needs tracing.endpoint")
        return self


class RequestLogSettings(_Strict):
    """One JSON line per finished request, written by the ingress. Metadata only unless
    content logging is enabled (then sampled and redacted)."""

    enabled: bool = Field(default=False, description="Write the request log.")
    path: str | None = Field(
        default=None,
        min_length=1,
        description="Directory of the log; each ingress process writes "
        "requests-<host>-<pid>.jsonl and rotates it there.",
    )
    max_file_bytes: int = Field(
        default=64 * 1024**2, gt=0, description="Rotate the current file past this size."
    )
    max_file_age_s: float = Field(
        default=3600.0, gt=0, description="Rotate the current file once it is this old."
    )
    retention_s: float = Field(
        default=7 * 86400.0,
        gt=0,
        description="Rotated files older than this are deleted (checked at each rotation "
        "and at start).",
    )
    log_content: bool = Field(
        default=False,
        description="Also log prompt and completion text (redacted) for a sample of requests.",
    )
    content_sample_ratio: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="With log_content: the fraction of requests whose text is logged.",
    )
    redact: list[RedactionRule] = Field(
        default_factory=lambda: list(_ALL_RULES),
        description="Built-in redactions of logged text: emails, api_keys (long "
        "key-like tokens such as sk-...), digits (runs of min_redacted_digits or more).",
    )
    min_redacted_digits: int = Field(
        default=4, ge=1, description="The 'digits' rule redacts runs of at least this many."
    )
    redact_patterns: list[str] = Field(
        default_factory=list, description="Extra regular expressions whose matches are redacted."
    )

    @field_validator("redact_patterns")
    @classmethod
    def _compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"redact_patterns: {pattern!r} is not a regex: {e}") from e
        return patterns

    @model_validator(mode="after")
    def _check_path(self) -> RequestLogSettings:
        if self.enabled and self.path is None:
            raise ValueError("request_log.enabled needs request_log.path (a directory)")
        return self


class PoolCost(_Strict):
    """What one pool costs to run."""

    usd_per_hour: float = Field(ge=0.0, description="Dollars per hour, per `per`.")
    per: Literal["replica", "gpu"] = Field(
        default="replica", description="Whether the price is per replica or per GPU it holds."
    )


class CostSettings(_Strict):
    """Prices of the pools, for $ per request and per 1M tokens in stats and benchmarks."""

    pools: dict[str, PoolCost] = Field(
        default_factory=dict, description="Pool name -> its price; pools not named cost 0."
    )


class MetricsSettings(_Strict):
    """Prometheus metrics (exported through Ray's per-node metrics endpoint)."""

    publish_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="How often each pool replica refreshes its gauges (KV blocks, queues) "
        "and counters from its stats.",
    )
    goodput_ttft_s: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="TTFT target of a request whose SLO class sets none (goodput counter).",
    )
    goodput_tpot_s: float = Field(
        default=0.1,
        gt=0,
        allow_inf_nan=False,
        description="TPOT target of a request whose SLO class sets none (goodput counter).",
    )


class ObservabilitySettings(_Strict):
    """Tracing, the request log and unit cost."""

    tracing: TracingSettings = Field(
        default_factory=TracingSettings, description="OpenTelemetry tracing."
    )
    request_log: RequestLogSettings = Field(
        default_factory=RequestLogSettings, description="Per-request log and its policy."
    )
    cost: CostSettings = Field(default_factory=CostSettings, description="Pool prices.")
    metrics: MetricsSettings = Field(
        default_factory=MetricsSettings, description="Prometheus metrics."
    )

    def check_pools(self, pool_names: set[str]) -> None:
        """Raise ValueError when `cost` prices a pool that does not exist."""
        unknown = sorted(set(self.cost.pools) - pool_names)
        if unknown:
            raise ValueError(
                f"observability.cost.pools names unknown pool(s) {', '.join(unknown)} "
                f"(pools: {', '.join(sorted(pool_names))})"
            )
