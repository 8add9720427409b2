"""The sections of the application's configuration: model, pools, transfer, tenants, limits.

Each is a strict pydantic model (unknown keys are errors) with a description on every field;
`app/config.py` assembles them into `PDServeConfig` and runs the cross-section checks.
"""

from __future__ import annotations

import ipaddress
import math
import os
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator, model_validator

from app.admission.config import TenantQuota
from engine.config import CacheConfig, EngineConfig, SchedulerConfig

_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,62}$"
_RESERVED_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class ConfigError(ValueError):
    """A configuration file cannot be read or does not have the expected shape."""


class _Strict(BaseModel):
    """Base of every config model: unknown keys (typos) are errors."""

    model_config = ConfigDict(extra="forbid")


class ModelSettings(_Strict):
    """The model and the engine settings shared by every replica of every pool."""

    model: str = Field(
        default="tiny",
        min_length=1,
        description="A local Hugging Face model directory, or a built-in name: tiny, small.",
    )
    served_model_name: str | None = Field(
        default=None,
        description="Name clients send as 'model'; default 'pdserve-' + model basename.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="Weight and KV dtype; None = the checkpoint's own."
    )
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="Where replicas compute.")
    block_size: int = Field(
        default=16, description="Tokens per KV block (a power of two in 1..128)."
    )
    kv_cache_bytes: int = Field(
        default=256 * 1024**2, gt=0, description="KV-cache budget of one replica, in bytes."
    )
    max_num_batched_tokens: int = Field(
        default=2048, gt=0, description="Token budget of one engine step."
    )
    max_num_seqs: int = Field(default=64, gt=0, description="Requests running at once per replica.")
    long_prefill_token_threshold: int = Field(
        default=512, gt=0, description="Largest prefill chunk of one prompt per step."
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse KV of shared prompt prefixes."
    )
    num_threads: int | None = Field(default=None, ge=1, description="Torch threads per replica.")

    @model_validator(mode="after")
    def _check(self) -> ModelSettings:
        if not 1 <= self.block_size <= 128 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in 1..128, got {self.block_size}")
        if self.long_prefill_token_threshold > self.max_num_batched_tokens:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be "
                f"<= max_num_batched_tokens ({self.max_num_batched_tokens}): a prefill chunk "
                "has to fit in one step's token budget"
            )
        if self.served_model_name is None:
            self.served_model_name = "pdserve-" + PurePath(self.model.rstrip("/")).name
        return self

    def to_engine_config(self, overrides: EngineOverrides | None = None) -> EngineConfig:
        """The frozen engine config a replica builds its `Engine` from: these settings,
        with a pool's `overrides` (sizes only) applied."""
        sizes = self.model_copy(update=overrides.set_fields() if overrides else {})
        return EngineConfig(
            model_dir=self.model,
            dtype=self.dtype,
            device=self.device,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_bytes=sizes.kv_cache_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=sizes.max_num_batched_tokens,
                max_num_seqs=sizes.max_num_seqs,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            num_threads=sizes.num_threads,
        )


class EngineOverrides(_Strict):
    """Engine sizes one pool sets differently from `model` (unset = `model`'s value).

    Only sizes may differ: model, dtype, block size and the rest stay in `model`, so every
    pool's KV layout agrees and blocks transfer between them as they are.
    """

    kv_cache_bytes: int | None = Field(
        default=None, gt=0, description="KV-cache budget of one replica of this pool, bytes."
    )
    max_num_batched_tokens: int | None = Field(
        default=None, gt=0, description="Token budget of one engine step in this pool."
    )
    max_num_seqs: int | None = Field(
        default=None, gt=0, description="Requests running at once per replica of this pool."
    )
    num_threads: int | None = Field(
        default=None, ge=1, description="Torch threads per replica of this pool."
    )

    def set_fields(self) -> dict[str, int]:
        """The overrides given (field -> value), without the unset ones."""
        return {name: value for name, value in self.model_dump().items() if value is not None}


class AutoscalingSettings(_Strict):
    """Serve autoscaling of one pool (replaces a fixed `num_replicas`).

    `policy: slo` (default) scales the pool on its own signal (`app/autoscaling.py`):
    prefill on predicted queue wait against `ttft_slo_ms`, decode on KV occupancy and ITL
    against `tpot_slo_ms`. `policy: ongoing_requests` is Serve's built-in policy.
    """

    min_replicas: int = Field(default=1, ge=1, description="Replicas kept at all times.")
    max_replicas: int = Field(default=1, ge=1, description="Most replicas scaled up to.")
    policy: Literal["slo", "ongoing_requests"] = Field(
        default="slo",
        description="slo: the pool's own signal (prefill: queue wait vs TTFT SLO; decode: KV "
        "occupancy and ITL vs TPOT SLO). ongoing_requests: Serve's built-in policy.",
    )
    target_ongoing_requests: float = Field(
        default=8.0,
        gt=0,
        description="Ongoing requests per replica Serve aims for (policy ongoing_requests).",
    )
    ttft_slo_ms: float = Field(
        default=1000.0, gt=0, description="Prefill: the TTFT SLO the pool is sized for, ms."
    )
    queue_wait_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Prefill: predicted queue wait may use this fraction of ttft_slo_ms.",
    )
    prefill_tokens_per_s: float = Field(
        default=1000.0,
        gt=0,
        description="Prefill: tokens/s one replica is assumed to prefill until it has measured "
        "its own rate.",
    )
    tpot_slo_ms: float = Field(
        default=100.0, gt=0, description="Decode: the TPOT/ITL SLO the pool is sized for, ms."
    )
    target_kv_usage: float = Field(
        default=0.7,
        gt=0,
        le=1,
        description="Decode: fraction of KV blocks in use the pool aims for.",
    )
    target_running_seqs: float | None = Field(
        default=None,
        gt=0,
        description="Decode: running sequences per replica the pool aims for; None = ignore.",
    )
    downscale_utilization: float = Field(
        default=0.6,
        gt=0,
        lt=1,
        description="Hysteresis: remove a replica only when the others would be loaded at most "
        "this fraction of target and latency (TTFT, ITL) is under this fraction of its SLO.",
    )
    upscale_cooldown_s: float = Field(
        default=10.0, ge=0, description="Seconds after a scale-up before scaling up again."
    )
    downscale_cooldown_s: float = Field(
        default=30.0,
        ge=0,
        description="Seconds after any scaling before scaling down (one replica at a time).",
    )
    upscale_delay_s: float = Field(
        default=2.0, ge=0, description="Serve: a scale-up decision must hold this long."
    )
    downscale_delay_s: float = Field(
        default=10.0, ge=0, description="Serve: a scale-down decision must hold this long."
    )
    look_back_period_s: float = Field(
        default=10.0, gt=0, description="Serve: window the replicas' signals are averaged over."
    )
    metrics_interval_s: float = Field(
        default=2.0,
        gt=0,
        description="Serve: seconds between a replica's signal reports to the controller.",
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s}) must exceed "
                f"metrics_interval_s ({self.metrics_interval_s}): each window needs a report"
            )
        return self

    def policy_knobs(self) -> dict[str, float | None]:
        """The knobs the SLO policies read (`app/autoscaling.py` `PolicyKnobs` fields)."""
        return self.model_dump(
            exclude={
                "min_replicas",
                "max_replicas",
                "policy",
                "target_ongoing_requests",
                "upscale_delay_s",
                "downscale_delay_s",
                "look_back_period_s",
                "metrics_interval_s",
            }
        )


class PoolConfig(_Strict):
    """One Serve deployment of prefill or decode replicas.

    Replica count: give `num_replicas` or `autoscaling`, not both; with neither, the pool
    has one fixed replica. After validation exactly one of the two is set.
    """

    name: str = Field(
        pattern=_NAME_PATTERN,
        description="Unique pool name: a letter, then letters, digits, _ or -.",
    )
    role: Literal["prefill", "decode"] = Field(description="What the pool's replicas run.")
    num_replicas: int | None = Field(
        default=None, ge=1, description="Fixed replica count (default 1)."
    )
    autoscaling: AutoscalingSettings | None = Field(
        default=None, description="Autoscale instead of num_replicas."
    )
    num_cpus: float = Field(default=1.0, gt=0, description="CPUs reserved per replica.")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs reserved per replica.")
    resources: dict[str, PositiveFloat] = Field(
        default_factory=dict, description='Custom Ray resources per replica: {"h200_prefill": 1}.'
    )
    min_context_tokens: int | None = Field(
        default=None, ge=1, description="Prefill only: shortest prompt served (default 1)."
    )
    max_context_tokens: int | None = Field(
        default=None, ge=1, description="Prefill only: longest prompt served (default unbounded)."
    )
    max_ongoing_requests: int = Field(
        default=64,
        ge=1,
        description="Requests Serve sends one replica at once (Serve's own limit).",
    )
    max_queued_requests: int = Field(
        default=256,
        ge=1,
        description="Requests a caller's handle queues for this pool before refusing more "
        "(Serve's own limit, the last guard against overload: the ingress answers 503 "
        "overloaded; a decode replica prefills locally).",
    )
    engine: EngineOverrides = Field(
        default_factory=EngineOverrides,
        description="Engine sizes of this pool's replicas where they differ from `model`.",
    )
    drain_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="A stopping replica (scale-down, redeploy) finishes its requests for at "
        "most this long before Serve stops it (Serve's graceful_shutdown_timeout_s).",
    )
    drain_poll_s: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between a draining replica's checks for unfinished requests "
        "(Serve's graceful_shutdown_wait_loop_s).",
    )

    @field_validator("resources")
    @classmethod
    def _check_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for key in _RESERVED_RESOURCES.intersection(value):
            raise ValueError(f"resource {key!r} is set by num_cpus/num_gpus, not resources")
        return value

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError(f"pool {self.name!r}: set num_replicas or autoscaling, not both")
        if self.num_replicas is None and self.autoscaling is None:
            self.num_replicas = 1
        has_range = self.min_context_tokens is not None or self.max_context_tokens is not None
        if self.role == "decode" and has_range:
            raise ValueError(
                f"decode pool {self.name!r}: min_context_tokens/max_context_tokens apply to "
                "prefill pools only"
            )
        if self.context_range[0] > self.context_range[1]:
            raise ValueError(
                f"pool {self.name!r}: min_context_tokens ({self.min_context_tokens}) > "
                f"max_context_tokens ({self.max_context_tokens})"
            )
        return self

    @property
    def context_range(self) -> tuple[int | float, int | float]:
        """Inclusive prompt-length range this prefill pool serves (upper bound may be inf)."""
        low = self.min_context_tokens if self.min_context_tokens is not None else 1
        high = self.max_context_tokens if self.max_context_tokens is not None else math.inf
        return low, high

    @property
    def max_num_replicas(self) -> int:
        """The most replicas the pool can have (fixed count, or autoscaling maximum)."""
        if self.autoscaling is not None:
            return self.autoscaling.max_replicas
        assert self.num_replicas is not None
        return self.num_replicas

    def serve_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options(...)` of this pool's deployment."""
        actor = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        options: dict[str, Any] = {
            "name": self.name,
            "ray_actor_options": {**actor, "resources": dict(self.resources)},
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "graceful_shutdown_timeout_s": self.drain_timeout_s,
            "graceful_shutdown_wait_loop_s": self.drain_poll_s,
        }
        if self.autoscaling is not None:
            return {**options, "autoscaling_config": self._autoscaling_config(self.autoscaling)}
        return {**options, "num_replicas": self.num_replicas}

    def _autoscaling_config(self, settings: AutoscalingSettings) -> dict[str, Any]:
        """Serve's `autoscaling_config` dict; the SLO policies live in `app/autoscaling.py`."""
        config: dict[str, Any] = settings.model_dump(
            include={
                "min_replicas",
                "max_replicas",
                "target_ongoing_requests",
                "upscale_delay_s",
                "downscale_delay_s",
                "look_back_period_s",
                "metrics_interval_s",
            }
        )
        if settings.policy == "slo":
            policy = "PrefillPolicy" if self.role == "prefill" else "DecodePolicy"
            config["policy"] = {
                "policy_function": f"app.autoscaling:{policy}",
                "policy_kwargs": settings.policy_knobs(),
            }
        return config


class TransferSettings(_Strict):
    """How KV blocks move from prefill to decode replicas."""

    backend: Literal["shm", "tcp", "nccl", "local"] = Field(
        default="shm",
        description="shm: same host; tcp: across hosts; nccl: GPU; local: in-process.",
    )
    deadline_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a decode replica waits for a request's KV before failing it.",
    )
    checksum: bool = Field(default=False, description="Checksum blocks to detect corruption.")


def _check_inline_keys(value: list[str]) -> list[str]:
    if any(not key or key != key.strip() for key in value):
        raise ValueError("API keys must be non-empty and have no surrounding whitespace")
    if len(set(value)) != len(value):
        raise ValueError("API keys must not repeat")
    return value


def read_api_keys(inline: list[str], env: str | None, path: str | None, owner: str) -> list[str]:
    """The keys of one owner (a tenant, or the admins) from every source it names.

    `env` names an environment variable holding keys separated by commas or whitespace;
    `path` a file with one key per line (blank lines and `#` comments skipped). Both are
    read where this runs (the ingress replica), so the keys never travel in the app args.
    Raises `ConfigError` when a named source is missing or empty.
    """
    keys = list(inline)
    if env is not None:
        value = os.environ.get(env)
        if not value or not value.strip():
            raise ConfigError(f"{owner}: environment variable {env!r} is unset or empty")
        keys += value.replace(",", " ").split()
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except OSError as e:
            raise ConfigError(f"{owner}: cannot read API key file {path!r}: {e}") from e
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ConfigError(f"{owner}: API key file {path!r} holds no key")
        keys += from_file
    return list(dict.fromkeys(keys))


class TenantConfig(_Strict):
    """A client organisation: its API keys, the pools it may use, and its priority.

    Keys come from `api_keys_env` / `api_keys_file` (read by the ingress replica), or inline
    in `api_keys`, which are stored in the app args and so allowed only on a loopback host.
    """

    name: str = Field(pattern=_NAME_PATTERN, description="Unique tenant name.")
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
