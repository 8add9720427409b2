"""The `pdserve` command line, run as a real subprocess: built-in model, offline generation,
the benchmarks by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = ["hello", "a much longer prompt that covers more than one sixteen-token KV block"]


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    result = pdserve("model", "tiny", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    return out


def test_generate_json_matches_transformers(model_dir: Path) -> None:
    args = ["generate", "--model", str(model_dir), "--max-tokens", "32", "--temperature", "0"]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    result = pdserve(*args, "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)  # stdout is exactly one JSON object
    outputs = payload["outputs"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = torch.tensor([tokenizer(prompt).input_ids])
        with torch.no_grad():
            expected = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
            )
        expected_ids = expected[0, ids.shape[1] :].tolist()
        assert output["token_ids"] == expected_ids
        assert output["text"] == tokenizer.decode(expected_ids, skip_special_tokens=True)


def test_bad_arguments_fail_cleanly(model_dir: Path) -> None:
    result = pdserve("generate", "--model", str(model_dir), "--prompt", "x", "--max-tokens", "0")
    assert result.returncode != 0
    assert "max_tokens must be >= 1" in result.stderr
    missing = pdserve("generate", "--model", "/nonexistent/model", "--prompt", "x")
    assert missing.returncode != 0 and "/nonexistent/model" in missing.stderr
    assert pdserve("model", "huge", "/tmp/x").returncode == 2


def test_bench_is_handed_to_the_benchmarks() -> None:
    listing = pdserve("bench", "--help")
    assert listing.returncode == 0, listing.stderr
    for name in ("compare", "engine", "serve", "summary", "transfer"):
        assert f"  {name} " in listing.stdout
    compare = pdserve("bench", "compare", "--help")
    assert compare.returncode == 0, compare.stderr
    assert compare.stdout.startswith("usage: pdserve bench compare")
    assert "--configs" in compare.stdout
    assert pdserve("bench", "nope").returncode == 2
    assert "bench" in pdserve("--help").stdout
