"""`bench/offline/transfer.py` end to end on a tiny geometry: one JSON line with the promised
keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.offline import transfer

KEYS = {
    "tokens",
    "bytes",
    "transfer_gb_s",
    "reference_gb_s",
    "ratio",
    "raw_transfer_ms",
    "handover_ms",
    "overlap_total_ms",
    "compute_ms",
    "transfer_ms",
    "verified",
}


def write_config(directory: Path) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "vocab_size": 256,
        "max_position_embeddings": 512,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_geometry_is_read_from_config_json(tmp_path: Path) -> None:
    geometry = transfer.load_geometry(str(write_config(tmp_path)), "float32")
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (3, 2, 16)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_bench_prints_one_json_line_per_run(
    tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--backend",
        backend,
        "--model",
        str(write_config(tmp_path)),
        "--tokens",
        "40",
        "100",
        "--repeats",
        "1",
        "--json",
    ]
    assert transfer.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(lines[-1])
    assert [row["tokens"] for row in rows] == [40, 100]
    for row in rows:
        assert set(row) >= KEYS and row["verified"] is True
        assert row["bytes"] == 2 * 3 * 2 * 16 * 4 * 16 * -(-row["tokens"] // 16)
