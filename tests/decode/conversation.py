"""Helpers of the multi-turn tests: conversations as token ids, their `transformers`
greedy reference, and a decode replica's view of its prefix cache.

A conversation's turn k sends the whole history: turn k-1's prompt, turn k-1's answer and a
new message, so each prompt extends the previous one by an answer and a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.block_pool import hash_block_tokens
from engine.engine import Engine

# Message lengths per turn: prompts cross block (16) and chunk boundaries at varied offsets.
MESSAGE_LENGTHS = (37, 23, 50, 9, 61, 30)
ANSWER_TOKENS = 11  # odd: each answer shifts the next message's block offset


class HFGreedyIds:
    """`transformers` greedy argmax over token ids, no stop token (the ground truth)."""

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple[int, ...], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
        key = (*prompt_ids, -max_tokens)
        if key not in self._cache:
            ids = list(prompt_ids)
            out: list[int] = []
            for _ in range(max_tokens):  # the whole sequence each step: no cache to trust
                logits = self.model(input_ids=torch.tensor([ids + out])).logits
                out.append(int(logits[0, -1].argmax()))
            self._cache[key] = out
        return self._cache[key]


@dataclass
class Conversation:
    """One conversation's history; `next_prompt` adds turn k's message."""

    seed: int
    messages: list[list[int]] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)

    def next_prompt(self) -> list[int]:
        turn = len(self.prompts)
        generator = torch.Generator().manual_seed(self.seed * 1000 + turn)
        length = MESSAGE_LENGTHS[turn % len(MESSAGE_LENGTHS)]
        message = torch.randint(1, 250, (length,), generator=generator).tolist()
        history = self.prompts[-1] + self.answers[-1] if self.prompts else []
        self.messages.append(message)
        self.prompts.append(history + message)
        return self.prompts[-1]

    def answered(self, answer: list[int]) -> None:
        assert len(self.answers) == len(self.prompts) - 1
        self.answers.append(list(answer))

    @property
    def num_turns(self) -> int:
        return len(self.answers)


def cached_block_ids(engine: Engine, token_ids: Sequence[int], tenant: str) -> list[int]:
    """The blocks of `engine`'s prefix cache holding `token_ids`' leading full blocks for
    `tenant` (as admission finds them: at least one token left)."""
    pool, bs = engine.kv_manager.pool, engine.kv_spec.block_size
    block_ids: list[int] = []
    parent: bytes | None = None
    for i in range((len(token_ids) - 1) // bs):
        parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], tenant)
        block_id = pool.lookup(parent)
        if block_id is None:
            break
        block_ids.append(block_id)
    return block_ids


def blocks_kv(engine: Engine, block_ids: Sequence[int]) -> torch.Tensor:
    """A copy of the K and V of `block_ids`, every layer: `[layers, 2, blocks, ...]`."""
    kv = engine.kv_cache
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    return torch.stack(
        [
            torch.stack([kv.key_caches[layer][ids], kv.value_caches[layer][ids]])
            for layer in range(len(kv.key_caches))
        ]
    ).clone()
