"""Llama-family decoder (Llama, Llama-3 RoPE scaling, Qwen2, Mistral) over a paged KV cache.

Tokens of every sequence in a step are flattened into one dimension; attention reads and
writes the paged cache through `engine.kernels`. Parameter names follow Hugging Face so any local
checkpoint loads; q/k/v and gate/up projections are fused at load time (one matmul each).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kernels import gemm_bf16, gemm_f32, paged_attention, write_kv_cache
from engine.kernels.decode_layers import DecodeLayers
from engine.kernels.linear import Packing, linear, linear_ref, pack_linear_weight, packing
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.norm_rope import apply_rope, rms_norm, silu_and_mul
from engine.kv_cache import TORCH_DTYPES, KVCache
from engine.parallel import TensorParallel, shard_state_dict, single
from engine.quantization import Fp8Linear, pop_kv_scale, prepare_fp8_weights

LayerHook = Callable[[int], None]


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


class _Scratch(threading.local):
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


_scratch = _Scratch()


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


class Attention(nn.Module):
    """Column-parallel QKV over this rank's heads, row-parallel O (summed over ranks)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = len(tp.shard.q_heads)
        self.num_kv_heads = len(tp.shard.kv_heads)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = projection(
            config, config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = projection(config, self.q_size, config.hidden_size, has_o_proj_bias(config))
        # Per-KV-head scales of an FP8 KV cache (float32; used only when the cache is FP8)
        self.k_scale = nn.Parameter(torch.ones(self.num_kv_heads), requires_grad=False)
        self.v_scale = nn.Parameter(torch.ones(self.num_kv_heads), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.output(self.attend(q, k, v, k_cache, v_cache, metadata))

    # The three parts of `forward`: `project` and `output` work on each token alone (a
    # step's rows never mix), `attend` mixes a sequence's tokens through the KV cache.
    # `engine.prompt_graphs` captures the first and last and runs `attend` between them.

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[num_tokens, num_heads, head_dim]`, k and v `[num_tokens, num_kv_heads,
        head_dim]`, RoPE applied to q and k."""
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # RoPE on q and k heads together: [num_tokens, num_heads + num_kv_heads, head_dim]
        qk = apply_rope(
            qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write k and v into the cache, attend; `[num_tokens, num_heads * head_dim]`."""
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        k_scale, v_scale = (self.k_scale, self.v_scale) if fp8 else (None, None)
        write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        out = paged_attention(
            q, k_cache, v_cache, metadata, self.scale, k_scale, v_scale, key=k, value=v
        )
        return out.reshape(q.shape[0], self.q_size)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """The O projection, summed over ranks."""
        return self.tp.all_reduce(self.o_proj(attended))


class MLP(nn.Module):
    """Column-parallel gate/up over this rank's columns, row-parallel down (summed)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = len(tp.shard.mlp_columns)
        self.gate_up_proj = projection(
            config, config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = projection(
            config, self.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj, rows, inter = self.gate_up_proj, x.shape[0], self.intermediate_size
        if isinstance(proj, Linear) and proj.packing == "f32":
            gate_up = proj(x, _scratch.take("gate_up", rows, 2 * inter))
            act = silu_and_mul(gate_up, _scratch.take("act", rows, inter))
        else:
            act = silu_and_mul(proj(x))
        return self.tp.all_reduce(self.down_proj(act))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(config, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`h`: the previous layer's MLP output (the embeddings for layer 0, `residual`
        None); `residual`: the stream it adds to. Returns this layer's (MLP output,
        residual); each add is fused into the norm after it."""
        x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, cos, sin, k_cache, v_cache, metadata)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """The whole decoder; `forward` returns final hidden states, `compute_logits` the logits.

    With `tp` of size > 1 this is one rank's shard (`engine.parallel`): every rank calls
    `forward` and `compute_logits` for the same step, and both return the full result.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or single(config)
        dtype = TORCH_DTYPES[config.dtype]
        vocab_rows = tp.shard.vocab_rows
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied or not, the output projection gets its own transposed copy (see `Linear`).
        self.lm_head = Linear(config.hidden_size, vocab_rows, bias=False)
        self.rotary = RotaryEmbedding(config, dtype)
        # The fused decode path for the KV cache it was built for (`_fused_decode`)
        self._decode_layers: tuple[KVCache, DecodeLayers | None] | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        h = self.embed(input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary(positions)
        fused = self._fused_decode(kv_cache) if layer_hook is None else None
        if fused is not None and metadata.is_decode_only and not h.is_cuda:
            # float32: bit for bit the loop below; bfloat16: to bfloat16's precision
            h, residual_out = fused.run(h, cos, sin, metadata)
            return self.norm(h, residual_out)[0]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.key_caches[i], kv_cache.value_caches[i]
            h, residual = layer(h, residual, cos, sin, k_cache, v_cache, metadata)
            if layer_hook is not None:
                layer_hook(i)  # layer i's K/V for this step are in the cache now
        return self.norm(h, residual)[0]

    def _fused_decode(self, kv_cache: KVCache) -> DecodeLayers | None:
        """Every layer of a CPU decode step in one C call, where it applies
        (`engine.kernels.decode_layers`); built once per KV cache."""
        if self._decode_layers is None or self._decode_layers[0] is not kv_cache:
            self._decode_layers = (kv_cache, DecodeLayers.build(self, kv_cache))
        return self._decode_layers[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings `[num_tokens, hidden]` (summed over ranks)."""
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: each rank looks up the ids it owns, zeros elsewhere, then sum.
        local = input_ids - self.tp.shard.vocab_start
        outside = (local < 0) | (local >= self.tp.shard.vocab_rows)
        h = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(self.lm_head(hidden))  # [num_rows, padded vocab]
        return logits[:, : self.config.vocab_size] if self.tp.size > 1 else logits

    def pack_weights(self) -> None:
        """After loading: projections move to the CPU's packed layout (`Linear.pack`)."""
        self._decode_layers = None  # it holds the old weights' addresses
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights, fusing q/k/v and gate/up. Missing or extra
        tensors raise with their names. A shard takes its part of each tensor. With
        `quantization: fp8` projections are quantized (or taken as FP8 with their scales,
        `engine.quantization`); KV-cache scales are taken where the checkpoint has them."""
        quantized = self.config.quantization == "fp8"
        packed = [m for m in self.modules() if isinstance(m, Linear) and m.weight_t is None]
        self._decode_layers = None  # it holds the old weights' addresses
        for module in packed:  # loaded again: dense while loading, packed again after
            module.unpack()
        state = dict(state_dict)
        if quantized:
            prepare_fp8_weights(state)  # whole tensors: TP=N quantizes exactly as TP=1
        remaining = shard_state_dict(state, self.tp.shard)
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

        def put_projection(name: str, sources: list[str]) -> None:
            """`sources` (HF prefixes) fused along their output rows into projection `name`."""
            put(name + ".weight_t", torch.cat([take(src + ".weight") for src in sources]).t())
            if quantized:
                scales = [take(src + ".weight_scale") for src in sources]
                put(name + ".weight_scale", torch.cat(scales))

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
            put_projection(dst + "self_attn.qkv_proj", [f"{attn}{p}_proj" for p in "qkv"])
            if self.config.attention_bias:
                bias = [take(f"{attn}{p}_proj.bias") for p in "qkv"]
                put(dst + "self_attn.qkv_proj.bias", torch.cat(bias))
            put_projection(dst + "self_attn.o_proj", [attn + "o_proj"])
            num_kv_heads = len(self.tp.shard.kv_heads)
            for name in ("k_scale", "v_scale"):
                put(dst + "self_attn." + name, pop_kv_scale(remaining, attn + name, num_kv_heads))
            if has_o_proj_bias(self.config):
                put(dst + "self_attn.o_proj.bias", take(attn + "o_proj.bias"))
            put_projection(dst + "mlp.gate_up_proj", [mlp + "gate_proj", mlp + "up_proj"])
            put_projection(dst + "mlp.down_proj", [mlp + "down_proj"])
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
        for module in packed:
            module.pack()
