"""`pdserve bench tpot` on the CPU: a bare shape with random weights (`load_format: dummy`),
graphs mode through the padded decode path, eager mode without it."""

from __future__ import annotations

import json

import pytest

from bench.offline import tpot

TINY_SHAPE = {
    **tpot.LLAMA3_8B,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "torch_dtype": "float32",
}


def test_tpot_table_for_a_random_weight_shape(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(tpot.SHAPES, "tiny-shape", TINY_SHAPE)
    argv = ["--models", "tiny-shape", "--device", "cpu", "--dtype", "float32", "--batch", "1", "3"]
    argv += ["--prompt-len", "8", "--output-len", "5", "--json"]
    assert tpot.main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        ("graphs", 1),
        ("graphs", 3),
        ("eager", 1),
        ("eager", 3),
    ]
    # 4 decode steps per batch after the prefill step, each through the padded path
    assert [r["graph_steps"] for r in rows] == [4, 4, 0, 0]
    # hidden 64 x (qkv 128 + o 64 + gate/up 192 + down 96) x 2 layers + lm_head 64 x 512
    # + norms (64 x 5), float32; the embedding table is not counted
    weights = 4 * (2 * 64 * (128 + 64 + 192 + 96) + 64 * 512 + 5 * 64 + 2 * 2 * 2)
    assert all(r["weight_gb"] == round(weights / 1e9, 3) for r in rows)
    assert all(r["tpot_ms"] > 0 for r in rows)
