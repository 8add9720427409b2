"""Llama-family decoder (Llama, Llama-3 RoPE scaling, Qwen2, Mistral) over a paged KV cache.

Tokens of every sequence in a step are flattened into one dimension; attention reads and
writes the paged cache through `kernels`. Parameter names follow Hugging Face so any local
checkpoint loads; q/k/v and gate/up projections are fused at load time (one matmul each).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.kv_cache import TORCH_DTYPES, KVCache
from kernels import paged_attention, write_kv_cache
from kernels.metadata import AttentionMetadata

LayerHook = Callable[[int], None]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused op; same math as below when no cast is needed
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Linear(nn.Module):
    """`y = x @ W^T + b` with W stored transposed (`weight_t`: `[in, out]`, contiguous).

    Same math as `nn.Linear`, other layout: on the CPU, MKL's GEMM for the few-row inputs
    of a decode step (e.g. 16 rows) runs 4-5x faster on `[in, out]` weights than on
    `nn.Linear`'s `[out, in]`, and as fast for prefill-sized inputs.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [.., out]
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def has_o_proj_bias(config: ModelConfig) -> bool:
    """Llama's attention_bias covers o_proj too; Qwen2's q/k/v bias does not."""
    return config.attention_bias and config.architecture != "qwen2"


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=has_o_proj_bias(config))

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # RoPE on q and k heads together: [num_tokens, num_heads + num_kv_heads, head_dim]
        qk = apply_rope(
            qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, metadata, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    """The whole decoder; `forward` returns final hidden states, `compute_logits` the logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        dtype = TORCH_DTYPES[config.dtype]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied or not, the output projection gets its own transposed copy (see `Linear`).
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary(positions)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache.key_caches[i], kv_cache.value_caches[i], metadata)
            if layer_hook is not None:
                layer_hook(i)  # layer i's K/V for this step are in the cache now
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_rows, vocab]

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights, fusing q/k/v and gate/up. Missing or extra
        tensors raise with their names."""
        remaining = dict(state_dict)
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in remaining:
                raise KeyError(f"checkpoint lacks tensor {name!r}")
            return remaining.pop(name)

        def put(name: str, value: torch.Tensor) -> None:
            param = params[name]
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(value.shape)} != "
                    f"model shape {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value)
            loaded.add(name)

        embed = take("model.embed_tokens.weight")
        put("embed_tokens.weight", embed)
        put("norm.weight", take("model.norm.weight"))
        if self.config.tie_word_embeddings:
            remaining.pop("lm_head.weight", None)
            put("lm_head.weight_t", embed.t())
        else:
            put("lm_head.weight_t", take("lm_head.weight").t())
        for i in range(self.config.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn, mlp = src + "self_attn.", src + "mlp."
            qkv = [take(f"{attn}{p}_proj.weight") for p in "qkv"]
            put(dst + "self_attn.qkv_proj.weight_t", torch.cat(qkv).t())
            if self.config.attention_bias:
                bias = [take(f"{attn}{p}_proj.bias") for p in "qkv"]
                put(dst + "self_attn.qkv_proj.bias", torch.cat(bias))
            put(dst + "self_attn.o_proj.weight_t", take(attn + "o_proj.weight").t())
            if has_o_proj_bias(self.config):
                put(dst + "self_attn.o_proj.bias", take(attn + "o_proj.bias"))
            gate_up = [take(f"{mlp}{p}_proj.weight") for p in ("gate", "up")]
            put(dst + "mlp.gate_up_proj.weight_t", torch.cat(gate_up).t())
            put(dst + "mlp.down_proj.weight_t", take(mlp + "down_proj.weight").t())
            if self.config.mlp_bias:
                bias = [take(f"{mlp}{p}_proj.bias") for p in ("gate", "up")]
                put(dst + "mlp.gate_up_proj.bias", torch.cat(bias))
                put(dst + "mlp.down_proj.bias", take(mlp + "down_proj.bias"))
            put(dst + "input_layernorm.weight", take(src + "input_layernorm.weight"))
            put(
                dst + "post_attention_layernorm.weight",
                take(src + "post_attention_layernorm.weight"),
            )
        # Rotary inv_freq buffers some checkpoints carry are recomputed, not loaded.
        extra = [k for k in remaining if not k.endswith("rotary_emb.inv_freq")]
        if extra:
            raise ValueError(f"checkpoint has tensors the model does not use: {extra[:5]}")
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"model parameters not in checkpoint: {sorted(missing)[:5]}")
