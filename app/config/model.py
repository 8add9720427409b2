"""The `model` section: the model and the engine settings of every pool, and the engine
sizes a pool may override (`EngineOverrides`).
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Literal

from pydantic import Field, model_validator

from app.config.base import _Strict
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.cuda_graphs import check_batch_sizes
from engine.quantization import check_fp8_options


class EngineOverrides(_Strict):
    """Engine sizes one pool sets differently from `model` (unset = `model`'s value).

    Only sizes may differ: model, dtype, block size and the rest stay in `model`, so every
    pool's KV layout agrees and blocks transfer between them as they are (a different TP
    size is re-sharded by KV head on the way, `kvtransfer.reshard`).
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
    spare_num_threads: int | None = Field(
        default=None,
        ge=1,
        description="Torch threads per replica of this pool while it runs only batch lines "
        "sent on an idle service (see `model.spare_num_threads`; CPU, one process).",
    )
    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Ranks one replica of this pool shards the model over (see "
        "`model.tensor_parallel_size`): prefill wide for TTFT, decode narrow for more "
        "replicas. KV heads are re-sharded as they move between pools of different sizes "
        "(CPU, shm and tcp transfer).",
    )

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
    spare_num_threads: int | None = Field(
        default=None,
        ge=1,
        description="Torch threads a replica's steps use while every request it holds is a "
        "batch line the ingress sent with nothing more important running (the cores other "
        "replicas leave idle then: a job on an idle service runs at the whole host's rate); "
        "`num_threads` again from the step after anything else arrives. null: always "
        "`num_threads`. CPU, tensor_parallel_size 1.",
    )
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
        "KV head): GPUs on cuda (set each pool's num_gpus to its TP size), worker processes "
        "on cpu. "
        "A pool may set its own (`engine.tensor_parallel_size`).",
    )
    load_format: Literal["auto", "dummy"] = Field(
        default="auto",
        description="auto: the checkpoint's weights. dummy: random weights of the model's "
        "shape (seeded, the same in every replica; only config.json and a tokenizer are "
        "read), for speed runs of a model without a checkpoint; outputs are noise.",
    )
    enforce_eager: bool = Field(
        default=False,
        description="No CUDA graphs for decode steps (cuda, TP 1): they run eagerly. Prompt "
        "steps have their own switch (prompt_cuda_graphs).",
    )
    prompt_cuda_graphs: bool = Field(
        default=False,
        description="Steps holding a prompt (prefill, mixed) as CUDA graphs captured per "
        "token count (16, 32, ... 512, then every 256 up to max_num_batched_tokens, at most "
        "2048; a step that would pad more than 64 tokens or a quarter runs eagerly), split around "
        "attention, which runs eagerly between them (cuda, TP 1; prefill pools too). Cuts the "
        "host's kernel launches of a short prompt's step; off until measured on a GPU.",
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
            spare_num_threads=sizes.spare_num_threads,
            tensor_parallel_size=sizes.tensor_parallel_size,
            quantization=self.quantization,
            load_format=self.load_format,
            enforce_eager=self.enforce_eager,
            cuda_graph_batch_sizes=self.cuda_graph_batch_sizes,
            prompt_cuda_graphs=self.prompt_cuda_graphs,
        )
