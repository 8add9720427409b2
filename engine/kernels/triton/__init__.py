"""Triton versions of the kernels, used for CUDA tensors.

Triton is optional: nothing here is imported until a public kernel sees a CUDA tensor,
and the modules import `triton` themselves. On the CPU they run under `TRITON_INTERPRET=1`
(tests only). The host wrappers in `engine/kernels/` check arguments before calling in here
(`Fp8Linear` calls `fp8_quant` directly, which checks its own).
"""


def row_warps(block: int) -> int:
    """Warps for a program that holds one row of `block` (a power of two) elements: one
    per 512 elements, 1 to 16."""
    return max(1, min(16, block // 512))
