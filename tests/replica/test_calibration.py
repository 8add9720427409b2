"""A prefill replica measures its prefill rate before its first request
(`replica/calibration.py`), and the measuring leaves nothing behind."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine.builtin import write_builtin_model
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.kv_cache import KVCacheSpec
from engine.loader import load_model_config
from engine.request import SamplingParams
from prefill.server import PrefillServer
from replica.calibration import CALIBRATION_TOKENS, measure_prefill_rate


def test_calibration_measures_a_rate_and_leaves_the_engine_as_it_was(tmp_path: Path) -> None:
    config = EngineConfig(model_dir=str(write_builtin_model(tmp_path / "tiny", "tiny")))
    calibrated, plain = Engine(config), Engine(config)
    try:
        assert measure_prefill_rate(calibrated) > 0
        pool = calibrated.kv_manager.pool
        assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 0
        assert not calibrated.has_unfinished
        assert not calibrated.prompt_steps and not calibrated.step_times
        assert calibrated.step_seconds == 0.0
        growth = calibrated.scheduler.growth  # no output length learned from it
        assert (growth.num_finished, growth.mean_output_tokens) == (
            plain.scheduler.growth.num_finished,
            plain.scheduler.growth.mean_output_tokens,
        )
        # What it serves next is computed whole and comes out as a fresh engine's.
        chunk = [i % 256 for i in range(CALIBRATION_TOKENS)]
        prompts = ["calibration leaves no trace " * 30, chunk]
        params = SamplingParams(max_tokens=16, temperature=0.0)
        got = calibrated.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
        assert sum(n for _, _, n, _ in calibrated.prompt_steps) == sum(
            len(o.prompt_token_ids) for o in got
        )
    finally:
        calibrated.close()
        plain.close()


def test_a_prefill_replica_reports_its_rate_before_its_first_prompt(tmp_path: Path) -> None:
    model_dir = write_builtin_model(tmp_path / "tiny", "tiny")
    server = PrefillServer(EngineConfig(model_dir=str(model_dir)), backend="shm")
    try:
        stats = asyncio.run(server.record_routing_stats())
        assert stats["prefill_tokens_per_s"] == server.replica.calibrated_tokens_per_s > 0
        assert stats["prompt_busy"] == 0.0  # the measuring is not work it did
    finally:
        server.shutdown()


def test_calibration_fits_a_small_kv_cache(tmp_path: Path) -> None:
    """A KV cache smaller than the calibration prompt measures on what fits (a replica
    must start whatever its cache)."""
    model_dir = write_builtin_model(tmp_path / "tiny", "tiny")
    model_config = load_model_config(str(model_dir), "float32")
    per_block = KVCacheSpec.for_engine(EngineConfig(model_dir=str(model_dir)), model_config)
    cache = CacheConfig(kv_cache_bytes=20 * per_block.bytes_per_block)  # 320 tokens
    engine = Engine(EngineConfig(model_dir=str(model_dir), cache=cache))
    try:
        assert engine.kv_manager.pool.num_blocks * engine.kv_spec.block_size < CALIBRATION_TOKENS
        assert measure_prefill_rate(engine) > 0
        assert engine.kv_manager.pool.num_used_blocks == 0
    finally:
        engine.close()
