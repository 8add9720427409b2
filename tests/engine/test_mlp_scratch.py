"""The MLP's temporaries (gate/up output, gate output) go into per-thread scratch buffers
where the float32 C GEMM runs (so a prefill does not fault in fresh pages for them every
layer): the result is the same as with fresh tensors, the buffers are reused, and
oversized ones are not kept."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import layers
from engine.config import ModelConfig
from engine.kernels import gemm_f32
from engine.model import MLP
from engine.parallel import single

pytestmark = pytest.mark.skipif(
    not gemm_f32.available(), reason="the scratch serves the float32 C GEMM only"
)


def _mlp() -> MLP:
    config = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=96,
        intermediate_size=144,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
    )
    torch.manual_seed(0)
    mlp = MLP(config, single(config))
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    for proj in (mlp.gate_up_proj, mlp.down_proj):
        proj.pack()
    assert mlp.gate_up_proj.packing == "f32"
    return mlp


def test_same_output_with_and_without_the_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    mlp = _mlp()
    x = torch.randn(37, 96)
    with torch.no_grad():
        with_scratch = mlp(x)
        bufs = dict(layers.scratch.bufs)
        assert bufs["gate_up"].numel() >= 37 * 2 * 144 and bufs["act"].numel() >= 37 * 144
        again = mlp(torch.randn(5, 96))  # a smaller call reuses the same buffers
        assert all(layers.scratch.bufs[k] is v for k, v in bufs.items())
        assert again.shape == (5, 96)
        monkeypatch.setattr(layers.Scratch, "MAX_BYTES", 0)
        without = mlp(x)
    assert torch.equal(with_scratch, without)


def test_each_thread_has_its_own_buffer() -> None:
    mlp = _mlp()
    x = torch.randn(8, 96)
    with torch.no_grad():
        mlp(x)
    main_buf = layers.scratch.bufs["gate_up"]
    seen: list[torch.Tensor] = []

    def run() -> None:
        with torch.no_grad():
            mlp(x)
        seen.append(layers.scratch.bufs["gate_up"])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    assert seen and seen[0] is not main_buf
