"""The bfloat16 GEMMs (AMX, AVX512-BF16; one packed layout): against float32 sums of the same
bfloat16 operands (the products are exact, so only the order of the sums differs), on every
row and column tail, with and without bias, float32 and bfloat16 results, strided rows of
x; clear errors for inputs they do not take. Each kernel is skipped where it does not run."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import gemm_bf16

KERNELS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(gemm_bf16.kernel(name) is None, reason=f"no {name} here"),
    )
    for name in gemm_bf16.KERNELS
]


def _operands(rows: int, k: int, n: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    weight_t = (torch.randn(k, n, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen) if bias else None
    return x, weight_t, b


def _reference(x: torch.Tensor, weight_t: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight_t.double()
    return (y if b is None else y + b.double()).float()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 300])
@pytest.mark.parametrize("shape", [(32, 16), (64, 100), (576, 960), (1536, 576), (96, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_result_is_the_sum_of_exact_products(
    kernel: str, rows: int, shape: tuple[int, int], bias: bool
) -> None:
    k, n = shape
    x, weight_t, b = _operands(rows, k, n, bias, seed=rows * n + k)
    out = gemm_bf16.gemm(x, gemm_bf16.pack(weight_t), n, b, torch.float32, kernel)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, _reference(x, weight_t, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [3, 16, 40])
def test_bfloat16_result_is_the_float32_one_rounded(kernel: str, rows: int) -> None:
    x, weight_t, b = _operands(rows, 576, 200, True, seed=rows)
    packed = gemm_bf16.pack(weight_t)
    as_f32 = gemm_bf16.gemm(x, packed, 200, b, torch.float32, kernel)
    as_bf16 = gemm_bf16.gemm(x, packed, 200, b, torch.bfloat16, kernel)
    assert torch.equal(as_bf16, as_f32.to(torch.bfloat16))


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_of_a_wider_tensor(kernel: str) -> None:
    x, weight_t, _ = _operands(20, 128, 64, False, seed=7)
    wide = torch.zeros(20, 256, dtype=torch.bfloat16)
    wide[:, 64:192] = x
    view = wide[:, 64:192]
    out = gemm_bf16.gemm(view, gemm_bf16.pack(weight_t), 64, None, torch.float32, kernel)
    torch.testing.assert_close(out, _reference(x, weight_t, None), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not gemm_bf16.available(), reason="no bfloat16 GEMM here")
def test_no_rows() -> None:
    _, weight_t, _ = _operands(1, 64, 32, False, seed=1)
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    out = gemm_bf16.gemm(empty, gemm_bf16.pack(weight_t), 32, None)
    assert out.shape == (0, 32)


@pytest.mark.skipif(not gemm_bf16.available(), reason="no bfloat16 GEMM here")
def test_refuses_what_it_cannot_take() -> None:
    x, weight_t, _ = _operands(4, 64, 32, False, seed=2)
    packed = gemm_bf16.pack(weight_t)
    with pytest.raises(TypeError, match="multiple of 32"):
        gemm_bf16.pack(torch.zeros(48, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        gemm_bf16.pack(weight_t.float())
    with pytest.raises(TypeError, match="bfloat16"):
        gemm_bf16.gemm(x.float(), packed, 32, None)
    with pytest.raises(ValueError, match="does not match"):
        gemm_bf16.gemm(x, packed, 64, None)
    with pytest.raises(ValueError, match="bias"):
        gemm_bf16.gemm(x, packed, 32, torch.zeros(32, dtype=torch.bfloat16))
    assert not gemm_bf16.can_pack(torch.zeros(48, 32, dtype=torch.bfloat16))


def test_the_environment_picks_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`PDSERVE_BF16_GEMM`: a kernel by name, or "off" (oneDNN then); a typo is an error."""
    try:
        monkeypatch.setenv(gemm_bf16.KERNEL_ENV, "off")
        gemm_bf16.kernel_name.cache_clear()
        assert gemm_bf16.kernel_name() is None and not gemm_bf16.available()
        assert not gemm_bf16.can_pack(torch.zeros(64, 32, dtype=torch.bfloat16))
        monkeypatch.setenv(gemm_bf16.KERNEL_ENV, "avx512")
        gemm_bf16.kernel_name.cache_clear()
        expected = "avx512" if gemm_bf16._library() is not None else None
        assert gemm_bf16.kernel_name() == expected
        monkeypatch.setenv(gemm_bf16.KERNEL_ENV, "avx2")
        gemm_bf16.kernel_name.cache_clear()
        if gemm_bf16._library() is not None:
            with pytest.raises(ValueError, match="PDSERVE_BF16_GEMM"):
                gemm_bf16.kernel_name()
    finally:
        monkeypatch.delenv(gemm_bf16.KERNEL_ENV)
        gemm_bf16.kernel_name.cache_clear()
