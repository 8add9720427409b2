"""What this machine allows a model's decode and prefill, measured in the same run as the engine.

Two rates, on the torch threads the engine uses:

- memory bandwidth: a streaming read (a sum) of a buffer larger than any last-level cache;
- GEMM rate: the model's four projection shapes (QKV, O, gate/up, down) at prefill-sized
  row counts, in the model's dtype, the faster of `torch.mm` and the engine's own linear
  kernel (`engine.kernels.linear`) per shape.

A decode step reads every weight once and every sequence's KV once, and does
`2 x params` FLOPs per sequence plus attention; its time is at least the larger of
bytes / bandwidth and FLOPs / GEMM rate (`decode_tok_s`). A prompt token needs the same
FLOPs; prefill is compute-bound, so its bound is GEMM rate / FLOPs per token
(`prefill_tok_s`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import DTYPE_BYTES, ModelConfig
from engine.kernels.linear import linear, pack_linear_weight

BANDWIDTH_BYTES = 1 << 30  # read buffer: twice the largest server L3 of today (~512 MiB)
GEMM_MAX_ROWS = 2048


@dataclass(frozen=True, slots=True)
class MachineRates:
    bandwidth_bytes_s: float  # streaming read, best of the repeats
    gemm_flop_s: float  # the model's projection shapes, best implementation per shape


@dataclass(frozen=True, slots=True)
class Roofline:
    decode_tok_s: float
    prefill_tok_s: float
    decode_bytes_per_step: int
    decode_flops_per_step: int
    decode_bound: str  # "bandwidth" or "compute"


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(num_bytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Bytes per second of a streaming read of `num_bytes` on torch's threads."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    return buf.numel() * 4 / best_seconds(buf.sum, repeats)


def projection_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of each decoder layer's projections, QKV and gate/up fused as the engine
    runs them."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return [(hidden, q_size + 2 * kv_size), (q_size, hidden), (hidden, 2 * inter), (inter, hidden)]


def measure_gemm(config: ModelConfig, rows: int, repeats: int = 3) -> float:
    """FLOP/s over the model's projection shapes at `rows` rows, in the model's dtype."""
    dtype = getattr(torch, config.dtype)
    rows = max(1, min(rows, GEMM_MAX_ROWS))
    flops, seconds = 0, 0.0
    for in_features, out_features in projection_shapes(config):
        x = torch.randn(rows, in_features).to(dtype)
        weight_t = torch.randn(in_features, out_features).to(dtype)
        candidates: list[Callable[[], object]] = [functools.partial(torch.mm, x, weight_t)]
        packed = pack_linear_weight(weight_t)
        if packed is not None:
            candidates.append(functools.partial(linear, x, packed, None))
        seconds += min(best_seconds(fn, repeats) for fn in candidates)
        flops += 2 * rows * in_features * out_features
    return flops / seconds


def measure_rates(config: ModelConfig, gemm_rows: int) -> MachineRates:
    return MachineRates(measure_bandwidth(), measure_gemm(config, gemm_rows))


def matmul_params(config: ModelConfig) -> int:
    """Weights every token multiplies by: the decoder projections and the LM head."""
    per_layer = sum(i * o for i, o in projection_shapes(config))
    return config.num_hidden_layers * per_layer + config.hidden_size * config.vocab_size


def attention_flops(config: ModelConfig, context: float) -> float:
    """FLOPs of one token attending to `context` positions (QK^T and PV) in every layer."""
    heads = config.num_attention_heads * config.head_dim
    return 4 * config.num_hidden_layers * heads * context


def roofline(
    config: ModelConfig, rates: MachineRates, batch: int, input_len: int, output_len: int
) -> Roofline:
    """Bounds for `batch` sequences of `input_len` prompt tokens making `output_len` tokens;
    decode at its mean context (`input_len + output_len / 2`)."""
    elem = DTYPE_BYTES[config.dtype]
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    weight_bytes = (matmul_params(config) + norms) * elem
    mean_context = input_len + output_len / 2
    kv_bytes = batch * mean_context * config.kv_bytes_per_token
    step_bytes = int(weight_bytes + kv_bytes)
    step_flops = int(batch * (2 * matmul_params(config) + attention_flops(config, mean_context)))
    bandwidth_s = step_bytes / rates.bandwidth_bytes_s
    compute_s = step_flops / rates.gemm_flop_s
    lm_head = config.hidden_size * config.vocab_size  # only each prompt's last token
    prompt_flops = 2 * (matmul_params(config) - lm_head + lm_head / input_len) + attention_flops(
        config, input_len / 2
    )
    return Roofline(
        decode_tok_s=batch / max(bandwidth_s, compute_s),
        prefill_tok_s=rates.gemm_flop_s / prompt_flops,
        decode_bytes_per_step=step_bytes,
        decode_flops_per_step=step_flops,
        decode_bound="bandwidth" if bandwidth_s >= compute_s else "compute",
    )
