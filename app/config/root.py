"""The application's configuration: one pydantic model tree, validated at the edge.

`PDServeConfig` is a Serve config file's `applications[0].args`. Unknown keys are errors and
cross-field checks (every prompt length has a pool, every tenant a decode pool, ...) run on
load, before any replica starts. The engine gets frozen dataclasses (`to_engine_config`).
Model, dtype and block size are set once, in `model`, so both pools' KV layouts agree; a
pool may override only engine sizes (`PoolConfig.engine`; `PDServeConfig.engine_config`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from app.config.admission import AdmissionSettings, IngressSettings, check_tenant_classes
from app.config.base import ConfigError, _Strict, read_api_keys
from app.config.batch import BatchSettings
from app.config.http import HttpSettings, LimitSettings
from app.config.model import ModelSettings
from app.config.observability import ObservabilitySettings
from app.config.overload import OverloadSettings
from app.config.pools import PoolConfig, check_prefill_coverage
from app.config.routing import AdaptivePrefillSettings
from app.config.tenants import TenantConfig
from app.config.transfer import TransferSettings
from engine.config import EngineConfig


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
    adaptive_prefill: AdaptivePrefillSettings = Field(
        default_factory=AdaptivePrefillSettings,
        description="Adaptive disaggregation: prompts at or above local_prefill_threshold are "
        "prefilled on the decode replica while the prefill pool's predicted wait is longer.",
    )
    tenants: list[TenantConfig] = Field(
        default_factory=list, description='Empty = no auth: one anonymous tenant "".'
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="Inline admin keys (loopback hosts only); admins may read "
        "/v1/pdserve/stats when tenants are configured.",
    )
    admin_api_keys_env: str | None = Field(
        default=None, min_length=1, description="Environment variable holding the admin keys."
    )
    admin_api_keys_file: str | None = Field(
        default=None, min_length=1, description="File with the admin keys, one per line."
    )
    allow_anonymous: bool = Field(
        default=False,
        description="Serve without tenants (no API keys) on a non-loopback host. Off by "
        "default: such a config refuses to start.",
    )
    limits: LimitSettings = Field(default_factory=LimitSettings, description="Request size limits.")
    admission: AdmissionSettings = Field(
        default_factory=AdmissionSettings,
        description="SLO classes and how ingress replicas share the tenants' quotas.",
    )
    ingress: IngressSettings = Field(
        default_factory=IngressSettings, description="The HTTP ingress deployment."
    )
    overload: OverloadSettings = Field(
        default_factory=OverloadSettings,
        description="Load shedding, request deadlines and circuit breakers.",
    )
    http: HttpSettings = Field(
        default_factory=HttpSettings,
        description="HTTP listener (same as the Serve file's http_options).",
    )
    observability: ObservabilitySettings = Field(
        default_factory=ObservabilitySettings,
        description="Tracing, request log and unit cost.",
    )
    batch: BatchSettings = Field(
        default_factory=BatchSettings,
        description="Offline batch jobs: the OpenAI Files and Batch API.",
    )
    app_name: str = Field(
        default="pdserve",
        min_length=1,
        description=(
            "The application's `name` in a Serve config file (the two must agree). It keys "
            "the app's KV-transfer secret in Ray's internal KV store (apps sharing a cluster "
            "need distinct names) and names the app the benchmarks deploy. Nothing at run "
            "time finds the app by it: Serve names the app where it is deployed (`default` "
            "under `serve run app.main:app`), the ingress asks Serve for its own app's name, "
            "and the handle API finds the app by its ingress deployment."
        ),
    )
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

    def engine_config(self, pool: PoolConfig) -> EngineConfig:
        """The engine config of `pool`'s replicas: `model` with the pool's size overrides
        (model, dtype and block size are shared, so every pool's KV layout agrees); a
        fallback pool's own `model` instead. Prefill replicas never run a decode step, so they
        capture no CUDA graphs (`enforce_eager`)."""
        config = self.model_settings(pool).to_engine_config(pool.engine)
        return dataclasses.replace(config, enforce_eager=True) if pool.role == "prefill" else config

    def model_settings(self, pool: PoolConfig) -> ModelSettings:
        """The model `pool` runs: its own (a fallback pool) or the top-level `model`."""
        return pool.model if pool.model is not None else self.model

    def pools_by_role(self, role: Literal["prefill", "decode"]) -> list[PoolConfig]:
        """The pools of one role, in config order (the fallback pool among the decode ones)."""
        return [pool for pool in self.pools if pool.role == role]

    @property
    def fallback_pool(self) -> PoolConfig | None:
        """The pool marked `fallback`, if any (at most one)."""
        return next((pool for pool in self.pools if pool.fallback), None)

    @model_validator(mode="after")
    def _check_pools(self) -> PDServeConfig:
        names = [pool.name for pool in self.pools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(duplicates)}")
        if not [pool for pool in self.pools_by_role("decode") if not pool.fallback]:
            raise ValueError("at least one pool must have role 'decode' (and not be the fallback)")
        fallbacks = [pool.name for pool in self.pools if pool.fallback]
        if len(fallbacks) > 1:
            raise ValueError(
                f"at most one pool may set fallback: true (got {', '.join(fallbacks)}); the "
                "fallback pool serves the degradable classes of every primary pool"
            )
        self.observability.check_pools(set(names))
        serving = [pool.name for pool in self.pools if pool.serves_decode]
        if serving and not self.adaptive_prefill.enabled:
            raise ValueError(
                f"pools {', '.join(serving)} set serves_decode, which needs "
                "adaptive_prefill.enabled (decode overflow weighs the pools' loads)"
            )
        if self.transfer.backend in ("nccl", "cuda_ipc") and self.model.device != "cuda":
            raise ValueError(
                f"transfer.backend {self.transfer.backend!r} requires model.device 'cuda'"
            )
        for pool in self.pools:
            batched = pool.engine.max_num_batched_tokens
            chunk = self.model_settings(pool).long_prefill_token_threshold
            if batched is not None and batched < chunk:
                raise ValueError(
                    f"pool {pool.name!r}: engine.max_num_batched_tokens ({batched}) < "
                    f"model.long_prefill_token_threshold ({chunk}): a prefill chunk has to "
                    "fit in one step's token budget"
                )
        no_gpu = [
            pool.name
            for pool in self.pools
            if self.model_settings(pool).device == "cuda" and pool.num_gpus <= 0
        ]
        if no_gpu:
            raise ValueError(f"model.device is 'cuda' but pools {', '.join(no_gpu)} set num_gpus 0")
        check_prefill_coverage(
            self.pools_by_role("prefill"),
            self.remote_prefill_lengths,
            self.local_prefill_threshold,
            self.limits.max_prompt_tokens,
        )
        return self

    @model_validator(mode="after")
    def _check_degradable(self) -> PDServeConfig:
        degradable = [c.name for c in self.admission.classes if c.degradable]
        if degradable and self.fallback_pool is None:
            raise ValueError(
                f"admission.classes {', '.join(degradable)} are degradable, but no pool sets "
                "fallback: true to serve them"
            )
        return self

    @model_validator(mode="after")
    def _check_class_timeouts(self) -> PDServeConfig:
        known = {c.name for c in self.admission.classes}
        unknown = sorted(set(self.overload.class_timeouts_s) - known)
        if unknown:
            raise ValueError(
                f"overload.class_timeouts_s names unknown SLO class(es) {', '.join(unknown)} "
                f"(admission.classes: {', '.join(sorted(known)) or 'none'})"
            )
        return self

    def per_rank_transfer(self, pool: PoolConfig) -> bool:
        """Whether `pool`'s replicas move KV with one endpoint per rank (`transfer.per_rank`:
        by default on cuda only); it matters only for tensor_parallel_size > 1."""
        if self.transfer.per_rank is not None:
            return self.transfer.per_rank
        return self.engine_config(pool).device == "cuda"

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> PDServeConfig:
        moving = [
            pool
            for pool in self.pools
            if pool.role == "prefill" or (pool.role == "decode" and not pool.fallback)
        ]
        disaggregated = bool(self.pools_by_role("prefill"))
        for pool in self.pools:
            config = self.engine_config(pool)
            size = config.tensor_parallel_size
            if size == 1:
                continue
            if config.device == "cuda" and pool.num_gpus < size:
                raise ValueError(
                    f"pool {pool.name!r}: a replica with tensor_parallel_size {size} owns "
                    f"{size} GPUs; set num_gpus to {size} (got {pool.num_gpus})"
                )
            if not disaggregated or pool not in moving:
                continue
            if config.device == "cuda" and self.transfer.per_rank is False:
                raise ValueError(
                    f"pool {pool.name!r}: on cuda each rank's KV shard lives on its own GPU, "
                    "so tensor-parallel replicas move KV per rank: transfer.per_rank must "
                    "not be false"
                )
            if config.device == "cuda" and self.transfer.backend not in ("nccl", "cuda_ipc"):
                raise ValueError(
                    f"pool {pool.name!r}: a tensor-parallel cuda replica moves each rank's KV "
                    "from its GPU: transfer.backend must be nccl or cuda_ipc (got "
                    f"{self.transfer.backend!r})"
                )
            if self.per_rank_transfer(pool):
                sizes = {p.name: self.engine_config(p).tensor_parallel_size for p in moving}
                if len(set(sizes.values())) > 1:
                    listed = ", ".join(f"{name}: {n}" for name, n in sizes.items())
                    raise ValueError(
                        "per-rank KV transfer (transfer.per_rank, on by default on cuda) "
                        "moves rank i's shard to rank i: prefill and decode pools need the "
                        f"same tensor_parallel_size (got {listed}); re-sharding KV heads "
                        "between sizes runs on the cpu with per_rank false"
                    )
        return self

    @model_validator(mode="after")
    def _check_spare_threads(self) -> PDServeConfig:
        for pool in self.pools:
            config = self.engine_config(pool)
            spare = config.spare_num_threads
            if spare is None:
                continue
            if config.device != "cpu" or config.tensor_parallel_size > 1:
                raise ValueError(
                    f"pool {pool.name!r}: spare_num_threads is for CPU replicas of one "
                    "process (device cpu, tensor_parallel_size 1)"
                )
            if config.num_threads is not None and spare < config.num_threads:
                raise ValueError(
                    f"pool {pool.name!r}: spare_num_threads ({spare}) below num_threads "
                    f"({config.num_threads}): spare steps would run narrower"
                )
        return self

    @model_validator(mode="after")
    def _check_exposure(self) -> PDServeConfig:
        """Secure defaults for a listener other machines can reach."""
        if self.http.is_loopback:
            return self
        host = self.http.host
        if not self.tenants and not self.allow_anonymous:
            raise ValueError(
                f"http.host {host!r} is reachable from other machines and no tenants are "
                "configured, so anyone could use the service: add tenants with API keys, or "
                "set allow_anonymous: true"
            )
        inline = [t.name for t in self.tenants if t.api_keys]
        if self.admin_api_keys:
            inline.append("admin_api_keys")
        if inline:
            raise ValueError(
                f"inline API keys ({', '.join(inline)}) on non-loopback host {host!r}: app "
                "args are visible in `serve config` and the dashboard; use api_keys_env / "
                "api_keys_file (admin_api_keys_env / admin_api_keys_file) instead"
            )
        return self

    @model_validator(mode="after")
    def _check_tenants(self) -> PDServeConfig:
        tenant_names = [tenant.name for tenant in self.tenants]
        repeated = sorted({name for name in tenant_names if tenant_names.count(name) > 1})
        if repeated:
            raise ValueError(f"tenant names must be unique; repeated: {', '.join(repeated)}")
        _check_unique_keys({tenant.name: tenant.api_keys for tenant in self.tenants})
        pool_names = {pool.name for pool in self.pools}
        for tenant in self.tenants:
            unknown = [name for name in tenant.allowed_pools if name not in pool_names]
            if unknown:
                raise ValueError(
                    f"tenant {tenant.name!r}: allowed_pools names unknown pool(s) "
                    f"{', '.join(unknown)} (pools: {', '.join(sorted(pool_names))})"
                )
            roles = {pool.role for pool in self.allowed_pools(tenant.name) if not pool.fallback}
            if "decode" not in roles:
                raise ValueError(
                    f"tenant {tenant.name!r}: allowed_pools has no decode pool (the fallback "
                    "pool serves only when a primary one is overloaded)"
                )
            if "prefill" not in roles and not self.colocated:
                raise ValueError(f"tenant {tenant.name!r}: allowed_pools has no prefill pool")
        check_tenant_classes(self.admission, self.tenants)
        return self

    def resolve_tenant_keys(self) -> dict[str, str]:
        """API key -> tenant name, reading every tenant's environment variable and file now.

        Raises `ConfigError` when a source is missing or two tenants share a key.
        """
        keys = {tenant.name: tenant.resolve_api_keys() for tenant in self.tenants}
        try:
            _check_unique_keys(keys)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        return {key: name for name, tenant_keys in keys.items() for key in tenant_keys}

    def resolve_admin_keys(self) -> frozenset[str]:
        """The admin keys from every source named (read now)."""
        if not (self.admin_api_keys_env or self.admin_api_keys_file):
            return frozenset(self.admin_api_keys)
        return frozenset(
            read_api_keys(
                self.admin_api_keys, self.admin_api_keys_env, self.admin_api_keys_file, "admin"
            )
        )

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


def _check_unique_keys(keys_by_tenant: Mapping[str, list[str]]) -> None:
    owner: dict[str, str] = {}
    for tenant, keys in keys_by_tenant.items():
        for key in keys:
            if key in owner:
                raise ValueError(
                    f"an API key of tenant {tenant!r} is also a key of tenant "
                    f"{owner[key]!r}; keys must be unique across tenants"
                )
            owner[key] = tenant


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
    # Serve hands build_app only `args`, so they must repeat the file's name (the key of the
    # app's KV secret), prefix and port.
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
