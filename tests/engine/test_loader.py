"""Loading configs, weights and tokenizers from local Hugging Face directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from engine.builtin import BUILTIN_ARCHITECTURES, write_builtin_model
from engine.config import ModelConfig, RopeScaling, UnsupportedModelError
from engine.loader import load_model_config, load_state_dict, load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loader")
    return {a: write_builtin_model(root / a, "tiny", a) for a in BUILTIN_ARCHITECTURES}


def copy_with_config(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of model dir `src` whose config.json has `changes` applied (None deletes a key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def assert_matches_hf(ours: ModelConfig, model_dir: Path) -> None:
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    assert ours.vocab_size == hf.vocab_size
    assert ours.hidden_size == hf.hidden_size
    assert ours.intermediate_size == hf.intermediate_size
    assert ours.num_hidden_layers == hf.num_hidden_layers
    assert ours.num_attention_heads == hf.num_attention_heads
    assert ours.num_key_value_heads == hf.num_key_value_heads
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert ours.head_dim == hf_head_dim
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.sliding_window == getattr(hf, "sliding_window", None)
    assert ours.bos_token_id == hf.bos_token_id
    hf_eos = hf.eos_token_id if isinstance(hf.eos_token_id, list) else [hf.eos_token_id]
    assert set(ours.eos_token_ids) >= set(hf_eos)

    rope = hf.rope_parameters
    assert ours.rope_theta == rope["rope_theta"]
    if rope["rope_type"] == "default":
        assert ours.rope_scaling is None
    else:
        assert ours.rope_scaling is not None
        assert ours.rope_scaling.rope_type == rope["rope_type"]
        assert ours.rope_scaling.factor == rope["factor"]
    if rope["rope_type"] == "llama3":
        assert ours.rope_scaling is not None
        assert ours.rope_scaling.low_freq_factor == rope["low_freq_factor"]
        assert ours.rope_scaling.high_freq_factor == rope["high_freq_factor"]
        assert (
            ours.rope_scaling.original_max_position_embeddings
            == rope["original_max_position_embeddings"]
        )


@pytest.mark.parametrize("architecture", BUILTIN_ARCHITECTURES)
def test_config_matches_transformers(tiny_dirs: dict[str, Path], architecture: str) -> None:
    ours = load_model_config(tiny_dirs[architecture])
    assert_matches_hf(ours, tiny_dirs[architecture])
    assert ours.architecture == {"llama3": "llama"}.get(architecture, architecture)
    assert ours.attention_bias == (architecture == "qwen2")
    assert ours.dtype == "float32"
    assert ours.eos_token_ids == (257, 259)
    if architecture == "llama3":
        assert ours.rope_scaling == RopeScaling(
            rope_type="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=1024,
        )
        assert ours.rope_theta == 500000.0


@pytest.mark.parametrize("architecture", BUILTIN_ARCHITECTURES)
def test_transformers5_config_keys(
    tiny_dirs: dict[str, Path], architecture: str, tmp_path: Path
) -> None:
    """transformers 5 saves rope_parameters and dtype instead of rope_theta/rope_scaling."""
    hf = transformers.AutoConfig.from_pretrained(tiny_dirs[architecture])
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved
    assert load_model_config(tmp_path) == load_model_config(tiny_dirs[architecture])


def test_linear_rope_and_defaults(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = copy_with_config(
        tiny_dirs["llama"],
        tmp_path / "m",
        rope_scaling={"type": "linear", "factor": 2.0},
        head_dim=None,
        num_key_value_heads=None,
        tie_word_embeddings=None,
    )
    ours = load_model_config(model_dir)
    assert ours.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert ours.head_dim == 64 // 4
    assert ours.num_key_value_heads == ours.num_attention_heads
    assert not ours.tie_word_embeddings
    assert_matches_hf(ours, model_dir)


def test_qwen2_sliding_window_only_when_enabled(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    assert load_model_config(tiny_dirs["qwen2"]).sliding_window is None
    model_dir = copy_with_config(
        tiny_dirs["qwen2"], tmp_path / "m", use_sliding_window=True, sliding_window=512
    )
    assert load_model_config(model_dir).sliding_window == 512
    assert load_model_config(model_dir).max_model_len == 512


def test_mistral_sliding_window(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = copy_with_config(tiny_dirs["mistral"], tmp_path / "m", sliding_window=256)
    ours = load_model_config(model_dir)
    assert ours.sliding_window == 256
    assert_matches_hf(ours, model_dir)


def test_eos_merges_generation_config(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = copy_with_config(tiny_dirs["llama"], tmp_path / "m", eos_token_id=259)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 259]}))
    assert load_model_config(model_dir).eos_token_ids == (259, 257)
    (model_dir / "generation_config.json").unlink()
    assert load_model_config(model_dir).eos_token_ids == (259,)


def test_dtype(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    assert load_model_config(tiny_dirs["llama"], dtype="bfloat16").dtype == "bfloat16"
    model_dir = copy_with_config(tiny_dirs["llama"], tmp_path / "m", torch_dtype="float16")
    assert load_model_config(model_dir).dtype == "float16"
    assert load_model_config(model_dir, dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match="float64"):
        load_model_config(tiny_dirs["llama"], dtype="float64")
    with pytest.raises(ValueError, match="int8"):
        load_state_dict(tiny_dirs["llama"], dtype="int8")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*LlamaForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"quantization_config": {"quant_method": "awq"}}, "awq"),
    ],
)
def test_unsupported_models(
    tiny_dirs: dict[str, Path], tmp_path: Path, changes: dict[str, Any], match: str
) -> None:
    model_dir = copy_with_config(tiny_dirs["llama"], tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModelError, match=match):
        load_model_config(model_dir)


def test_missing_files(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_state_dict(tmp_path / "nowhere", "float32")

    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin"):
        load_state_dict(tmp_path, "float32")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("architecture", BUILTIN_ARCHITECTURES)
def test_state_dict_matches_transformers(tiny_dirs: dict[str, Path], architecture: str) -> None:
    state = load_state_dict(tiny_dirs[architecture], "float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dirs[architecture], dtype=torch.float32
    )
    expected = model.state_dict()
    if load_model_config(tiny_dirs[architecture]).tie_word_embeddings:
        del expected["lm_head.weight"]
    assert set(state) == set(expected)
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name


def test_state_dict_dtype(tiny_dirs: dict[str, Path]) -> None:
    state = load_state_dict(tiny_dirs["qwen2"], "bfloat16")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert "model.layers.0.self_attn.q_proj.bias" in state


def test_sharded_safetensors(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    single = load_state_dict(tiny_dirs["llama3"], "float32")
    names = sorted(single)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_dirs["llama3"], sharded)
    (sharded / "model.safetensors").unlink()
    for file, keys in shards.items():
        save_file({k: single[k] for k in keys}, str(sharded / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    loaded = load_state_dict(sharded, "float32")
    assert set(loaded) == set(single)
    for name, tensor in single.items():
        assert torch.equal(loaded[name], tensor), name

    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_state_dict(sharded, "float32")


def test_load_tokenizer(tiny_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(tiny_dirs["mistral"])
    assert tokenizer.decode(tokenizer("héllo ✓").input_ids, skip_special_tokens=True) == "héllo ✓"
