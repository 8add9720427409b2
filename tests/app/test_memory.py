"""Per-GPU memory math: exact for the weights and KV the engine really allocates, and the
70B example, configs/h200-70b.yaml, fits an H200 (weights per rank + KV + activations)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from app.config import PDServeConfig
from app.memory import H200_MEMORY_BYTES, rank_memory, weight_bytes
from engine.builtin import resolve_model_dir
from engine.config import ModelConfig
from engine.engine import Engine
from engine.loader import load_model_config
from engine.model import CausalLM
from engine.parallel import Shard

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_70B = "pdserve-70b"

# meta-llama/Llama-3.1-70B-Instruct's config.json (the example's model directory is a
# placeholder on the cluster's nodes, so its shape is spelled out here).
LLAMA_31_70B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    dtype="bfloat16",
)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen2", "small"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_weight_bytes_equal_the_models_parameters(model: str, quantization: str | None) -> None:
    # float32: the model is built in float32 before the engine casts it to the dtype
    config = load_model_config(resolve_model_dir(model), "float32")
    config = replace(config, quantization=quantization)
    with torch.device("meta"):
        built = CausalLM(config)
    assert weight_bytes(config, Shard(config), quantization) == _param_bytes(built)


def test_tp2_weight_and_kv_bytes_equal_a_running_rank0() -> None:
    engine = Engine.from_model("tiny", num_threads=1, tensor_parallel_size=2)
    try:
        config = engine.model_config
        memory = rank_memory(config, 2, engine.kv_spec.total_bytes, 2048, 64, device="cpu")
        assert memory.weights == _param_bytes(engine.model)
        assert memory.kv_cache == engine.runner.kv_cache.spec.total_bytes
    finally:
        engine.close()


def _example_70b() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "configs" / "h200-70b.yaml").read_text())
    (app,) = [app for app in data["applications"] if app["name"] == EXAMPLE_70B]
    args: dict[str, Any] = app["args"]
    return args


def test_70b_example_is_a_valid_config() -> None:
    """Disaggregated: TP=2 prefill and decode pools, KV moving per rank (on cuda)."""
    config = PDServeConfig.model_validate(_example_70b())
    assert [pool.role for pool in config.pools] == ["prefill", "decode"]
    for pool in config.pools:
        assert pool.num_gpus == config.engine_config(pool).tensor_parallel_size == 2
        assert config.per_rank_transfer(pool)


def test_70b_example_fits_an_h200() -> None:
    model = _example_70b()["model"]
    assert model["tensor_parallel_size"] > 1 and model["quantization"] == "fp8"
    memory = rank_memory(
        replace(LLAMA_31_70B, dtype=model["dtype"]),
        model["tensor_parallel_size"],
        model["kv_cache_bytes"],
        model["max_num_batched_tokens"],
        model["max_num_seqs"],
        model["quantization"],
    )
    assert memory.fits(H200_MEMORY_BYTES), memory
    # Most of the GPU holds KV, not idle: at least 40% of it.
    assert memory.kv_cache >= 0.4 * H200_MEMORY_BYTES, memory


def test_70b_needs_tp_or_fp8() -> None:
    """The oracle can fail: 70B bf16 on one GPU does not fit, even without a KV cache."""
    model = _example_70b()["model"]
    one_gpu = rank_memory(LLAMA_31_70B, 1, 0, model["max_num_batched_tokens"], 1)
    assert not one_gpu.fits(H200_MEMORY_BYTES)
    # ~70.6 B parameters (published figure), 2 bytes each
    assert one_gpu.weights == pytest.approx(2 * 70.55e9, rel=0.01)
