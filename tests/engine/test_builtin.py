"""The built-in random-weight models: deterministic bytes, loadable by transformers."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import unicodedata
from pathlib import Path

import pytest
import torch

from engine.builtin import (
    BOS_TOKEN_ID,
    BUILTIN_ARCHITECTURES,
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    resolve_model_dir,
    write_builtin_model,
)
from engine.config import UnsupportedModelError

transformers = pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
UNICODE_TEXT = "héllo wörld ✓ 你好 🤖\n\ttabs  and  spaces <b>&amp;</b>"


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("builtin")
    return {a: write_builtin_model(root / a, "tiny", a) for a in BUILTIN_ARCHITECTURES}


def file_hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in model_dir.iterdir()}


def test_same_bytes_every_time(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    again = write_builtin_model(tmp_path / "again", "tiny", "llama")
    assert set(file_hashes(again)) == EXPECTED_FILES
    assert file_hashes(again) == file_hashes(tiny_dirs["llama"])
    # Another interpreter (other hash seed, fresh tokenizers state) writes the same bytes too.
    script = "import sys; from engine.builtin import write_builtin_model as w; w(sys.argv[1])"
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "other")],
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert file_hashes(tmp_path / "other") == file_hashes(tiny_dirs["llama"])


def test_architectures_differ(tiny_dirs: dict[str, Path]) -> None:
    hashes = {a: file_hashes(d)["config.json"] for a, d in tiny_dirs.items()}
    assert len(set(hashes.values())) == len(BUILTIN_ARCHITECTURES)


@pytest.mark.parametrize("architecture", BUILTIN_ARCHITECTURES)
def test_loads_and_generates_in_transformers(tiny_dirs: dict[str, Path], architecture: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dirs[architecture], dtype=torch.float32
    )
    expected_class = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    assert type(model).__name__ == expected_class.get(architecture, "LlamaForCausalLM")
    assert model.config.vocab_size == VOCAB_SIZE
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) == (architecture == "qwen2")
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (architecture in ("llama", "qwen2"))
    if architecture == "llama3":
        assert model.config.rope_parameters["rope_type"] == "llama3"

    prompt = torch.tensor([[BOS_TOKEN_ID, *b"Once upon a time"]])
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    new_ids = out[0, prompt.shape[1] :].tolist()
    assert len(new_ids) == 24
    assert len(set(new_ids)) > 6  # not one token repeated forever


def test_logits_are_well_separated(tiny_dirs: dict[str, Path]) -> None:
    """Greedy argmax must not be a near-tie, or float rounding flips it between engines."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dirs["llama"], dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(0)
    gaps, stds = [], []
    with torch.no_grad():
        for length in range(1, 61):
            ids = torch.randint(0, 256, (1, length), generator=gen)
            ids[0, 0] = BOS_TOKEN_ID
            logits = model(ids).logits[0, -1]
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            stds.append(float(logits[:256].std()))
    assert torch.tensor(stds).median() > 4.0
    assert torch.tensor(gaps).median() > 0.5
    assert min(gaps) > 1e-3


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_tokenizer_in_transformers(tiny_dirs: dict[str, Path], architecture: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs[architecture])
    assert len(tokenizer) <= VOCAB_SIZE
    ids = tokenizer("hello").input_ids
    assert ids == [BOS_TOKEN_ID, *b"hello"]  # byte-level: id b is byte b
    assert tokenizer.bos_token_id == BOS_TOKEN_ID
    assert tokenizer.eos_token_id == EOS_TOKEN_ID
    assert tokenizer.pad_token_id == PAD_TOKEN_ID
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [
        IM_START_TOKEN_ID,
        IM_END_TOKEN_ID,
    ]

    # qwen2's transformers tokenizer NFC-normalizes, so round-trip NFC text.
    text = unicodedata.normalize("NFC", UNICODE_TEXT)
    ids = tokenizer(text).input_ids
    assert ids == [BOS_TOKEN_ID, *text.encode("utf-8")]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text

    # Special tokens written in the text are single tokens.
    ids = tokenizer("a<|im_end|>b", add_special_tokens=False).input_ids
    assert ids == [97, IM_END_TOKEN_ID, 98]


def test_chat_template(tiny_dirs: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ✓"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi ✓<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"][:2] == [BOS_TOKEN_ID, IM_START_TOKEN_ID]  # bos once, not twice
    assert ids["input_ids"].count(BOS_TOKEN_ID) == 1


def test_unknown_size_or_architecture(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="huge"):
        write_builtin_model(tmp_path, size="huge")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        write_builtin_model(tmp_path, architecture="gpt2")


def test_progress_bar_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_builtin_model(tmp_path / "quiet", "tiny")
    assert capsys.readouterr().err == ""
    write_builtin_model(tmp_path / "loud", "tiny", progress=True)
    assert "pdserve tiny weights" in capsys.readouterr().err


def test_resolve_generates_once_into_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_dir("tiny"))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1
    model_dir = results[0]
    assert model_dir.parent == tmp_path / "models"
    assert set(file_hashes(model_dir)) == EXPECTED_FILES
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]  # no temp dirs left

    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(None) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten

    qwen = resolve_model_dir("tiny-qwen2")
    assert '"Qwen2ForCausalLM"' in (qwen / "config.json").read_text()


def test_resolve_local_directory(tmp_path: Path) -> None:
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_dir(str(missing))
