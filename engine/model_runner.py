"""Turns a scheduler step into tensors, runs the model, samples. Decides no policy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.cuda_graphs import DecodeGraphs
from engine.kernels.metadata import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import CausalLM, LayerHook
from engine.prompt_graphs import PromptGraphs
from engine.request import Request
from engine.sampler import Sampler, SamplingBatch, make_generator
from engine.scheduler import SchedulerOutput
from engine.tp_worker import RankSends, StepInput, TPWorkers

Sampled = dict[str, tuple[int, dict[int, float] | None]]


@dataclass(frozen=True, slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_seqs]: last new token of each sampling seq
    sampling_requests: list[Request]


def _new_token_ids(request: Request, start: int, num: int) -> list[int]:
    """Tokens `start:start+num` of prompt+output without concatenating the whole history."""
    num_prompt = request.num_prompt_tokens
    if start >= num_prompt:
        return request.output_token_ids[start - num_prompt : start - num_prompt + num]
    if start + num <= num_prompt:
        return request.prompt_token_ids[start : start + num]
    return request.all_token_ids[start : start + num]


class ModelRunner:
    """Rank 0's runner; with `workers` (tensor parallelism) it sends each step's inputs
    to the other ranks before running its own shard, and samples alone. With `graphs`,
    decode steps they fit run through them (`engine.cuda_graphs`); with `prompt_graphs`,
    steps holding a prompt that fit (`engine.prompt_graphs`); all else eagerly."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        device: torch.device,
        workers: TPWorkers | None = None,
        graphs: DecodeGraphs | None = None,
        prompt_graphs: PromptGraphs | None = None,
    ) -> None:
        self.model = model
        self.graphs = graphs
        self.prompt_graphs = prompt_graphs
        self.kv_cache = kv_cache
        self.device = device
        self.workers = workers
        self.block_size = kv_cache.block_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    def prepare(self, output: SchedulerOutput) -> ModelInput:
        """The step's tensors, built in plain Python and numpy and made tensors once each:
        a torch op per sequence (the block table, its slots) cost ~30 us a row, 2 ms of a
        64-sequence step whose model runs in a few."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling_requests: list[Request] = []
        max_blocks = max(len(s.block_table) for s in output.scheduled)
        tables = np.zeros((len(output.scheduled), max_blocks), dtype=np.int64)
        bs = self.block_size
        for row, item in enumerate(output.scheduled):
            request, num_new, table = item.request, item.num_new_tokens, item.block_table
            start = request.num_computed_tokens
            input_ids.extend(_new_token_ids(request, start, num_new))
            positions.extend(range(start, start + num_new))
            tables[row, : len(table)] = table
            if num_new == 1:  # a decode row
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, start + num_new, dtype=np.int64)
                slots.extend((tables[row, pos // bs] * bs + pos % bs).tolist())
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
            if item.samples:
                logits_indices.append(len(input_ids) - 1)
                sampling_requests.append(request)
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            query_lens_list=tuple(query_lens),
            seq_lens_list=tuple(seq_lens),
            block_size=bs,
        )
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            sampling_requests=sampling_requests,
        )

    def execute(self, output: SchedulerOutput, layer_hook: LayerHook | None = None) -> Sampled:
        """Run one step; return request id → (token id, logprobs) for sampling requests.

        If it raises, the seeded requests' generators are as they were before the call.
        """
        if output.is_empty:
            return {}
        model_input = self.prepare(output)
        if self.workers is None:
            logits = self._forward(model_input, layer_hook)
        else:
            # Per-rank KV transfer: each rank sends its own shard (`kvtransfer.ranks`).
            hook: LayerHook | None
            if isinstance(layer_hook, RankSends):
                sends, hook = layer_hook.sends, layer_hook
            else:
                sends, hook = (), _per_rank(layer_hook, self.workers.tp.size)
            self.workers.start_step(_step_input(model_input, sends))
            try:
                logits = self._forward(model_input, hook)
            except BaseException:
                self.workers.broken = True  # the other ranks may wait in a collective
                raise
        if logits is None:
            return {}
        batch = SamplingBatch.from_requests(
            model_input.sampling_requests, self._generators_for(model_input.sampling_requests)
        )
        states = [(g, g.get_state()) for g in batch.generators if g is not None]
        try:
            result = self.sampler(logits, batch)
        except BaseException:
            for generator, state in states:  # the step is retried: same draws then
                generator.set_state(state)
            raise
        return {
            request.request_id: (token_id, logprobs)
            for request, token_id, logprobs in zip(
                model_input.sampling_requests, result.token_ids, result.logprobs, strict=True
            )
        }

    def _forward(
        self, model_input: ModelInput, layer_hook: LayerHook | None
    ) -> torch.Tensor | None:
        """The model's pass, then the logits of the sampling rows (None: no sampling)."""
        graphs, metadata = self.graphs, model_input.metadata
        if graphs is not None and layer_hook is None and graphs.can_run(metadata):
            logits = graphs.run(model_input.input_ids, model_input.positions, metadata)
            # a decode step's row i is its token i, so logits_indices index the rows
            return logits[model_input.logits_indices] if model_input.sampling_requests else None
        prompts, num_tokens = self.prompt_graphs, model_input.input_ids.shape[0]
        if prompts is not None and prompts.can_run(num_tokens, metadata):
            hidden = prompts.run(model_input.input_ids, model_input.positions, metadata, layer_hook)
        else:
            hidden = self.model(
                model_input.input_ids, model_input.positions, self.kv_cache, metadata, layer_hook
            )
        if not model_input.sampling_requests:
            return None
        return self.model.compute_logits(hidden[model_input.logits_indices])

    def _generators_for(self, requests: list[Request]) -> dict[str, torch.Generator]:
        for request in requests:
            seed = request.sampling_params.seed
            if seed is not None and request.request_id not in self._generators:
                self._generators[request.request_id] = make_generator(seed)
        return self._generators

    def forget(self, request_id: str) -> None:
        """Drop per-request state (the seeded generator) once the request has finished."""
        self._generators.pop(request_id, None)


def _step_input(
    model_input: ModelInput, kv_sends: tuple[tuple[str, tuple[int, ...]], ...] = ()
) -> StepInput:
    """What the other ranks need of a step (CPU tensors: they move to their own device)."""
    m = model_input.metadata
    metadata = AttentionMetadata(
        slot_mapping=m.slot_mapping.cpu(),
        query_start_loc=m.query_start_loc.cpu(),
        seq_lens=m.seq_lens.cpu(),
        block_tables=m.block_tables.cpu(),
        query_lens_list=m.query_lens_list,
        seq_lens_list=m.seq_lens_list,
        block_size=m.block_size,
    )
    return StepInput(
        input_ids=model_input.input_ids.cpu(),
        positions=model_input.positions.cpu(),
        metadata=metadata,
        logits_indices=model_input.logits_indices.cpu(),
        kv_sends=kv_sends,
    )


def _per_rank(layer_hook: LayerHook | None, size: int) -> LayerHook | None:
    """A hook called with the replica-wide KV item of every rank once a layer is done.

    After rank 0 finishes layer i, every rank has written layer i's K/V: their attention
    output went into the all-reduce that rank 0 has passed.
    """
    if layer_hook is None:
        return None

    def hook(layer: int) -> None:
        for rank in range(size):
            layer_hook(layer * size + rank)

    return hook
