"""The float32 C GEMM: torch's sums bit for bit in the order it found on this CPU (the
shapes of the `small` model's projections, 16 rows and more; Intel's and AMD's orders each
on a reference of its own), close to them anywhere else (row tails, column tails, odd `K`),
and clear errors for inputs it does not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import gemm_f32

pytestmark = pytest.mark.skipif(
    not gemm_f32.available(),
    reason="the float32 C GEMM needs AVX-512, a C compiler and torch summing in a known order",
)


def _operands(rows: int, k: int, n: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    weight_t = torch.randn(k, n, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    return x, weight_t, b


@pytest.mark.parametrize("rows", [16, 256])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576, 960), (576, 576), (576, 3072), (1536, 576), (64, 96)])
def test_bit_for_bit_with_mkl(rows: int, bias: bool, shape: tuple[int, int]) -> None:
    """Token-exact float32 greedy output rests on this: F.linear is what `transformers` runs."""
    torch.set_num_threads(2)  # MKL's order depends on how it splits work between threads
    assert gemm_f32.order() in gemm_f32.ORDERS
    k, n = shape
    x, weight_t, b = _operands(rows, k, n, bias, seed=rows + k)
    expected = F.linear(x, weight_t.t().contiguous(), b)
    out = gemm_f32.gemm(x, gemm_f32.pack(weight_t), n, b)
    assert torch.equal(out, expected)


def test_bit_for_bit_over_many_row_chunks_and_threads() -> None:
    """A prefill step's GEMM: many row chunks, whose column blocks the threads take as they
    come free (`schedule(dynamic)`, so a thread the OS descheduled does not hold the other
    at a barrier); whichever thread computes a block, its sums are the same."""
    for rows, (k, n) in [(2048, (576, 960)), (333, (1536, 576))]:
        torch.set_num_threads(2)
        x, weight_t, b = _operands(rows, k, n, True, seed=rows)
        expected = F.linear(x, weight_t.t().contiguous(), b)
        packed = gemm_f32.pack(weight_t)
        try:
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(gemm_f32.gemm(x, packed, n, b), expected), (rows, threads)
        finally:
            torch.set_num_threads(2)


def _chains_reference(x, weight_t, bias, length: int, halves: bool) -> torch.Tensor:
    """`x @ W + bias` summed in one of `ORDERS`: each chain a sequence of fused multiply-adds
    from zero (a float32 product is exact in float64; the float64 add then rounds to
    float32, which differs from one FMA's rounding only on rare double-rounding ties: none
    on these seeded operands), the chains added in turn onto the bias."""

    def bounds(k0: int, k1: int) -> list[tuple[int, int]]:
        if not halves:
            return [(k, min(k + length, k1)) for k in range(k0, k1, length)]
        if k1 - k0 <= length:
            return [(k0, k1)]
        mid = k0 + (k1 - k0) // 2
        return bounds(k0, mid) + bounds(mid, k1)

    xd, wd = x.double(), weight_t.double()
    total = None if bias is None else bias.expand(x.shape[0], -1).clone()
    for k0, k1 in bounds(0, x.shape[1]):
        chain = torch.zeros(x.shape[0], weight_t.shape[1])
        for k in range(k0, k1):
            chain = (chain.double() + torch.outer(xd[:, k], wd[k])).float()
        total = chain if total is None else total + chain
    assert total is not None
    return total


@pytest.mark.parametrize(("length", "halves"), gemm_f32.ORDERS)
def test_each_known_order_against_its_reference(length: int, halves: bool) -> None:
    """Every order of `ORDERS`, whichever this CPU's is: the chains fall where they should."""
    lib = gemm_f32._library()
    found = gemm_f32.order()
    assert lib is not None and found is not None
    x, weight_t, b = _operands(8, 1000, 50, bias=True, seed=length)
    try:
        lib.pd_gemm_f32_set_order(length, int(halves))
        out = gemm_f32.gemm(x, gemm_f32.pack(weight_t), 50, b)
    finally:
        lib.pd_gemm_f32_set_order(found[0], int(found[1]))
    assert torch.equal(out, _chains_reference(x, weight_t, b, length, halves))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 200, 385])
@pytest.mark.parametrize("shape", [(100, 17), (777, 33), (64, 200), (2048, 50), (40, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_close_to_torch_on_every_tail(rows: int, shape: tuple[int, int], bias: bool) -> None:
    k, n = shape
    x, weight_t, b = _operands(rows, k, n, bias, seed=rows * n)
    expected = x @ weight_t if b is None else torch.addmm(b, x, weight_t)
    out = gemm_f32.gemm(x, gemm_f32.pack(weight_t), n, b)
    assert out.shape == (rows, n)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_pack_layout_and_strided_input() -> None:
    weight_t = torch.arange(5 * 50, dtype=torch.float32).view(5, 50)
    packed = gemm_f32.pack(weight_t)
    assert packed.numel() == 2 * 5 * gemm_f32.BLOCK_COLS  # 50 columns: two blocks of 48
    blocks = packed.view(2, 5, gemm_f32.BLOCK_COLS)
    assert torch.equal(blocks[0], weight_t[:, :48])
    assert torch.equal(blocks[1, :, :2], weight_t[:, 48:]) and not blocks[1, :, 2:].any()
    wide = torch.randn(7, 9, generator=torch.Generator().manual_seed(0))
    x = wide[:, :5]  # rows of a wider tensor: taken as they are
    # sums of a few hundred: a few ulps apart where torch adds in another order (7 rows)
    expected = x @ weight_t
    torch.testing.assert_close(gemm_f32.gemm(x, packed, 50, None), expected, atol=1e-3, rtol=1e-5)
    assert gemm_f32.gemm(torch.empty(0, 5), packed, 50, None).shape == (0, 50)


def test_rejects_what_it_cannot_run() -> None:
    packed = gemm_f32.pack(torch.randn(64, 32))
    with pytest.raises(ValueError, match="does not match"):
        gemm_f32.gemm(torch.randn(3, 63), packed, 32, None)
    with pytest.raises(TypeError, match="float32"):
        gemm_f32.gemm(torch.randn(3, 64, dtype=torch.float64), packed, 32, None)
    with pytest.raises(ValueError, match="bias"):
        gemm_f32.gemm(torch.randn(3, 64), packed, 32, torch.randn(31))
    with pytest.raises(TypeError, match="float32"):
        gemm_f32.pack(torch.randn(4, 4, dtype=torch.bfloat16))


def test_writes_into_a_given_output() -> None:
    x, weight_t, b = _operands(9, 100, 50, bias=True, seed=3)
    packed = gemm_f32.pack(weight_t)
    out = torch.full((9, 50), float("nan"))
    assert gemm_f32.gemm(x, packed, 50, b, out) is out
    assert torch.equal(out, gemm_f32.gemm(x, packed, 50, b))
    wrong_dtype = torch.empty(9, 50, dtype=torch.float64)
    for bad in (torch.empty(9, 51), torch.empty(50, 9).t(), wrong_dtype):
        with pytest.raises(ValueError, match="out must be"):
            gemm_f32.gemm(x, packed, 50, b, bad)


def test_calls_are_labelled_for_the_profiler() -> None:
    """`bench engine --profile` sees the C kernel's time (ctypes calls are otherwise not
    events of torch's profiler)."""
    x, weight_t, _ = _operands(16, 64, 96, False, seed=0)
    packed = gemm_f32.pack(weight_t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gemm_f32.gemm(x, packed, 96, None)
    assert "pdserve::gemm_f32" in {event.key for event in prof.key_averages()}
