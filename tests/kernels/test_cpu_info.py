"""`engine.kernels.cpu_info`: the fields the kernels dispatch on, from `/proc/cpuinfo` text."""

from __future__ import annotations

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
    assert parse("").model_name == "unknown" and parse("").flags == frozenset()


def test_this_machine_is_read_once() -> None:
    assert cpu_info() is cpu_info()
