"""Device memory of one rank of a replica, from the model's shape and the engine settings.

Used to check that a configuration fits its accelerator before anything is deployed
(`tests/app/test_memory.py` checks `configs/h200-70b.yaml` against an H200).
The figures follow what the engine allocates:

- weights: the rank's shard (`engine.parallel`): its part of the decoder projections
  (FP8 with `quantization: fp8`: one byte per weight plus a float32 scale per output
  channel), its `ceil(vocab / size)` rows of the embedding and of the LM head (always its
  own copy, tied or not; model dtype), the replicated norms; on a CPU whose float32
  projections run through the C GEMM (`engine.kernels.gemm_f32`), each packed projection's
  output columns padded to its column blocks;
- KV cache: `kv_cache_bytes` is replica-wide, split evenly over the ranks (`tp_kv`);
- activations: an estimate of one step's peak, `max_num_batched_tokens` rows through the
  widest intermediates plus the gathered float32 logits of `max_num_seqs` rows;
- a fixed allowance for the CUDA context, kernels' workspaces and the allocator's slack.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import DTYPE_BYTES, ModelConfig
from engine.kernels import gemm_f32
from engine.parallel import Shard

GIB = 1024**3
H200_MEMORY_BYTES = 141 * 10**9  # HBM3e per H200 (NVIDIA's figure, decimal gigabytes)
RUNTIME_OVERHEAD_BYTES = 4 * GIB  # CUDA context, cuBLAS/NCCL workspaces, fragmentation
FP8_BYTES = 1
SCALE_BYTES = 4  # float32 per-channel weight scales


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes one rank needs, by use."""

    weights: int
    kv_cache: int
    activations: int
    overhead: int = RUNTIME_OVERHEAD_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.overhead

    def fits(self, device_bytes: int) -> bool:
        return self.total <= device_bytes


def weight_bytes(
    config: ModelConfig, shard: Shard, quantization: str | None = None, device: str = "cuda"
) -> int:
    """Bytes of `shard`'s parameters, as the engine holds them on `device` ("cuda", "cpu")."""
    dtype_bytes = DTYPE_BYTES[config.dtype]
    packs = device == "cpu" and config.dtype == "float32" and gemm_f32.available()

    def columns(num_out: int) -> int:  # a packed projection's stored output columns
        return gemm_f32.packed_width(num_out) if packs else num_out

    hidden, head_dim = config.hidden_size, config.head_dim
    q_out = len(shard.q_heads) * head_dim
    kv_out = len(shard.kv_heads) * head_dim
    inter = len(shard.mlp_columns)
    # (in, out) of each projection of one layer on this rank
    projections = [
        (hidden, q_out + 2 * kv_out),  # qkv: column-parallel
        (q_out, hidden),  # o: row-parallel
        (hidden, 2 * inter),  # gate/up: column-parallel
        (inter, hidden),  # down: row-parallel
    ]
    per_layer = 0
    for num_in, num_out in projections:
        if quantization == "fp8":
            per_layer += num_in * num_out * FP8_BYTES + num_out * SCALE_BYTES
        else:
            per_layer += num_in * columns(num_out) * dtype_bytes
    biases = 0
    if config.attention_bias:
        biases += q_out + 2 * kv_out
        if config.architecture != "qwen2":
            biases += hidden
    if config.mlp_bias:
        biases += 2 * inter + hidden
    norms = 2 * hidden
    per_layer += (biases + norms) * dtype_bytes
    per_layer += 2 * len(shard.kv_heads) * SCALE_BYTES  # per-KV-head scales (FP8 cache)
    vocab = (shard.vocab_rows + columns(shard.vocab_rows)) * hidden * dtype_bytes  # embed + head
    return config.num_hidden_layers * per_layer + vocab + hidden * dtype_bytes  # final norm


def activation_bytes(
    config: ModelConfig, shard: Shard, max_num_batched_tokens: int, max_num_seqs: int
) -> int:
    """An estimate of one step's peak activation memory on `shard`'s rank."""
    dtype_bytes = DTYPE_BYTES[config.dtype]
    head_dim = config.head_dim
    qkv = (len(shard.q_heads) + 2 * len(shard.kv_heads)) * head_dim
    # residual + normed input + attention output + qkv + gate/up + the SiLU product
    width = 3 * config.hidden_size + qkv + 3 * len(shard.mlp_columns)
    logits = max_num_seqs * shard.vocab_rows * shard.size * 4 * 2  # gathered, + softmax
    return max_num_batched_tokens * width * dtype_bytes + logits


def rank_memory(
    config: ModelConfig,
    tensor_parallel_size: int,
    kv_cache_bytes: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    quantization: str | None = None,
    device: str = "cuda",
) -> RankMemory:
    """The largest rank's memory (rank 0: it holds the most KV heads when they split
    unevenly) of a replica of `config` sharded `tensor_parallel_size` ways."""
    shard = Shard(config, 0, tensor_parallel_size)
    return RankMemory(
        weights=weight_bytes(config, shard, quantization, device),
        kv_cache=-(-kv_cache_bytes // tensor_parallel_size),
        activations=activation_bytes(config, shard, max_num_batched_tokens, max_num_seqs),
    )
