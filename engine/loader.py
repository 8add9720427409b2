"""Loading a local Hugging Face model directory: its config, safetensors weights and tokenizer,
and building our model from them (`load_model`).

Supports the Llama family (`LlamaForCausalLM`, `Qwen2ForCausalLM`, `MistralForCausalLM`).
Config keys of both transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x
(`rope_parameters`) are read. Weights keep their Hugging Face names
(`model.layers.{i}.self_attn.q_proj.weight`, ...); the model maps them itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling, UnsupportedModelError
from engine.kernels.fp8 import FP8_DTYPE
from engine.kv_cache import TORCH_DTYPES
from engine.layers import RotaryEmbedding
from engine.model import CausalLM
from engine.parallel import TensorParallel
from engine.quantization import (
    QUANTIZATION_METHODS,
    SCALE_SUFFIXES,
    cast_floating_,
    finish_loading,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
# Any one of these lets AutoTokenizer build a tokenizer (fast, sentencepiece, or BPE files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# transformers' per-architecture defaults for keys a config.json may omit
_DEFAULT_MAX_POSITION_EMBEDDINGS = {"llama": 2048, "qwen2": 32768, "mistral": 131072}
# Buffers some older checkpoints saved that are recomputed, not loaded.
_IGNORED_WEIGHT_SUFFIXES = (".rotary_emb.inv_freq",)


def load_model_config(
    model_dir: str | Path, dtype: str | None = None, quantization: str | None = None
) -> ModelConfig:
    """Parse `config.json` (and `generation_config.json` if present) of `model_dir`.

    `dtype` ("float32", "bfloat16", "float16") overrides the config's `torch_dtype`/`dtype`;
    without either, "float32". `quantization` ("fp8") quantizes the weights at load; an FP8
    checkpoint (`engine.quantization`) is "fp8" whatever is asked. Raises FileNotFoundError
    when there is no config.json,
    UnsupportedModelError for an architecture, rope type or option we cannot serve, and
    ValueError for a bad `dtype`.
    """
    path = Path(model_dir)
    raw = _read_json(path / CONFIG_FILE)
    generation = (
        _read_json(path / GENERATION_CONFIG_FILE) if _has(path, GENERATION_CONFIG_FILE) else {}
    )
    architecture = _architecture(raw, path)
    _check_supported_options(raw, path)

    hidden_size = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    max_pos = int(
        raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITION_EMBEDDINGS[architecture]
    )
    rope_theta, rope_scaling = _rope(raw, max_pos, path)

    if architecture == "qwen2":
        # Qwen2 always has q/k/v biases; its window only applies with use_sliding_window.
        attention_bias, mlp_bias = True, False
        sliding_window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    elif architecture == "mistral":
        attention_bias, mlp_bias = False, False
        sliding_window = raw.get("sliding_window")
    else:
        attention_bias = bool(raw.get("attention_bias", False))
        mlp_bias = bool(raw.get("mlp_bias", False))
        sliding_window = None

    bos = raw.get("bos_token_id")
    if bos is None:
        bos = generation.get("bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        sliding_window=None if sliding_window is None else int(sliding_window),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_token_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
        dtype=_config_dtype(raw, dtype, path),
        quantization=_quantization(raw, quantization),
    )


def load_state_dict(
    model_dir: str | Path, dtype: str, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All weights of `model_dir` by Hugging Face name, floating tensors converted to `dtype`
    except FP8 weights (kept) and quantization scales (float32, `SCALE_SUFFIXES`).

    Reads `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
    A tied `lm_head.weight` is absent unless the checkpoint stored it.
    """
    torch_dtype = TORCH_DTYPES[validate_dtype(dtype)]
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name.endswith(_IGNORED_WEIGHT_SUFFIXES):
                    continue
                if name in state:
                    raise UnsupportedModelError(f"weight {name!r} appears twice (again in {file})")
                tensor = handle.get_tensor(name)
                if name.endswith(SCALE_SUFFIXES):
                    tensor = tensor.float()
                elif tensor.is_floating_point() and tensor.dtype != FP8_DTYPE:
                    tensor = tensor.to(torch_dtype)
                state[name] = tensor
    return state


def random_state_dict(
    config: ModelConfig, device: str | torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random Hugging Face-named weights of `config`'s shape (`load_format: dummy`, for
    benchmarks of a model without a checkpoint): N(0, 0.02) matrices and biases, norms of
    ones, in the config's dtype, made on `device`."""
    dtype = TORCH_DTYPES[config.dtype]
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    matrices: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    if not config.tie_word_embeddings:
        matrices["lm_head.weight"] = (vocab, hidden)
    norms = ["model.norm.weight"]
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        norms += [f"model.layers.{i}.input_layernorm.weight"]
        norms += [f"model.layers.{i}.post_attention_layernorm.weight"]
        shapes = {
            f"{attn}q_proj": (q_dim, hidden),
            f"{attn}k_proj": (kv_dim, hidden),
            f"{attn}v_proj": (kv_dim, hidden),
            f"{attn}o_proj": (hidden, q_dim),
            f"{mlp}gate_proj": (inter, hidden),
            f"{mlp}up_proj": (inter, hidden),
            f"{mlp}down_proj": (hidden, inter),
        }
        for name, dims in shapes.items():
            matrices[name + ".weight"] = dims
            is_qkv = name.startswith(attn) and not name.endswith("o_proj")
            o_bias = config.attention_bias and config.architecture != "qwen2"
            if (is_qkv and config.attention_bias) or (name.endswith("o_proj") and o_bias):
                matrices[name + ".bias"] = dims[:1]
            if name.startswith(mlp) and config.mlp_bias:
                matrices[name + ".bias"] = dims[:1]
    state = {
        name: torch.randn(dims, generator=generator, device=device, dtype=dtype) * 0.02
        for name, dims in matrices.items()
    }
    state.update({name: torch.ones(hidden, device=device, dtype=dtype) for name in norms})
    return state


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the weights of `model_dir`, in load order."""
    path = _existing_dir(model_dir)
    index_path = path / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UnsupportedModelError(f"{index_path} has no 'weight_map'")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shards that are missing: {missing}")
        return files
    if (path / SAFETENSORS_FILE).is_file():
        return [path / SAFETENSORS_FILE]
    found = _listing(path)
    hint = ""
    if any(name.endswith((".bin", ".pt", ".pth")) for name in found):
        hint = " (PyTorch pickle checkpoints are not loaded; convert them to safetensors)"
    raise FileNotFoundError(
        f"no safetensors weights in {path}: expected {SAFETENSORS_FILE} or "
        f"{SAFETENSORS_INDEX_FILE}; found {found}{hint}"
    )


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The model's tokenizer through `transformers.AutoTokenizer` (local files only)."""
    path = _existing_dir(model_dir)
    if not any(_has(path, name) for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {path}: expected one of {list(TOKENIZER_FILES)}; "
            f"found {_listing(path)}"
        )
    from transformers import AutoTokenizer  # slow to import; only needed here

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(path), local_files_only=True
    )
    return tokenizer


def validate_dtype(dtype: str) -> str:
    """`dtype` itself if we can run it, else ValueError naming the choices."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose from {sorted(TORCH_DTYPES)}")
    return dtype


def _architecture(raw: dict[str, Any], path: Path) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    model_type = raw.get("model_type")
    if not names and model_type in SUPPORTED_ARCHITECTURES.values():
        return str(model_type)
    shown = names[0] if names else f"model_type={model_type!r}"
    raise UnsupportedModelError(
        f"architecture {shown} of {path} is not supported; supported: "
        f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )


def _check_supported_options(raw: dict[str, Any], path: Path) -> None:
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown")
        if method != "fp8":
            raise UnsupportedModelError(
                f"{path} is quantized ({method}); only dense and fp8 checkpoints load"
            )
        if quant.get("weight_block_size"):
            raise UnsupportedModelError(
                f"{path} has block-wise FP8 scales (weight_block_size "
                f"{quant['weight_block_size']}); only per-tensor or per-channel scales load"
            )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act {act!r} of {path} is not supported (silu only)")


def _rope(raw: dict[str, Any], max_pos: int, path: Path) -> tuple[float, RopeScaling | None]:
    # transformers 5 folds everything into rope_parameters; 4.x keeps rope_theta at the top
    # level and rope_scaling (null for plain RoPE) beside it. rope_scaling wins, as in HF.
    params: dict[str, Any] = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} of {path} is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or max_pos
            ),
        )
    raise UnsupportedModelError(
        f"rope type {rope_type!r} of {path} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
    )


def _config_dtype(raw: dict[str, Any], dtype: str | None, path: Path) -> str:
    if dtype is not None:
        return validate_dtype(dtype)
    saved = raw.get("dtype") or raw.get("torch_dtype")
    if saved is None or saved == "auto":
        return "float32"
    saved = str(saved).removeprefix("torch.")
    if saved not in TORCH_DTYPES:
        raise UnsupportedModelError(
            f"{path} is saved as {saved!r}; pass dtype= one of {sorted(TORCH_DTYPES)}"
        )
    return saved


def _quantization(raw: dict[str, Any], asked: str | None) -> str | None:
    if asked is not None and asked not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization {asked!r} is not supported; choose from {QUANTIZATION_METHODS}"
        )
    stored = (raw.get("quantization_config") or {}).get("quant_method")
    return "fp8" if stored == "fp8" else asked


def _token_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    """Flatten ints / lists / None into unique ids, first occurrence first."""
    ids: list[int] = []
    for value in values:
        for token_id in [value] if isinstance(value, int) else value or []:
            if int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def _existing_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    return path


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        where = file.parent
        found = _listing(where) if where.is_dir() else "nothing: the directory does not exist"
        raise FileNotFoundError(f"{file} not found ({where} holds {found})")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{file} does not hold a JSON object")
    return data


def _has(path: Path, name: str) -> bool:
    return (path / name).is_file()


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def load_model(
    model_config: ModelConfig,
    model_dir: str,
    device: torch.device,
    tp: TensorParallel | None = None,
    load_format: str = "auto",
) -> CausalLM:
    """Build the model (or `tp`'s shard of it) without random init and load the
    checkpoint's weights (random ones for `load_format="dummy"`)."""
    dtype = TORCH_DTYPES[model_config.dtype]
    with torch.device("meta"):
        model = CausalLM(model_config, tp)
    model = model.to_empty(device=device)
    cast_floating_(model, dtype)  # FP8 weights and their float32 scales keep their dtypes
    model.rotary = RotaryEmbedding(model_config, dtype).to(device)
    if load_format == "dummy":
        model.load_hf_state_dict(random_state_dict(model_config, device))
    elif load_format == "auto":
        model.load_hf_state_dict(load_state_dict(model_dir, model_config.dtype))
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    finish_loading(model)
    model.pack_weights()
    return model.eval()
