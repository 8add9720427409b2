"""The CPU C kernels of the norm, rotary and SiLU gate equal their torch forms (bit for bit in
float32 and for the rotary), and the public functions pick them where they apply."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_elementwise
from engine.kernels.cpu_elementwise import add_rms_norm_cpu, rope_cpu, silu_mul_cpu
from engine.kernels.norm_rope import (
    apply_rope,
    apply_rope_ref,
    rms_norm,
    rms_norm_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

pytestmark = pytest.mark.skipif(not cpu_elementwise.available(), reason="no C compiler")
BF16 = (1.6e-2, 1.6e-2)  # (atol, rtol): one bf16 rounding apart at most, for values ~1


def rotary_inputs(dtype: torch.dtype, num_tokens: int = 37, head_dim: int = 64) -> tuple:
    """q/k heads sliced out of a fused QKV output (strided rows), and per-token cos/sin."""
    fused = torch.randn(num_tokens, 15, head_dim).to(dtype)
    x = fused[:, :12]  # [T, 12, D], row stride 15 * D
    positions = torch.randint(0, 4096, (num_tokens,))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x, emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 16, 600])
def test_rope_is_the_torch_form_bit_for_bit(dtype: torch.dtype, num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    x, cos, sin = rotary_inputs(dtype, num_tokens)
    out = rope_cpu(x, cos, sin)
    assert out is not None and out.is_contiguous()
    assert torch.equal(out, apply_rope_ref(x, cos, sin))
    assert torch.equal(apply_rope(x, cos, sin), out)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_add_rms_norm_matches_the_torch_form(with_residual: bool, num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, 576).bfloat16()
    residual = torch.randn(num_tokens, 576).bfloat16() if with_residual else None
    weight = (torch.rand(576) + 0.5).bfloat16()
    fused = add_rms_norm_cpu(x, weight, 1e-5, residual)
    assert fused is not None
    normed, summed = fused
    expected_normed, expected_summed = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(summed, expected_summed)  # the add rounds exactly as torch's
    torch.testing.assert_close(normed.float(), expected_normed.float(), atol=BF16[0], rtol=BF16[1])
    normed_public, _ = rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(normed_public, normed)


@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_silu_mul_matches_the_torch_form(num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    gate_up = (torch.randn(num_tokens, 2 * 1536) * 4).bfloat16()
    out = silu_mul_cpu(gate_up)
    assert out is not None and out.shape == (num_tokens, 1536)
    expected = silu_and_mul_ref(gate_up)
    torch.testing.assert_close(out.float(), expected.float(), atol=BF16[0], rtol=BF16[1])
    assert torch.equal(silu_and_mul(gate_up), out)


x86 = pytest.mark.skipif(not cpu_elementwise._X86, reason="float32 follows torch's x86 order")


@x86
@pytest.mark.parametrize("hidden", [8, 17, 576, 1000, 4096, 5120])
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_float32_norm_is_torch_bit_for_bit(hidden: int, num_tokens: int) -> None:
    """float32 results must be transformers' bit for bit: the sum of squares follows torch's
    order (vectors, accumulators, cascade levels past 16 groups, scalar leftover)."""
    torch.manual_seed(hidden + num_tokens)
    x = torch.randn(num_tokens, hidden) * 3
    residual = torch.randn(num_tokens, hidden) * 30
    weight = torch.randn(hidden) * 0.1 + 1
    for res, eps in ((None, 1e-6), (residual, 1e-5)):
        fused = add_rms_norm_cpu(x, weight, eps, res)
        assert fused is not None
        expected = rms_norm_ref(x, weight, eps, res)
        assert torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1])
        assert torch.equal(rms_norm(x, weight, eps, res)[0], expected[0])


@x86
@pytest.mark.parametrize("inter", [64, 1536, 11008])
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_float32_gate_is_torch_bit_for_bit(inter: int, num_tokens: int) -> None:
    torch.manual_seed(inter + num_tokens)
    gate_up = torch.randn(num_tokens, 2 * inter) * 6
    gate_up[0, :6] = torch.tensor([-200.0, 200.0, -104.5, 100.5, -90.0, 0.0])  # exp's edges
    out = silu_mul_cpu(gate_up)
    assert out is not None
    assert torch.equal(out, silu_and_mul_ref(gate_up))
    assert torch.equal(silu_and_mul(gate_up), out)


def test_float32_shapes_the_kernels_leave_to_torch() -> None:
    """Where bit-for-bit torch cannot be promised, the wrappers decline."""
    x, weight = torch.randn(4, 7), torch.rand(7)  # under one 8-lane vector: torch's scalar sum
    assert add_rms_norm_cpu(x, weight, 1e-5, None) is None
    assert torch.equal(rms_norm(x, weight, 1e-5)[0], rms_norm_ref(x, weight, 1e-5)[0])
    gate_up = torch.randn(4, 2 * 40)  # 40 columns: torch's scalar tail would take some
    assert silu_mul_cpu(gate_up) is None
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))


def test_layouts_the_kernels_decline() -> None:
    x, cos, sin = rotary_inputs(torch.float32)
    assert rope_cpu(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin) is None
    assert rope_cpu(x.double(), cos.double(), sin.double()) is None
    assert rope_cpu(x, cos.bfloat16(), sin.bfloat16()) is None
    cols = torch.randn(64, 8).bfloat16().t()  # columns strided
    assert add_rms_norm_cpu(cols, torch.ones(64).bfloat16(), 1e-5, None) is None
    assert silu_mul_cpu(torch.randn(4, 7).bfloat16()) is None
