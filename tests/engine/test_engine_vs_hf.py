"""Greedy output equals `transformers` token for token, whatever the batching does."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.builtin import write_builtin_model
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.request import SamplingParams
from tests.engine.hf_reference import hf_greedy

PROMPTS = [
    "hello",
    "a much longer prompt that spans several KV cache blocks of sixteen tokens each, "
    "so that paging, block tables and the slot mapping all matter",
    "Ünïcödé and emoji 🚀 too",
    "short",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "mistral"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp(request.param), "tiny", request.param)


@pytest.fixture(scope="module")
def hf_outputs(model_dir: Path) -> list[list[int]]:
    """`transformers` greedy generation, one prompt at a time (no padding effects)."""
    return hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


def generate(model_dir: Path, prompts: list[str], **config: object) -> list[list[int]]:
    scheduler = config.pop("scheduler", SchedulerConfig())
    cache = config.pop("cache", CacheConfig())
    engine = Engine(EngineConfig(model_dir=str(model_dir), scheduler=scheduler, cache=cache))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert engine.kv_manager.num_free_blocks == engine.kv_spec.num_blocks
    return [o.token_ids for o in outputs]


def test_mixed_batch_matches_transformers(model_dir: Path, hf_outputs: list[list[int]]) -> None:
    assert generate(model_dir, PROMPTS) == hf_outputs


def test_chunked_prefill_matches(model_dir: Path, hf_outputs: list[list[int]]) -> None:
    scheduler = SchedulerConfig(max_num_batched_tokens=24, long_prefill_token_threshold=7)
    assert generate(model_dir, PROMPTS, scheduler=scheduler) == hf_outputs


def test_preemption_keeps_outputs(model_dir: Path, hf_outputs: list[list[int]]) -> None:
    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    # Room for barely more than the longest request: the batch must preempt to finish.
    longest = max(len(engine.tokenize(p)) for p in PROMPTS) + MAX_TOKENS
    block_bytes = engine.kv_spec.bytes_per_block
    num_blocks = -(-longest // 16) + 2
    engine = Engine(
        EngineConfig(
            model_dir=str(model_dir), cache=CacheConfig(kv_cache_bytes=num_blocks * block_bytes)
        )
    )
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outputs] == hf_outputs
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_manager.num_free_blocks == num_blocks


def test_prefix_cache_hits_keep_outputs(model_dir: Path, hf_outputs: list[list[int]]) -> None:
    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    first = engine.generate(PROMPTS, params)
    second = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == hf_outputs
    assert [o.token_ids for o in second] == hf_outputs
    assert second[1].num_cached_tokens >= 16  # the long prompt reused its cached blocks
    assert engine.kv_manager.num_free_blocks == engine.kv_spec.num_blocks
