"""FP8 weights and FP8 KV cache through the engine's reference (CPU) path: quantization at
load, the FP8 checkpoint convention, option checks, and accuracy bounds on `tiny`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.offline.accuracy import measure
from engine.builtin import write_builtin_model
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.kernels.fp8 import FP8_DTYPE, FP8_MAX
from engine.kv_cache import KVCacheSpec
from engine.loader import load_model_config
from engine.quantization import (
    Fp8Linear,
    check_fp8_options,
    dequantize_weight,
    quantize_weight,
)
from engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = ["an fp8 prompt long enough to fill more than one block", "short"]
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny")


def engine(model: Path, quantization: str | None = None, kv: str = "auto") -> Engine:
    return Engine(
        EngineConfig(
            model_dir=str(model),
            quantization=quantization,
            cache=CacheConfig(kv_cache_bytes=4 * 1024 * 1024, kv_cache_dtype=kv),
        )
    )


def projection_names(num_layers: int) -> list[str]:
    names = []
    for i in range(num_layers):
        for p in PROJECTIONS:
            part = "self_attn" if p in ("q", "k", "v", "o") else "mlp"
            names.append(f"model.layers.{i}.{part}.{p}_proj")
    return names


def test_per_channel_quantization_round_trip() -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 32) * torch.logspace(-3, 2, 48)[:, None]  # rows of any scale
    q, scale = quantize_weight(weight)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (48,)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))
    # 3 mantissa bits: every normal value within 2^-4 of itself; subnormals within half a step
    bound = torch.maximum(weight.abs() * 2**-4, 2**-10 * scale[:, None])
    assert ((dequantize_weight(q, scale) - weight).abs() <= bound).all()


def test_fp8_model_computes_with_exactly_the_dequantized_weights(tiny: Path) -> None:
    """The FP8 model equals a full-precision model holding dequant(quant(W)): the only
    difference FP8 weights make is their rounding."""
    fp8 = engine(tiny, "fp8")
    state = load_file(str(tiny / "model.safetensors"))
    for name in projection_names(2):
        state[name + ".weight"] = dequantize_weight(*quantize_weight(state[name + ".weight"]))
    fake = engine(tiny)
    fake.model.load_hf_state_dict(state)
    layer = fp8.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Fp8Linear)
    assert layer.mlp.down_proj.weight_t.dtype == FP8_DTYPE
    assert layer.input_layernorm.weight.dtype == torch.float32  # norms stay full precision
    lm_head = fp8.model.lm_head  # and the LM head (dense or packed)
    assert (lm_head.weight_t if lm_head.weight_t is not None else lm_head.weight_packed).dtype == (
        torch.float32
    )
    ids = fp8.tokenize(PROMPTS[0])
    from bench.offline.accuracy import teacher_forced_logits

    torch.testing.assert_close(
        teacher_forced_logits(fp8, ids), teacher_forced_logits(fake, ids), atol=1e-4, rtol=1e-4
    )


def write_fp8_checkpoint(src: Path, dst: Path, per_tensor: set[str], kv_scale: float) -> Path:
    """Our FP8 checkpoint convention: FP8 `weight` + float32 `weight_scale` per projection
    (per channel, or one per tensor for the names in `per_tensor`), `k_scale`/`v_scale`
    beside each attention, `quantization_config.quant_method: fp8` in config.json."""
    dst.mkdir()
    for file in src.iterdir():
        if file.name != "model.safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    for name in projection_names(2):
        weight = state.pop(name + ".weight")
        if name in per_tensor:
            scale = weight.abs().max() / FP8_MAX
            state[name + ".weight"] = (weight / scale).to(FP8_DTYPE)
            state[name + ".weight_scale"] = scale.reshape(1)
        else:
            state[name + ".weight"], scale = quantize_weight(weight)
            state[name + ".weight_scale"] = scale[:, None]  # [out, 1], as HF FP8 saves it
        state[name + ".input_scale"] = torch.ones(())  # static activation scale: unused
    for i in range(2):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(kv_scale)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([kv_scale, 2 * kv_scale])
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_fp8_checkpoint_loads_its_own_weights_and_scales(tiny: Path, tmp_path: Path) -> None:
    o_proj = "model.layers.1.self_attn.o_proj"
    checkpoint = write_fp8_checkpoint(tiny, tmp_path / "fp8", {o_proj}, kv_scale=0.5)
    assert load_model_config(checkpoint).quantization == "fp8"  # without asking
    loaded = engine(checkpoint, kv="fp8")
    stored = load_file(str(checkpoint / "model.safetensors"))
    o = loaded.model.layers[1].self_attn.o_proj
    assert torch.equal(
        o.weight_t.t().view(torch.uint8), stored[o_proj + ".weight"].view(torch.uint8)
    )
    assert torch.equal(o.weight_scale, stored[o_proj + ".weight_scale"].expand(64))
    attn = loaded.model.layers[0].self_attn
    assert attn.k_scale.tolist() == [0.5, 0.5] and attn.v_scale.tolist() == [0.5, 1.0]
    # Per-channel FP8 checkpoint == the same quantization done at load: same tokens.
    per_channel = write_fp8_checkpoint(tiny, tmp_path / "fp8pc", set(), kv_scale=1.0)
    expected = engine(tiny, "fp8", "fp8").generate(PROMPTS, GREEDY)
    got = engine(per_channel, kv="fp8").generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_fp8_checkpoint_without_scales_is_refused(tiny: Path, tmp_path: Path) -> None:
    checkpoint = write_fp8_checkpoint(tiny, tmp_path / "fp8", set(), kv_scale=1.0)
    state = load_file(str(checkpoint / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(state, str(checkpoint / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight_scale"):
        engine(checkpoint)


def test_block_wise_fp8_checkpoints_are_refused(tiny: Path, tmp_path: Path) -> None:
    checkpoint = write_fp8_checkpoint(tiny, tmp_path / "fp8", set(), kv_scale=1.0)
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="block-wise"):
        load_model_config(checkpoint)


def test_fp8_kv_cache_stores_one_byte_per_value(tiny: Path) -> None:
    config = load_model_config(tiny)
    bf16 = KVCacheSpec.for_model(config, 16, 1 << 20, "bfloat16")
    fp8 = KVCacheSpec.for_engine(
        EngineConfig(str(tiny), cache=CacheConfig(kv_cache_bytes=1 << 20, kv_cache_dtype="fp8")),
        config,
    )
    assert fp8.dtype == "float8_e4m3fn" and fp8.torch_dtype == FP8_DTYPE
    assert 2 * fp8.bytes_per_block == bf16.bytes_per_block
    assert fp8.num_blocks == 2 * bf16.num_blocks  # same budget, twice the tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": "int4"}, "quantization must be one of"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype must be one of"),
        ({"quantization": "fp8", "dtype": "float16", "device": "cuda"}, "needs dtype bfloat16"),
    ],
)
def test_option_combinations_that_cannot_run_are_refused(kwargs: dict, message: str) -> None:
    options = {"quantization": None, "kv_cache_dtype": "auto", "dtype": None, "device": "cpu"}
    with pytest.raises(ValueError, match=message):
        check_fp8_options(**{**options, **kwargs})


# Documented bounds (BENCHMARKS.md, "FP8 accuracy"): the random-weight `tiny` amplifies any
# rounding (bf16 alone gives ~5% relative logit error), so these are loose, but a wrong scale,
# a head read with another head's scale or a saturating cast blows far past them.
TINY_BOUNDS = {
    ("fp8", "fp8"): (0.45, 0.5),  # (mean relative logit error <, greedy agreement >=)
    ("fp8", "auto"): (0.35, 0.6),
    (None, "fp8"): (0.3, 0.6),
}


def test_fp8_accuracy_on_tiny_is_within_the_documented_bounds(tiny: Path) -> None:
    candidates = [("float32", q, kv) for q, kv in TINY_BOUNDS]
    result = measure(str(tiny), "float32", candidates, num_tokens=96, free_tokens=0)
    for row in result["results"]:
        max_error, min_agreement = TINY_BOUNDS[(row["quantization"], row["kv_cache_dtype"])]
        assert row["rel_logit_error_mean"] < max_error, row
        assert row["greedy_agreement"] >= min_agreement, row


def test_tensor_parallel_fp8_equals_single_rank_fp8(tiny: Path) -> None:
    """FP8 weights are quantized whole, then sharded (scales follow their rows), and each
    rank's FP8 KV shard uses its heads' scales: TP=2 gives TP=1's tokens (gloo on the CPU)."""
    expected = engine(tiny, "fp8", "fp8").generate(PROMPTS, GREEDY)
    config = EngineConfig(
        model_dir=str(tiny),
        quantization="fp8",
        tensor_parallel_size=2,
        num_threads=1,
        cache=CacheConfig(kv_cache_bytes=4 * 1024 * 1024, kv_cache_dtype="fp8"),
    )
    sharded = Engine(config)
    try:
        got = sharded.generate(PROMPTS, GREEDY)
    finally:
        sharded.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_model_config_section_carries_and_checks_the_fp8_options() -> None:
    from pydantic import ValidationError

    from app.config import ModelSettings

    engine_config = ModelSettings(quantization="fp8", kv_cache_dtype="fp8").to_engine_config()
    assert engine_config.quantization == "fp8"
    assert engine_config.cache.kv_cache_dtype == "fp8"
    with pytest.raises(ValidationError, match="needs dtype bfloat16"):
        ModelSettings(quantization="fp8", device="cuda", dtype="float16")
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        ModelSettings(kv_cache_dtype="int8")  # type: ignore[arg-type]


def test_cli_generates_with_fp8(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    args = ["generate", "--model", str(tiny), "--prompt", PROMPTS[0], "--max-tokens", "16"]
    args += ["--ignore-eos", "--json", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    assert main(args) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    expected = engine(tiny, "fp8", "fp8").generate(PROMPTS[:1], GREEDY)
    assert outputs[0]["token_ids"] == expected[0].token_ids
