"""The sections of the application's configuration: model, transfer, tenants, limits, http.

Pools and their autoscaling are in `app/config_pools.py`.

Each is a strict pydantic model (unknown keys are errors) with a description on every field;
`app/config.py` assembles them into `PDServeConfig` and runs the cross-section checks.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import PurePath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.admission.config import TenantQuota
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.cuda_graphs import check_batch_sizes
from engine.quantization import check_fp8_options

NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,62}$"


class ConfigError(ValueError):
    """A configuration file cannot be read or does not have the expected shape."""


class _Strict(BaseModel):
    """Base of every config model: unknown keys (typos) are errors."""

    model_config = ConfigDict(extra="forbid")


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

    @model_validator(mode="before")
    @classmethod
    def _no_tensor_parallel(cls, data: object) -> object:
        if isinstance(data, dict) and "tensor_parallel_size" in data:
            raise ValueError(
                "tensor_parallel_size is set once, in `model`, not per pool: prefill and "
                "decode pools must use the same TP size (the KV shard of prefill rank i "
                "moves to decode rank i)"
            )
        return data

    def set_fields(self) -> dict[str, int]:
        """The overrides given (field -> value), without the unset ones."""
        return {name: value for name, value in self.model_dump().items() if value is not None}


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
    quantization: Literal["fp8"] | None = Field(
        default=None,
        description="fp8: decoder projections in float8_e4m3fn with per-output-channel scales "
        "(quantized at load, or an FP8 checkpoint's own); embedding, norms and LM head stay "
        "in dtype. null: as the checkpoint is stored (an FP8 checkpoint loads as fp8).",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto",
        description="KV cache storage: auto = dtype; fp8 = float8_e4m3fn with a static scale "
        "per KV head (the checkpoint's k_scale/v_scale, else 1.0): half of bf16's bytes, "
        "in the cache and on the wire. Every pool uses the same, so KV moves as it is.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ranks one replica shards the model over (Megatron-style, KV split by "
        "KV head): GPUs on cuda (set each pool's num_gpus to it), worker processes on cpu. "
        "Shared by every pool, so KV moves from prefill rank i to decode rank i.",
    )
    enforce_eager: bool = Field(
        default=False, description="No CUDA graphs for decode steps (cuda, TP 1): all eager."
    )
    cuda_graph_batch_sizes: tuple[int, ...] | None = Field(
        default=None,
        description="Decode batch sizes captured as CUDA graphs at replica start (a step of "
        "n requests replays the smallest size >= n, padded; larger ones run eagerly). null: "
        "1, 2, 4, 8, then every 8 up to max_num_seqs; sizes above max_num_seqs are skipped.",
    )

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
        check_fp8_options(
            self.quantization,
            self.kv_cache_dtype,
            self.dtype,
            self.device,
        )
        if self.cuda_graph_batch_sizes is not None:
            check_batch_sizes(self.cuda_graph_batch_sizes)
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
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=sizes.max_num_batched_tokens,
                max_num_seqs=sizes.max_num_seqs,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            num_threads=sizes.num_threads,
            tensor_parallel_size=self.tensor_parallel_size,
            quantization=self.quantization,
            enforce_eager=self.enforce_eager,
            cuda_graph_batch_sizes=self.cuda_graph_batch_sizes,
        )


class TransferSettings(_Strict):
    """How KV blocks move from prefill to decode replicas."""

    backend: Literal["shm", "tcp", "nccl", "cuda_ipc"] = Field(
        default="shm",
        description="shm: same host; tcp: across hosts; nccl: GPU (the default between "
        "GPUs); cuda_ipc: GPUs of one node, written through CUDA IPC (one GPU shared by "
        "prefill and decode, or GPUs with peer access that both processes see).",
    )
    bind_host: str = Field(
        default="0.0.0.0",
        description="tcp/nccl: the IP address decode replicas listen on for KV (0.0.0.0: all).",
    )
    advertise_host: str | None = Field(
        default=None,
        min_length=1,
        description="tcp/nccl: the address prefill replicas reach a decode replica at; "
        "default: bind_host, or the node's IP from Ray when bind_host is a wildcard.",
    )
    source_host: str | None = Field(
        default=None,
        description="tcp: the local IP address prefill replicas' KV connections leave from "
        "(default: the system's choice).",
    )
    deadline_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a decode replica waits for a request's KV before failing it.",
    )
    checksum: bool = Field(default=False, description="Checksum blocks to detect corruption.")

    @field_validator("bind_host", "source_host")
    @classmethod
    def _ip_address(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise ValueError(f"{value!r} is not an IP address") from None
        return value

    @field_validator("advertise_host")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        if value in ("0.0.0.0", "::"):
            raise ValueError("advertise_host must be an address peers can connect to")
        return value


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
