"""The ground truth of the engine tests: `transformers` greedy generation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.engine import Engine


def hf_greedy(model_dir: Path, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Greedy output ids for each prompt, one prompt at a time (no padding effects); the
    prompts are tokenized by our engine, so both sides see the same ids."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([engine.tokenize(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
            )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs
