"""Llama-family decoder (Llama, Llama-3 RoPE scaling, Qwen2, Mistral) over a paged KV cache.

Tokens of every sequence in a step are flattened into one dimension; attention reads and
writes the paged cache through `engine.kernels`. Parameter names follow Hugging Face so any local
checkpoint loads; q/k/v and gate/up projections are fused at load time (one matmul each).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kernels import paged_attention, write_kv_cache
from engine.kernels.decode_layers import DecodeLayers
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.norm_rope import apply_rope, silu_and_mul
from engine.kv_cache import TORCH_DTYPES, KVCache
from engine.layers import Linear, RMSNorm, RotaryEmbedding, has_o_proj_bias, projection, scratch
from engine.parallel import TensorParallel, shard_state_dict, single
from engine.quantization import pop_kv_scale, prepare_fp8_weights

LayerHook = Callable[[int], None]


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
            gate_up = proj(x, scratch.take("gate_up", rows, 2 * inter))
            act = silu_and_mul(gate_up, scratch.take("act", rows, inter))
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
