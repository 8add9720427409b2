"""The building blocks of `engine.model`'s decoder: RMSNorm, rotary embeddings, and the
linear layer whose weights are prepacked for the kernel that runs them (`Linear`), with the
per-thread scratch buffers of the MLP's temporaries on the CPU (`scratch`)."""

from __future__ import annotations

import math
import threading

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kernels import gemm_bf16, gemm_f32
from engine.kernels.linear import Packing, linear, linear_ref, pack_linear_weight, packing
from engine.kernels.norm_rope import rms_norm
from engine.quantization import Fp8Linear


class RMSNorm(nn.Module):
    """`forward(x, residual)`: `(norm(x + residual), x + residual)`, the add fused into the
    norm on CUDA (`engine.kernels.norm_rope.rms_norm`)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` (float32), with Llama-3 or linear scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {scaling.rope_type!r}")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up per token."""

    cos: torch.Tensor  # [max_pos, head_dim]
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim] each, broadcast over heads
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class Scratch(threading.local):
    """Float32 buffers per thread for the MLP's temporaries (the gate/up projection's
    output and the gate's), each read by the next op and kept by nothing: a prefill's (tens
    of MB at thousands of tokens) are above the size from which glibc maps fresh pages for
    each allocation, and faulting them in cost ~20 of each 90 ms gate/up GEMM of `small`
    at 4,096 tokens (a Zen 4). Up to `MAX_BYTES` each; larger ones are allocated each time."""

    MAX_BYTES = 256 << 20

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, cols: int) -> torch.Tensor | None:
        numel = rows * cols
        if numel * 4 > self.MAX_BYTES:
            return None
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.bufs[name] = torch.empty(numel, dtype=torch.float32)
        return buf[:numel].view(rows, cols)


scratch = Scratch()


class Linear(nn.Module):
    """`y = x @ W^T + b`, loaded as `weight_t` (`[in, out]`, contiguous).

    On the CPU `pack()` then moves the weight into the packed layout `engine.kernels.linear`
    picks for it (`packing`): float32 goes to the C GEMM's column blocks
    (`engine.kernels.gemm_f32`), bfloat16 to the tiles of the C bfloat16 GEMM
    (`engine.kernels.gemm_bf16`: AMX or AVX512-BF16) or, where neither runs, oneDNN's
    blocked layout. `weight_packed`
    replaces `weight_t` (the same bytes, give or take one block's padding). Elsewhere
    `x @ weight_t` runs: cuBLAS takes either layout, and MKL's GEMM for a decode step's few
    rows is 4-5x faster on `[in, out]` than on `nn.Linear`'s `[out, in]` (and bit-identical).
    """

    weight_t: nn.Parameter | None
    weight_packed: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.weight_packed = None
        self.packing: Packing | None = None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.bias_f32: torch.Tensor | None = None  # "bf16": the bias as the GEMM adds it

    def forward(  # [num_tokens, in] -> [.., out]
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`out`: where the result goes, if the packed float32 GEMM runs (else ignored)."""
        if self.packing == "f32":
            assert self.weight_packed is not None
            return gemm_f32.gemm(x, self.weight_packed, self.out_features, self.bias, out)
        if self.packing == "bf16":
            assert self.weight_packed is not None
            y_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
            y = gemm_bf16.gemm(
                x.to(torch.bfloat16), self.weight_packed, self.out_features, self.bias_f32, y_dtype
            )
            return y.to(x.dtype)
        if self.packing == "onednn":
            assert self.weight_packed is not None
            return linear(x, self.weight_packed, self.bias)
        assert self.weight_t is not None
        return linear_ref(x, self.weight_t, self.bias)

    def pack(self) -> None:
        """Once the weight is loaded: pack it for `engine.kernels.linear` where that runs."""
        kind = None if self.weight_t is None else packing(self.weight_t)
        if kind is None:
            return
        assert self.weight_t is not None
        weight_t = self.weight_t.detach()
        packed: torch.Tensor | None
        if kind == "f32":
            packed = gemm_f32.pack(weight_t)
        elif kind == "bf16":
            packed = gemm_bf16.pack(weight_t)
            if self.bias is not None:
                self.bias_f32 = self.bias.detach().float()
        else:
            packed = pack_linear_weight(weight_t)
        assert packed is not None
        self.weight_packed = nn.Parameter(packed, requires_grad=False)
        self.packing = kind
        self.weight_t = None

    def unpack(self) -> None:
        """Back to a dense `weight_t` (its values to be loaded again): `pack` undone."""
        if self.weight_packed is None:
            return
        self.weight_t = nn.Parameter(torch.empty(self.in_features, self.out_features))
        self.weight_packed = None
        self.packing = None
        self.bias_f32 = None


def projection(config: ModelConfig, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """A decoder projection: `Linear`, or `Fp8Linear` for `quantization: fp8`."""
    if config.quantization == "fp8":
        return Fp8Linear(in_features, out_features, bias)
    return Linear(in_features, out_features, bias)


def has_o_proj_bias(config: ModelConfig) -> bool:
    """Llama's attention_bias covers o_proj too; Qwen2's q/k/v bias does not."""
    return config.attention_bias and config.architecture != "qwen2"
