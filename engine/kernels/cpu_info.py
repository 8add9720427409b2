"""What this CPU is, read once from `/proc/cpuinfo`: the kernels' dispatch (AVX-512, the
vendor's BLAS), the kernel cache's key and the benchmarks' machine record all read it here."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CpuInfo:
    vendor: str  # "GenuineIntel", "AuthenticAMD", ... ("" when unknown)
    model_name: str  # "unknown" when not read
    flags: frozenset[str]
    identity_lines: str  # its `model name` and `flags` lines as written

    @property
    def x86_64(self) -> bool:
        return platform.machine() in ("x86_64", "AMD64")

    @property
    def intel(self) -> bool:
        return self.vendor == "GenuineIntel"

    @property
    def avx512(self) -> bool:
        return self.x86_64 and "avx512f" in self.flags

    @property
    def avx2_fma(self) -> bool:
        """256-bit vectors with fused multiply-add (x86-64 since Haswell and Zen; also what a
        hypervisor that hides AVX-512 leaves)."""
        return self.x86_64 and {"avx2", "fma"} <= self.flags

    @property
    def amx_bf16(self) -> bool:
        """AMX tiles with bfloat16 products (Intel Sapphire Rapids and later)."""
        return self.x86_64 and {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def avx512_bf16(self) -> bool:
        """`vdpbf16ps` (AMD Zen 4 and later, Intel Cooper Lake and later)."""
        return self.avx512 and "avx512_bf16" in self.flags

    @property
    def bf16_products(self) -> bool:
        """bfloat16 products in hardware (AMX or AVX512-BF16): without them (x86-64 only)
        torch and oneDNN emulate bfloat16 matmuls, far slower than float32."""
        return self.amx_bf16 or self.avx512_bf16

    def identity(self) -> str:
        """The model and its flags: a library built with -march=native runs only where
        they are the same."""
        return self.identity_lines or platform.processor()


def parse(text: str) -> CpuInfo:
    """A `CpuInfo` from the text of `/proc/cpuinfo` (its first processor's fields)."""
    fields: dict[str, str] = {}
    lines: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in ("vendor_id", "model name", "flags") and key not in fields:
            fields[key] = value.strip()
            lines[key] = line
    return CpuInfo(
        vendor=fields.get("vendor_id", ""),
        model_name=fields.get("model name", "unknown"),
        flags=frozenset(fields.get("flags", "").split()),
        identity_lines="\n".join(lines[k] for k in ("model name", "flags") if k in lines),
    )


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU (an empty record where `/proc/cpuinfo` cannot be read)."""
    try:
        return parse(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuInfo("", "unknown", frozenset(), "")
