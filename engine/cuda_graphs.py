"""CUDA graphs for decode steps: static input buffers, one captured graph per batch size.

A pure-decode step (every sequence brings one new token) of `n` sequences, with no layer
hook, runs padded to the smallest captured size `B >= n`: the step's inputs (token ids,
positions, slot mapping, sequence lengths, block tables) are copied into rows `0..n-1` of
static buffers, and rows `n..B-1` become padding: token 0 at position 0 in a context of one
token, whose K/V go to the *scratch block* (a KV-cache block the engine keeps out of the
block pool, so no request ever owns it) and whose logits are dropped. Padding rows all
compute the same K/V, so their writes to the one scratch slot agree. A real row reads only
its own blocks, up to its sequence length; nothing ever reads the scratch block for it.

On CUDA the forward and the logits of each size are captured once at startup, after the
KV cache exists (each size warmed up first, largest size first, all graphs in one memory
pool and on one side stream, each copying its logits into the top rows of one shared
output buffer), and a step is a few copies and one `CUDAGraph.replay`. Graph mode has no host syncs
in the forward: the Triton kernels take their grid from the static batch size and read
sequence lengths on the device, and the metadata's Python lengths are the static maximum
(`max_blocks_per_seq * block_size`). Anywhere else (the CPU) the same padded static path
runs eagerly, with the step's own lengths: that is how CPU tests check the padding.

Everything else runs eagerly in `ModelRunner`: prefill and mixed steps, batches above the
largest captured size, steps with a layer hook, tensor parallelism, `enforce_eager`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.kernels.metadata import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import CausalLM


def default_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to `max_num_seqs` (which is always one of them)."""
    sizes = {1, 2, 4, 8, *range(16, max_num_seqs + 1, 8), max_num_seqs}
    return tuple(sorted(s for s in sizes if s <= max_num_seqs))


def check_batch_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """Validate configured capture sizes (ValueError naming the problem); sorted."""
    if not sizes:
        raise ValueError("cuda_graph_batch_sizes must name at least one batch size")
    bad = [s for s in sizes if not 1 <= s <= 4096]
    if bad:
        raise ValueError(f"cuda_graph_batch_sizes must be in 1..4096, got {bad}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"cuda_graph_batch_sizes has repeated sizes: {list(sizes)}")
    return tuple(sorted(sizes))


def uses_decode_graphs(config: EngineConfig) -> bool:
    """Whether an engine built from `config` captures decode graphs by default."""
    return (
        config.device.startswith("cuda")
        and not config.enforce_eager
        and config.tensor_parallel_size == 1
    )


def capture_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The sizes an engine captures: the configured ones up to `max_num_seqs` (a step never
    has more sequences; if none is, `max_num_seqs` itself), or the default ladder."""
    max_num_seqs = config.scheduler.max_num_seqs
    if config.cuda_graph_batch_sizes is None:
        return default_batch_sizes(max_num_seqs)
    sizes = check_batch_sizes(config.cuda_graph_batch_sizes)
    return tuple(s for s in sizes if s <= max_num_seqs) or (max_num_seqs,)


class DecodeGraphs:
    """Padded static-buffer decode steps, captured as CUDA graphs where the cache is on CUDA.

    Owns the static inputs and the graphs; the engine owns `scratch_block` (it keeps it out
    of the block pool). `num_replays` counts the steps that took this path.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        batch_sizes: Sequence[int],
        scratch_block: int,
        max_blocks_per_seq: int,
    ) -> None:
        if not 0 <= scratch_block < kv_cache.num_blocks:
            raise ValueError(f"scratch block {scratch_block} outside the KV cache")
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = check_batch_sizes(batch_sizes)
        self.scratch_block = scratch_block
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = kv_cache.block_size
        self.device = kv_cache.flat.device
        self.capture = self.device.type == "cuda"
        self.num_replays = 0
        size = self.batch_sizes[-1]

        # Static inputs, all rows padding to begin with (warm-up and capture write only the
        # scratch block). [size] each, block tables [size, max_blocks_per_seq].
        def buffer(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=self.device)

        self.input_ids = buffer((size,), 0)
        self.positions = buffer((size,), 0)
        self.slot_mapping = buffer((size,), scratch_block * self.block_size)
        self.seq_lens = buffer((size,), 1)
        self.block_tables = buffer((size, max_blocks_per_seq), scratch_block)
        # one query per row, always
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int64, device=self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # [max size, vocab]: every graph copies its logits into the top rows of this one
        # buffer (one graph's output at a time; one per size would cost sum(sizes) rows)
        self._logits: torch.Tensor | None = None
        if self.capture:
            self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """Whether this step fits the padded path (the caller checks for a layer hook)."""
        return (
            metadata.is_decode_only
            and 0 < metadata.num_seqs <= self.max_batch_size
            and metadata.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Run a step `can_run` accepted; returns the logits `[num_seqs, vocab]` of its rows
        (a view of a static output on CUDA: read it before the next step)."""
        num_seqs = metadata.num_seqs
        size = next(s for s in self.batch_sizes if s >= num_seqs)
        self._load(input_ids, positions, metadata, size)
        self.num_replays += 1
        if self.capture:
            assert self._logits is not None
            self._graphs[size].replay()
            return self._logits[:num_seqs]
        pad = size - num_seqs
        seq_lens_list = metadata.seq_lens_list + (1,) * pad
        return self._forward(size, seq_lens_list)[:num_seqs]

    def _load(
        self,
        input_ids: torch.Tensor,  # [num_seqs]
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        size: int,
    ) -> None:
        """Rows `0..n-1` from the step, rows `n..size-1` back to padding."""
        n = metadata.num_seqs
        num_columns = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        # Columns past the step's own are stale but never read: a row reads its seq_len only.
        self.block_tables[:n, :num_columns].copy_(metadata.block_tables, non_blocking=True)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.scratch_block * self.block_size)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].fill_(self.scratch_block)

    def _metadata(self, size: int, seq_lens_list: tuple[int, ...]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_list=(1,) * size,
            seq_lens_list=seq_lens_list,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def _forward(self, size: int, seq_lens_list: tuple[int, ...]) -> torch.Tensor:
        """The model's pass over the first `size` static rows, and all their logits."""
        metadata = self._metadata(size, seq_lens_list)
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, metadata)
        return self.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        """Warm up and capture every size, largest first, into one shared memory pool."""
        pool = torch.cuda.graph_pool_handle()
        static_max = (self.max_blocks_per_seq * self.block_size,)
        with torch.cuda.device(self.device), torch.inference_mode():
            # One side stream on our device for every warm-up and capture: graph()'s default
            # stream is made once per process on whatever device was current then, and
            # graphs sharing a pool should be captured on the same stream.
            stream = torch.cuda.Stream(self.device)
            for size in reversed(self.batch_sizes):
                lengths = static_max * size
                # Warm up on the side stream (Triton compiles, allocator settles), as the
                # torch.cuda.graphs docs ask; then capture on it.
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        logits = self._forward(size, lengths)
                torch.cuda.current_stream().wait_stream(stream)
                if self._logits is None:  # the largest size comes first
                    self._logits = torch.empty_like(logits)
                del logits
                graph = torch.cuda.CUDAGraph()
                # thread_local: a KV-transfer thread's CUDA calls must not break the capture
                with torch.cuda.graph(
                    graph, pool=pool, stream=stream, capture_error_mode="thread_local"
                ):
                    self._logits[:size].copy_(self._forward(size, lengths))
                self._graphs[size] = graph
        torch.cuda.synchronize(self.device)


def build_decode_graphs(
    config: EngineConfig, model: CausalLM, kv_cache: KVCache, max_model_len: int
) -> DecodeGraphs:
    """An engine's decode graphs; the scratch block is the KV cache's last block (the
    engine's block pool then holds one block fewer)."""
    if kv_cache.num_blocks < 2:
        raise ValueError(
            f"the KV cache holds {kv_cache.num_blocks} block(s): CUDA graphs need one more "
            "than a request does (a scratch block); raise kv_cache_bytes or set enforce_eager"
        )
    scratch_block = kv_cache.num_blocks - 1
    max_blocks = min(-(-max_model_len // kv_cache.block_size), scratch_block)
    return DecodeGraphs(model, kv_cache, capture_sizes(config), scratch_block, max_blocks)
