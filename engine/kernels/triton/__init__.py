"""Triton versions of the kernels, used for CUDA tensors.

Triton is optional: nothing here is imported until a public kernel sees a CUDA tensor,
and the modules import `triton` themselves. On the CPU they run under `TRITON_INTERPRET=1`
(tests only). The host wrappers in `engine/kernels/` check arguments before calling in here.
"""
