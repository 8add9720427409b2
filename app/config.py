"""The application's configuration: one pydantic model tree, validated at the edge.

`PDServeConfig` is a Serve config file's `applications[0].args`. Unknown keys are errors and
cross-field checks (every prompt length has a pool, every tenant a decode pool, ...) run on
load, before any replica starts. The engine gets frozen dataclasses (`to_engine_config`).
Model, dtype and block size are set once, in `model`, so both pools' KV layouts agree.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator, model_validator

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

    def to_engine_config(self) -> EngineConfig:
        """The frozen engine config every replica builds its `Engine` from."""
        return EngineConfig(
            model_dir=self.model,
            dtype=self.dtype,
            device=self.device,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_bytes=self.kv_cache_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            num_threads=self.num_threads,
        )


class AutoscalingSettings(_Strict):
    """Serve autoscaling of one pool (replaces a fixed `num_replicas`)."""

    min_replicas: int = Field(default=1, ge=1, description="Replicas kept at all times.")
    max_replicas: int = Field(default=1, ge=1, description="Most replicas scaled up to.")
    target_ongoing_requests: float = Field(
        default=8.0, gt=0, description="Ongoing requests per replica the autoscaler aims for."
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})"
            )
        return self


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
        }
        if self.autoscaling is not None:
            return {**options, "autoscaling_config": self.autoscaling.model_dump()}
        return {**options, "num_replicas": self.num_replicas}


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


class TenantConfig(_Strict):
    """A client organisation: its API keys, the pools it may use, and its priority."""

    name: str = Field(pattern=_NAME_PATTERN, description="Unique tenant name.")
    api_keys: list[str] = Field(
        min_length=1, description="The tenant's API keys (unique across tenants)."
    )
    allowed_pools: list[str] = Field(
        default_factory=list, description="Pool names the tenant may use; empty = all pools."
    )
    priority: int = Field(default=0, description="Scheduling priority; lower = more important.")
    max_concurrent_requests: int | None = Field(
        default=None, ge=1, description="Quota of in-flight requests; None = unlimited."
    )

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, value: list[str]) -> list[str]:
        if any(not key or key != key.strip() for key in value):
            raise ValueError("api_keys must be non-empty and have no surrounding whitespace")
        if len(set(value)) != len(value):
            raise ValueError("api_keys must not repeat")
        return value


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


class PDServeConfig(_Strict):
    """The whole application: model, pools, KV transfer, tenants and limits."""

    model: ModelSettings = Field(
        default_factory=ModelSettings, description="Model and engine settings of every pool."
    )
    pools: list[PoolConfig] = Field(min_length=1, description="Prefill and decode pools.")
    transfer: TransferSettings = Field(
        default_factory=TransferSettings, description="KV transfer between pools."
    )
    local_prefill_threshold: int = Field(
        default=0,
        ge=0,
        description="Prompts shorter than this are prefilled on the decode replica; 0 = never. "
        "Above limits.max_prompt_tokens: colocated, no prefill pool.",
    )
    tenants: list[TenantConfig] = Field(
        default_factory=list, description='Empty = no auth: one anonymous tenant "".'
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="Keys that may read /v1/pdserve/stats when tenants are configured.",
    )
    limits: LimitSettings = Field(default_factory=LimitSettings, description="Request size limits.")
    http: HttpSettings = Field(
        default_factory=HttpSettings,
        description="HTTP listener (same as the Serve file's http_options).",
    )
    app_name: str = Field(default="pdserve", min_length=1, description="Serve application name.")
    route_prefix: str = Field(default="/", pattern=r"^/", description="HTTP route prefix.")

    @property
    def colocated(self) -> bool:
        """True when every admissible prompt is prefilled on the decode replica."""
        return self.local_prefill_threshold > self.limits.max_prompt_tokens

    @property
    def remote_prefill_lengths(self) -> tuple[int, int] | None:
        """Inclusive prompt-length range that needs a prefill pool, or None if colocated."""
        if self.colocated:
            return None
        return max(self.local_prefill_threshold, 1), self.limits.max_prompt_tokens

    def pools_by_role(self, role: Literal["prefill", "decode"]) -> list[PoolConfig]:
        """The pools of one role, in config order."""
        return [pool for pool in self.pools if pool.role == role]

    @model_validator(mode="after")
    def _check_pools(self) -> PDServeConfig:
        names = [pool.name for pool in self.pools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(duplicates)}")
        if not self.pools_by_role("decode"):
            raise ValueError("at least one pool must have role 'decode'")
        if self.transfer.backend == "nccl" and self.model.device != "cuda":
            raise ValueError("transfer.backend 'nccl' requires model.device 'cuda'")
        if self.model.device == "cuda":
            no_gpu = [pool.name for pool in self.pools if pool.num_gpus <= 0]
            if no_gpu:
                raise ValueError(
                    f"model.device is 'cuda' but pools {', '.join(no_gpu)} set num_gpus 0"
                )
        self._check_coverage()
        return self

    def _check_coverage(self) -> None:
        prefill = self.pools_by_role("prefill")
        needed = self.remote_prefill_lengths
        if needed is None:
            if prefill:
                raise ValueError(
                    f"local_prefill_threshold ({self.local_prefill_threshold}) > "
                    f"limits.max_prompt_tokens ({self.limits.max_prompt_tokens}) prefills "
                    f"every prompt locally, so prefill pool(s) "
                    f"{', '.join(p.name for p in prefill)} would never be used"
                )
            return
        if not prefill:
            raise ValueError(
                f"no prefill pool, but prompts of {needed[0]}..{needed[1]} tokens need remote "
                "prefill; add a prefill pool, or set local_prefill_threshold above "
                "limits.max_prompt_tokens for colocated serving"
            )
        low, high = needed
        for pool in prefill:
            pool_low, pool_high = pool.context_range
            if pool_high < low or pool_low > high:
                raise ValueError(
                    f"prefill pool {pool.name!r} serves lengths {_fmt_range(pool_low, pool_high)}"
                    f", which no remotely prefilled prompt ({low}..{high}) can have"
                )
        gaps = _uncovered(low, high, [pool.context_range for pool in prefill])
        if gaps:
            raise ValueError(
                "prefill pools' context ranges leave prompt lengths "
                f"{', '.join(_fmt_range(a, b) for a, b in gaps)} uncovered (remote prefill "
                f"covers {low}..{high}: local_prefill_threshold..limits.max_prompt_tokens)"
            )

    @model_validator(mode="after")
    def _check_tenants(self) -> PDServeConfig:
        tenant_names = [tenant.name for tenant in self.tenants]
        repeated = sorted({name for name in tenant_names if tenant_names.count(name) > 1})
        if repeated:
            raise ValueError(f"tenant names must be unique; repeated: {', '.join(repeated)}")
        owner: dict[str, str] = {}
        pool_names = {pool.name for pool in self.pools}
        for tenant in self.tenants:
            for key in tenant.api_keys:
                if key in owner:
                    raise ValueError(
                        f"an API key of tenant {tenant.name!r} is also a key of tenant "
                        f"{owner[key]!r}; keys must be unique across tenants"
                    )
                owner[key] = tenant.name
            unknown = [name for name in tenant.allowed_pools if name not in pool_names]
            if unknown:
                raise ValueError(
                    f"tenant {tenant.name!r}: allowed_pools names unknown pool(s) "
                    f"{', '.join(unknown)} (pools: {', '.join(sorted(pool_names))})"
                )
            roles = {pool.role for pool in self.allowed_pools(tenant.name)}
            if "decode" not in roles:
                raise ValueError(f"tenant {tenant.name!r}: allowed_pools has no decode pool")
            if "prefill" not in roles and not self.colocated:
                raise ValueError(f"tenant {tenant.name!r}: allowed_pools has no prefill pool")
        return self

    def allowed_pools(self, tenant: str) -> list[PoolConfig]:
        """Pools `tenant` may use, in config order (all pools for "" or an empty list)."""
        for entry in self.tenants:
            if entry.name == tenant:
                if not entry.allowed_pools:
                    return list(self.pools)
                return [pool for pool in self.pools if pool.name in entry.allowed_pools]
        if tenant == "" and not self.tenants:
            return list(self.pools)
        raise KeyError(tenant)


def _fmt_range(low: int | float, high: int | float) -> str:
    return f"{low}.." + ("inf" if high == math.inf else f"{high}")


def _uncovered(
    low: int, high: int, ranges: list[tuple[int | float, int | float]]
) -> list[tuple[int, int]]:
    """Maximal integer intervals of `low..high` inside none of the inclusive `ranges`."""
    clipped = sorted(
        (max(int(start), low), high if end == math.inf else min(int(end), high))
        for start, end in ranges
    )
    gaps: list[tuple[int, int]] = []
    first_uncovered = low
    for start, end in clipped:
        if start > first_uncovered:
            gaps.append((first_uncovered, start - 1))
        first_uncovered = max(first_uncovered, end + 1)
    if first_uncovered <= high:
        gaps.append((first_uncovered, high))
    return gaps


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> PDServeConfig:
    """Parse a `PDServeConfig` from a YAML file or an already-loaded mapping.

    Accepts a Serve config file (its first application's `args`, which must agree with the
    file's application name, route prefix and http_options) or a bare `PDServeConfig`
    document. Raises `ConfigError`, or pydantic's `ValidationError` for invalid values.
    """
    if isinstance(source, Mapping):
        data: Any = source
    else:
        try:
            with open(source, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {os.fspath(source)!r}: {e}") from e
    if not isinstance(data, Mapping):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    if "applications" not in data:
        return PDServeConfig.model_validate(data)
    apps = data["applications"]
    if not isinstance(apps, list) or not apps or not isinstance(apps[0], Mapping):
        raise ConfigError("'applications' must be a non-empty list of mappings")
    app = apps[0]
    args = app.get("args") or {}
    if not isinstance(args, Mapping):
        raise ConfigError("applications[0].args must be a mapping")
    # Serve hands build_app only `args`, so they must repeat the file's name, prefix and port.
    config = PDServeConfig.model_validate(args)
    http = data.get("http_options") or {}
    for field, ours, theirs in [
        ("app_name", config.app_name, app.get("name", config.app_name)),
        ("route_prefix", config.route_prefix, app.get("route_prefix", config.route_prefix)),
        ("http.host", config.http.host, http.get("host", config.http.host)),
        ("http.port", config.http.port, http.get("port", config.http.port)),
    ]:
        if ours != theirs:
            raise ConfigError(f"args.{field} is {ours!r} but the Serve file says {theirs!r}")
    return config
