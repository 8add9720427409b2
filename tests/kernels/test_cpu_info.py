"""`engine.kernels.cpu_info`: the fields the kernels dispatch on, from `/proc/cpuinfo` text."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.kernels.cpu_info import cpu_info, parse

AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16
processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16
"""


def test_parse_reads_the_first_processor() -> None:
    info = parse(AMD)
    assert info.vendor == "AuthenticAMD" and not info.intel
    assert info.model_name == "AMD EPYC 9R14"
    assert info.flags == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}
    model, flags = info.identity().splitlines()
    assert model == "model name\t: AMD EPYC 9R14"
    assert flags.endswith(": fpu sse2 avx2 avx512f avx512_bf16")


def test_a_cpu_without_avx512_or_a_vendor() -> None:
    info = parse("model name\t: Some CPU\nflags\t\t: fpu sse2 avx2\n")
    assert info.vendor == "" and not info.intel and not info.avx512
    assert not info.avx2_fma  # AVX2 without FMA: the GEMM's 256-bit tile needs both
    assert parse("").model_name == "unknown" and parse("").flags == frozenset()


def test_avx2_with_fma_as_a_hypervisor_that_hides_avx512_leaves_it() -> None:
    info = parse("vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 fma avx2 f16c\n")
    assert info.avx2_fma and not info.avx512 and not info.bf16_products
    assert parse(AMD).bf16_products  # AVX512-BF16


def test_bfloat16_on_a_cpu_without_bfloat16_products_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import engine.engine as engine_module

    cpu = torch.device("cpu")
    monkeypatch.setattr(engine_module, "cpu_info", lambda: parse("flags\t\t: fpu fma avx2\n"))
    with caplog.at_level(logging.WARNING, logger="engine.engine"):
        engine_module._note_emulated_bfloat16("float32", cpu)
        assert not caplog.records
        engine_module._note_emulated_bfloat16("bfloat16", cpu)
    assert "dtype='float32'" in caplog.text
    caplog.clear()
    monkeypatch.setattr(engine_module, "cpu_info", lambda: parse(AMD))
    with caplog.at_level(logging.WARNING, logger="engine.engine"):
        engine_module._note_emulated_bfloat16("bfloat16", cpu)
    assert not caplog.records


def test_this_machine_is_read_once() -> None:
    assert cpu_info() is cpu_info()
