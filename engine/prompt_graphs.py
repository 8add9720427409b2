"""CUDA graphs for steps that hold a prompt (prefill and mixed steps), split around attention.

Eager, such a step launches every kernel of every layer from Python: on the H200 that is
13-25 ms of host time whatever the prompt's size (BENCHMARKS.md), which a short prompt's
TTFT pays in full. Attention is the only part of a layer whose shapes follow the step's
sequences (its metadata: query and sequence lengths, block tables); every other op works on
each token row alone. So a step of `n` tokens runs padded to the smallest captured token
count `T >= n` as `L + 1` graphs (`L` layers) with attention eager between them:

    graph 0:   embed, layer 0's norm and QKV projection (RoPE)   -> q, k, v (static)
    eager:     layer 0's cache write and attention on rows 0..n-1 -> attended (static)
    graph i:   layer i-1's O projection, norm, MLP; layer i's norm and QKV projection
    eager:     layer i's cache write and attention on rows 0..n-1
    graph L:   the last layer's O projection, norm, MLP; the final norm -> hidden (static)

Padding rows (`n..T-1`: token 0 at position 0) only ever meet themselves: they are never
written to the cache nor attended, and their hidden rows are dropped. Each graph reads and
writes static buffers sized for the largest count, so its temporaries die inside it and all
graphs share one memory pool; graphs never run concurrently (one engine thread). A layer
hook (the prefill replica streaming each layer's KV out) runs after the layer's eager part,
as in the eager model. On the CPU the same padded path runs without capture: that is how
tests check it against the eager model.

Not for tensor parallelism (its all-reduces), nor decode-only steps (`engine.cuda_graphs`
pads those by sequence, which attention needs there). Off unless `prompt_cuda_graphs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from engine.config import EngineConfig
from engine.kernels.metadata import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import CausalLM, DecoderLayer, LayerHook

MIN_TOKENS = 16
MAX_TOKENS = 2048  # above this the host's launches are a small share of the step
FINE_FROM = 512  # counts above this step by FINE_STEP (doubling would pad up to 2x)
FINE_STEP = 256
# A step runs eagerly rather than pad more than this (or a quarter of its tokens, if more):
# padding computes every projection for nothing, while a large step's launches are hidden
# behind its GPU time anyway.
MAX_PADDING = 64


def token_buckets(config: EngineConfig) -> tuple[int, ...]:
    """16, 32, ... 512, then every 256, up to the step's token budget (capped at
    `MAX_TOKENS`), which is always one of them."""
    budget = min(config.scheduler.max_num_batched_tokens, MAX_TOKENS)
    sizes = {budget}
    size = MIN_TOKENS
    while size < budget:
        sizes.add(size)
        size = size * 2 if size < FINE_FROM else size + FINE_STEP
    return tuple(sorted(sizes))


def uses_prompt_graphs(config: EngineConfig) -> bool:
    """Whether an engine built from `config` runs prompt steps through `PromptGraphs`."""
    return (
        config.prompt_cuda_graphs
        and config.device.startswith("cuda")
        and config.tensor_parallel_size == 1
    )


class PromptGraphs:
    """Prompt steps of up to `max(token_counts)` tokens, padded and run as graphs captured
    per token count where the cache is on CUDA (see the module docstring). `num_replays`
    counts the steps that took this path."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, token_counts: Sequence[int]) -> None:
        if model.tp.size != 1:
            raise ValueError("prompt graphs need tensor_parallel_size 1")
        if not token_counts or min(token_counts) < 1:
            raise ValueError(f"token counts must be positive, got {list(token_counts)}")
        self.model = model
        self.layers = cast(list[DecoderLayer], list(model.layers))
        self.kv_cache = kv_cache
        self.token_counts = tuple(sorted(set(token_counts)))
        self.device = kv_cache.flat.device
        self.capture = self.device.type == "cuda"
        self.num_replays = 0
        attention = self.layers[0].self_attn
        size, hidden = self.token_counts[-1], model.config.hidden_size
        dtype = model.embed_tokens.weight.dtype

        def buffer(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.input_ids = buffer(size, dtype=torch.int64)
        self.positions = buffer(size, dtype=torch.int64)
        self.q = buffer(size, attention.num_heads, attention.head_dim)
        self.k = buffer(size, attention.num_kv_heads, attention.head_dim)
        self.v = buffer(size, attention.num_kv_heads, attention.head_dim)
        self.attended = buffer(size, attention.q_size)
        self.residual = buffer(size, hidden)
        self.hidden = buffer(size, hidden)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if self.capture:
            self._capture_all()

    @property
    def max_tokens(self) -> int:
        return self.token_counts[-1]

    def can_run(self, num_tokens: int, metadata: AttentionMetadata) -> bool:
        """Whether a step fits: it holds a prompt (decode-only steps have their own graphs)
        and a token count it pads little (`MAX_PADDING`)."""
        if metadata.is_decode_only or not 0 < num_tokens <= self.max_tokens:
            return False
        padding = self._size(num_tokens) - num_tokens
        return padding <= max(MAX_PADDING, num_tokens // 4)

    def _size(self, num_tokens: int) -> int:
        return next(c for c in self.token_counts if c >= num_tokens)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """The step's final hidden states `[num_tokens, hidden]` (a view of a static
        buffer: read it before the next step)."""
        n = input_ids.shape[0]
        size = self._size(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
        graphs = self._graphs.get(size)
        assert graphs is not None or not self.capture, f"no graphs captured for {size} tokens"
        caches = self.kv_cache
        for i, layer in enumerate(self.layers):
            self._segment(size, i, graphs)
            attention = layer.self_attn
            attended = attention.attend(
                self.q[:n],
                self.k[:n],
                self.v[:n],
                caches.key_caches[i],
                caches.value_caches[i],
                metadata,
            )
            self.attended[:n].copy_(attended)
            if layer_hook is not None:
                layer_hook(i)  # layer i's K/V for this step are in the cache now
        self._segment(size, len(self.layers), graphs)
        self.num_replays += 1
        return self.hidden[:n]

    def _segment(self, size: int, index: int, graphs: list[torch.cuda.CUDAGraph] | None) -> None:
        if graphs is not None:
            graphs[index].replay()
        else:
            self._compute(size, index)

    def _compute(self, size: int, index: int) -> None:
        """Segment `index` on the first `size` rows of the static buffers (eager)."""
        model, layers = self.model, self.layers
        cos, sin = model.rotary(self.positions[:size])
        if index == 0:
            h, residual = model.embed(self.input_ids[:size]), None
        else:
            previous = layers[index - 1]
            h = previous.self_attn.output(self.attended[:size])
            x, residual = previous.post_attention_layernorm(h, self.residual[:size])
            h = previous.mlp(x)
        if index == len(layers):
            self.hidden[:size].copy_(model.norm(h, residual)[0])
            return
        layer = layers[index]
        x, residual = layer.input_layernorm(h, residual)
        q, k, v = layer.self_attn.project(x, cos, sin)
        self.q[:size].copy_(q)
        self.k[:size].copy_(k)
        self.v[:size].copy_(v)
        self.residual[:size].copy_(residual)

    def _capture_all(self) -> None:
        """Warm up and capture every segment of every token count, largest first, into one
        memory pool on one side stream (as `engine.cuda_graphs` does for decode)."""
        pool = torch.cuda.graph_pool_handle()
        num_segments = len(self.layers) + 1
        with torch.cuda.device(self.device), torch.inference_mode():
            stream = torch.cuda.Stream(self.device)
            for size in reversed(self.token_counts):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # Triton compiles, the allocator settles
                        for index in range(num_segments):
                            self._compute(size, index)
                torch.cuda.current_stream().wait_stream(stream)
                graphs = []
                for index in range(num_segments):
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: a KV-transfer thread's CUDA calls must not break it
                    with torch.cuda.graph(
                        graph, pool=pool, stream=stream, capture_error_mode="thread_local"
                    ):
                        self._compute(size, index)
                    graphs.append(graph)
                self._graphs[size] = graphs
        torch.cuda.synchronize(self.device)
