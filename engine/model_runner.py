"""Turns a scheduler step into tensors, runs the model, samples. Decides no policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.model import CausalLM, LayerHook
from engine.request import Request
from engine.sampler import Sampler, SamplingBatch, make_generator
from engine.scheduler import SchedulerOutput
from kernels.metadata import AttentionMetadata

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
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    def prepare(self, output: SchedulerOutput) -> ModelInput:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling_requests: list[Request] = []
        slot_chunks: list[torch.Tensor] = []
        max_blocks = max(len(s.block_table) for s in output.scheduled)
        tables = torch.zeros((len(output.scheduled), max_blocks), dtype=torch.int64)
        bs = self.block_size
        for row, item in enumerate(output.scheduled):
            request, num_new = item.request, item.num_new_tokens
            start = request.num_computed_tokens
            input_ids.extend(_new_token_ids(request, start, num_new))
            positions.extend(range(start, start + num_new))
            table = torch.tensor(item.block_table, dtype=torch.int64)
            tables[row, : len(item.block_table)] = table
            pos = torch.arange(start, start + num_new, dtype=torch.int64)
            slot_chunks.append(table[pos // bs] * bs + pos % bs)
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
            slot_mapping=torch.cat(slot_chunks).to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
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
        hidden = self.model(
            model_input.input_ids,
            model_input.positions,
            self.kv_cache,
            model_input.metadata,
            layer_hook,
        )
        if not model_input.sampling_requests:
            return {}
        logits = self.model.compute_logits(hidden[model_input.logits_indices])
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

    def _generators_for(self, requests: list[Request]) -> dict[str, torch.Generator]:
        for request in requests:
            seed = request.sampling_params.seed
            if seed is not None and request.request_id not in self._generators:
                self._generators[request.request_id] = make_generator(seed)
        return self._generators

    def forget(self, request_id: str) -> None:
        """Drop per-request state (the seeded generator) once the request has finished."""
        self._generators.pop(request_id, None)
