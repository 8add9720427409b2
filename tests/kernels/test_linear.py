"""The oneDNN-packed projection equals its torch reference; the model's Linear packs once,
in the layout `packing` picks (the float32 C GEMM's or oneDNN's)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import gemm_f32
from engine.kernels.linear import (
    can_pack,
    linear,
    linear_ref,
    pack_linear_weight,
    packing,
    uses_onednn,
)
from engine.layers import Linear

DTYPES = [torch.float32, torch.bfloat16]
# (atol, rtol): float32 sums in another order; bfloat16 rounds the output once
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 1e-2)}


def packable(dtype: torch.dtype) -> bool:
    return can_pack(torch.empty(2, 2, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(64, 96), (576, 960), (1536, 576)])
def test_matches_reference(
    dtype: torch.dtype, rows: int, bias: bool, shape: tuple[int, int]
) -> None:
    if not packable(dtype):
        pytest.skip(f"oneDNN cannot run {dtype} on this CPU")
    torch.manual_seed(rows)
    in_features, out_features = shape
    x = torch.randn(rows, in_features).to(dtype)
    weight_t = (torch.randn(in_features, out_features) / in_features**0.5).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    packed = pack_linear_weight(weight_t)
    assert packed is not None and tuple(packed.shape) == (out_features, in_features)
    out = linear(x, packed, b)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    expected = linear_ref(x.float(), weight_t.float(), None if b is None else b.float())
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_strided_rows() -> None:
    """Rows sliced out of a wider tensor (a split of a fused projection) work unchanged."""
    torch.manual_seed(0)
    wide = torch.randn(7, 100)
    x = wide[:, :64]
    weight_t = torch.randn(64, 32)
    packed = pack_linear_weight(weight_t)
    assert packed is not None
    torch.testing.assert_close(linear(x, packed, None), x.contiguous() @ weight_t)


def test_rejects_bad_inputs() -> None:
    packed = pack_linear_weight(torch.randn(64, 32))
    assert packed is not None
    with pytest.raises(ValueError, match="x must be"):
        linear(torch.randn(3, 63), packed, None)
    with pytest.raises(TypeError, match="packed weight"):
        linear(torch.randn(3, 64, dtype=torch.float64), packed, None)
    with pytest.raises(ValueError, match="bias"):
        linear(torch.randn(3, 64), packed, torch.randn(31))
    assert pack_linear_weight(torch.randn(64, 32, dtype=torch.float64)) is None


def test_which_projections_run_packed() -> None:
    assert not uses_onednn(torch.empty(4, 4, dtype=torch.float16))
    assert not uses_onednn(torch.empty(4, 4, dtype=torch.float64))
    assert not uses_onednn(torch.empty(4, 4))  # float32 never: not MKL's sums
    assert uses_onednn(torch.empty(4, 4, dtype=torch.bfloat16)) == packable(torch.bfloat16)


def test_float32_takes_the_c_gemm_where_it_runs() -> None:
    weight_t = torch.empty(4, 4)
    assert packing(weight_t) == ("f32" if gemm_f32.available() else None)
    assert packing(torch.empty(4, 4, dtype=torch.float16)) is None


KINDS = [(torch.float32, "f32"), (torch.float32, "onednn"), (torch.bfloat16, "onednn")]


@pytest.mark.parametrize(("dtype", "kind"), KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_module_packs_in_place_of_its_weight(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, kind: str, bias: bool
) -> None:
    """`Linear.pack` keeps the output and the parameter bytes (the C GEMM's layout pads the
    last column block); the dense copy is gone."""
    if kind == "onednn" and not packable(dtype):
        pytest.skip(f"oneDNN cannot run {dtype} on this CPU")
    if kind == "f32" and not gemm_f32.available():
        pytest.skip("the float32 C GEMM needs AVX-512, a C compiler and MKL's order")
    monkeypatch.setattr("engine.layers.packing", lambda weight_t: kind)
    torch.manual_seed(1)
    layer = Linear(48, 80, bias).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, 48).to(dtype)
    before = layer(x)
    param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    layer.pack()
    assert layer.weight_t is None and layer.weight_packed is not None
    assert layer.packing == kind
    padding = 48 * (96 - 80) * 4 if kind == "f32" else 0  # 80 columns in 2 blocks of 48
    assert sum(p.numel() * p.element_size() for p in layer.parameters()) == param_bytes + padding
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(layer(x), before, atol=atol, rtol=rtol)
    layer.pack()  # a second call is a no-op
    torch.testing.assert_close(layer(x), before, atol=atol, rtol=rtol)
