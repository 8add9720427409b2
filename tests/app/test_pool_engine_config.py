"""Per-pool engine settings: a pool overrides sizes only, and build_app passes each pool its
own engine config."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from app.config import PDServeConfig
from engine.config import EngineConfig


def _args(**pool_engine: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {"model": "tiny", "kv_cache_bytes": 64 * 1024**2, "max_num_seqs": 32},
        "pools": [
            {"name": "prefill", "role": "prefill", "engine": pool_engine.get("prefill", {})},
            {"name": "decode", "role": "decode", "engine": pool_engine.get("decode", {})},
        ],
    }


def test_pools_override_sizes_and_share_the_layout() -> None:
    config = PDServeConfig.model_validate(
        _args(
            prefill={"kv_cache_bytes": 8 * 1024**2, "max_num_batched_tokens": 4096},
            decode={"max_num_seqs": 128, "num_threads": 2},
        )
    )
    prefill, decode = (config.engine_config(pool) for pool in config.pools)
    assert prefill.cache.kv_cache_bytes == 8 * 1024**2
    assert prefill.scheduler.max_num_batched_tokens == 4096
    assert prefill.scheduler.max_num_seqs == 32 and prefill.num_threads is None
    assert decode.cache.kv_cache_bytes == 64 * 1024**2
    assert decode.scheduler.max_num_seqs == 128 and decode.num_threads == 2
    for engine in (prefill, decode):  # what the KV layout depends on stays shared
        assert (engine.model_dir, engine.dtype, engine.cache.block_size) == ("tiny", None, 16)
    assert config.engine_config(config.pools[0]) != config.model.to_engine_config()


def test_no_override_is_the_model_settings() -> None:
    config = PDServeConfig.model_validate(_args())
    for pool in config.pools:
        expected = config.model.to_engine_config()
        if pool.role == "prefill":  # no decode steps: nothing to capture as CUDA graphs
            expected = dataclasses.replace(expected, enforce_eager=True)
        assert config.engine_config(pool) == expected
        assert isinstance(config.engine_config(pool), EngineConfig)


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"block_size": 32}, "Extra inputs are not permitted"),
        ({"dtype": "float16"}, "Extra inputs are not permitted"),
        ({"model": "small"}, "Extra inputs are not permitted"),
        ({"kv_cache_bytes": 0}, "greater than 0"),
        ({"max_num_batched_tokens": 256}, "a prefill chunk has to fit"),
    ],
)
def test_unsafe_or_invalid_overrides_are_rejected(engine: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PDServeConfig.model_validate(_args(decode=engine))


def test_build_app_binds_each_pool_its_engine_config() -> None:
    from app.main import build_app

    args = _args(prefill={"kv_cache_bytes": 8 * 1024**2}, decode={"max_num_seqs": 7})
    pools = build_app(args)._bound_deployment._replica_config.init_args[1:]  # decode, prefill
    bound = {
        name: pool_app._bound_deployment._replica_config.init_args[0]
        for role in pools
        for name, pool_app in role.items()
    }
    assert bound["prefill"].cache.kv_cache_bytes == 8 * 1024**2
    assert bound["prefill"].scheduler.max_num_seqs == 32
    assert bound["decode"].scheduler.max_num_seqs == 7
    assert bound["decode"].cache.kv_cache_bytes == 64 * 1024**2
