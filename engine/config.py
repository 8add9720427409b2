"""Frozen engine-internal configuration (pydantic lives at the app edge, not here)."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


class UnsupportedModelError(ValueError):
    """The model directory holds an architecture or file layout we cannot serve."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("llama3") or plain position interpolation ("linear")."""

    rope_type: str  # "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder, parsed from a HF `config.json`."""

    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2: True)
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    # "fp8": decoder projections in FP8 with per-channel scales (`engine.quantization`)
    quantization: str | None = None

    @property
    def max_model_len(self) -> int:
        """Longest sequence we serve exactly (a sliding window caps it: we do full attention)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers."""
        return (
            2
            * self.num_hidden_layers
            * self.num_key_value_heads
            * self.head_dim
            * DTYPE_BYTES[self.dtype]
        )


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache geometry. `num_blocks` is derived from a byte budget by the engine."""

    block_size: int = 16
    kv_cache_bytes: int = 256 * 1024 * 1024
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "fp8" (`engine.kernels.fp8`)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step limits of the continuous-batching scheduler."""

    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # running requests at once
    long_prefill_token_threshold: int = 512  # a single prompt's chunk per step


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str  # a local HF directory, or a built-in name ("tiny", "small")
    dtype: str | None = None  # None = the checkpoint's own dtype
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # torch intra-op threads; None = leave as is
    # Threads of a step while every request held is `Request.spare` (None: num_threads)
    spare_num_threads: int | None = None
    quantization: str | None = None  # "fp8" weights; None = as the checkpoint is stored
    # Ranks (devices) of one replica; > 1: worker processes in lockstep (`engine.tp_worker`)
    tensor_parallel_size: int = 1
    # True: no CUDA graphs for decode steps (`engine.cuda_graphs`; used on cuda with TP 1)
    enforce_eager: bool = False
    # Decode batch sizes captured as CUDA graphs; None: 1, 2, 4, 8, 16, 24, ... max_num_seqs
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # Steps holding a prompt as CUDA graphs split around attention (`engine.prompt_graphs`;
    # cuda, TP 1; independent of enforce_eager, which is about decode steps)
    prompt_cuda_graphs: bool = False
    # "auto": the checkpoint's weights; "dummy": random weights (benchmarks of a bare shape)
    load_format: str = "auto"
