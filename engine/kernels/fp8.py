"""FP8 numerics: the KV cache's `float8_e4m3fn` storage with one static scale per KV head,
and the per-token quantization of activations before an FP8 projection (at the end).

A K (or V) value `x` of kv head `h` is stored as `fp8(clamp(x / scale[h], ±448))` and read
back as `fp8_value * scale[h]`. Scales are float32 `[num_kv_heads]` per layer; they are
static (the checkpoint's `k_scale`/`v_scale`, else 1.0), so every replica holding the same
model stores and reads the same bytes, and a KV transfer moves those bytes as they are.

The clamp matters: a cast above the format's largest finite value (448) gives NaN on CUDA.
Quantization always runs in float32 (casting bf16 to fp8 directly rounds twice).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_DTYPE)
MIN_TOKEN_SCALE = 1e-12  # an all-zero row's scale (any positive value quantizes it to 0)


def is_fp8(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds FP8 (e4m3fn) values."""
    return tensor.dtype == FP8_DTYPE


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as uint8 (same bytes; CPU ops such as `index_copy_` lack FP8
    kernels); any other tensor as it is."""
    return tensor.view(torch.uint8) if is_fp8(tensor) else tensor


def quantize_per_head(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`[..., num_kv_heads, head_dim]` values to FP8 with per-head `scale` `[num_kv_heads]`."""
    scaled = x.float() / scale.view(-1, 1)
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_per_head(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """FP8 `[..., num_kv_heads, head_dim]` back to `dtype` (the product is taken in float32)."""
    return (x.float() * scale.view(-1, 1)).to(dtype)


def check_kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """An FP8 cache needs both scales, float32 `[num_kv_heads]` on its device; any other
    cache takes none (a scale passed for a full-precision cache is a wiring mistake)."""
    if not is_fp8(k_cache):
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                f"k_scale/v_scale apply to an FP8 cache only; this one is {k_cache.dtype}"
            )
        return
    num_kv_heads = k_cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"an FP8 KV cache needs {name} (float32 [{num_kv_heads}])")
        if scale.dtype != torch.float32 or tuple(scale.shape) != (num_kv_heads,):
            raise TypeError(
                f"{name} must be float32 [{num_kv_heads}], got {scale.dtype} {tuple(scale.shape)}"
            )
        if scale.device != k_cache.device:
            raise ValueError(f"{name} is on {scale.device} but the cache is on {k_cache.device}")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[rows, cols]` to FP8 with one float32 scale per row (`[rows, 1]`,
    `max|row| / 448`), as an FP8 projection takes them (`engine.quantization.Fp8Linear`);
    the reference for `engine.kernels.triton.fp8_quant`."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_(min=MIN_TOKEN_SCALE)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
