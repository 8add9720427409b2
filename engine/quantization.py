"""FP8 weights (`quantization: fp8`) and the FP8 KV cache option (`kv_cache_dtype: fp8`).

Weights: the decoder layers' projections (q/k/v, o, gate/up, down) are stored as
`float8_e4m3fn` with one float32 scale per output channel (`W[o, :] ≈ q[o, :] * scale[o]`).
Embedding, norms and the LM head stay in the model dtype. They come either

- from a full-precision checkpoint, quantized at load: `scale[o] = max|W[o, :]| / 448`; or
- from an FP8 checkpoint (our convention, that of common Hugging Face FP8 checkpoints):
  `config.json` has `"quantization_config": {"quant_method": "fp8"}` (no
  `weight_block_size`), each projection's `weight` is `float8_e4m3fn` and a float32
  `weight_scale` sits beside it, one value per output channel (`[out]` or `[out, 1]`) or
  one for the tensor (`[]` or `[1]`, expanded per channel). Activations are scaled per token
  at run time, so an `input_scale` beside them is not used.

On CUDA with bfloat16 activations `Fp8Linear` runs `torch._scaled_mm` (FP8 tensor cores,
per-token activation scales); elsewhere it dequantizes (the reference path CPU CI runs).

KV cache: `engine.kernels.fp8` stores K/V as FP8 with a static float32 scale per KV head per layer,
read from the checkpoint's `model.layers.{i}.self_attn.k_scale` / `v_scale` (a scalar or
`[num_kv_heads]`), else 1.0 (e4m3 spans ±448 with 3 mantissa bits, ample for K/V values
of order 1-100).
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping

import torch
from torch import nn

from engine.kernels.fp8 import FP8_DTYPE, FP8_MAX

QUANTIZATION_METHODS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_KV_STORAGE = "float8_e4m3fn"  # KVCacheSpec.dtype of an FP8 cache
# The decoder projections that become Fp8Linear (Hugging Face names).
_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$")
# Checkpoint tensors that are scales: loaded in float32 whatever the model dtype.
SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale")


def check_fp8_options(
    quantization: str | None,
    kv_cache_dtype: str,
    dtype: str | None,
    device: str,
) -> None:
    """ValueError with the reason when this combination cannot run (`dtype` None: not known
    yet, the checkpoint's own; the engine calls this again once it is)."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or null")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if quantization == "fp8" and device == "cuda" and dtype not in (None, "bfloat16"):
        raise ValueError(
            f"quantization fp8 on CUDA needs dtype bfloat16, not {dtype}: torch._scaled_mm "
            "with per-channel scales writes bfloat16 only"
        )


def check_fp8_device(quantization: str | None, kv_cache_dtype: str, device: torch.device) -> None:
    """FP8 on CUDA needs FP8 hardware (compute capability 8.9+: Ada, Hopper and later)."""
    if device.type != "cuda" or (quantization is None and kv_cache_dtype == "auto"):
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); {name} has "
            f"{capability[0]}.{capability[1]}: drop quantization/kv_cache_dtype fp8"
        )


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` weight -> (`float8_e4m3fn` `[out, in]`, float32 scales `[out]`)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_weight`, in float32."""
    return q.float() * scale[:, None]


def prepare_fp8_weights(state: MutableMapping[str, torch.Tensor]) -> None:
    """Turn every decoder projection `X.weight` of a Hugging Face state dict into FP8 with a
    per-channel float32 `X.weight_scale` `[out]`, in place: full-precision weights are
    quantized, FP8 ones keep their values and their checkpoint scales. `X.input_scale`
    tensors are dropped (activations are scaled per token at run time)."""
    for name in [n for n in state if n.endswith(".weight")]:
        prefix = name.removesuffix(".weight")
        if not _PROJECTION.match(prefix):
            continue
        weight = state[name]
        state.pop(prefix + ".input_scale", None)
        if weight.dtype == FP8_DTYPE:
            if prefix + ".weight_scale" not in state:
                raise ValueError(f"FP8 weight {name!r} has no {prefix}.weight_scale beside it")
            state[prefix + ".weight_scale"] = _per_channel(
                state[prefix + ".weight_scale"], weight.shape[0], prefix + ".weight_scale"
            )
        else:
            state[name], state[prefix + ".weight_scale"] = quantize_weight(weight)


def pop_kv_scale(
    state: MutableMapping[str, torch.Tensor], name: str, num_kv_heads: int
) -> torch.Tensor:
    """The checkpoint's KV scale `name` (e.g. `model.layers.0.self_attn.k_scale`) as float32
    `[num_kv_heads]`, removed from `state`; ones when the checkpoint has none."""
    scale = state.pop(name, None)
    if scale is None:
        return torch.ones(num_kv_heads)
    return _per_channel(scale, num_kv_heads, name)


def _per_channel(scale: torch.Tensor, num: int, name: str) -> torch.Tensor:
    flat = scale.float().reshape(-1)
    if flat.numel() == 1:
        return flat.expand(num).clone()
    if flat.numel() != num:
        raise ValueError(f"{name} has {flat.numel()} values; expected 1 or {num}")
    if not bool((flat > 0).all()):
        raise ValueError(f"{name} has scales that are not positive")
    return flat


def keeps_dtype(name: str, tensor: torch.Tensor) -> bool:
    """Parameters the model dtype does not apply to: FP8 weights and float32 scales."""
    return tensor.dtype == FP8_DTYPE or name.endswith(("weight_scale", "k_scale", "v_scale"))


def cast_floating_(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for every floating parameter and buffer except FP8 weights and
    their float32 scales (`keeps_dtype`), in place."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and not keeps_dtype(name, param):
                param.data = param.data.to(dtype)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point() and not keeps_dtype(name, buffer):
                module.register_buffer(
                    name, buffer.to(dtype), name not in module._non_persistent_buffers_set
                )


class Fp8Linear(nn.Module):
    """`y = x @ (q * scale)^T + b` with FP8 weights `q` and per-output-channel scales.

    Same layout as `engine.layers.Linear`: `weight_t` is `[in, out]` (FP8), `weight_scale`
    `[out]` float32, `bias` in the model dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(
            torch.empty(in_features, out_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [.., out]
        if x.is_cuda and x.dtype == torch.bfloat16:  # pragma: no cover - needs an FP8 GPU
            return self._scaled_mm(x)
        # Reference: dequantize to the activations' dtype, then one matmul.
        weight = (self.weight_t.float() * self.weight_scale).to(x.dtype)
        if self.bias is None:
            return x @ weight
        return torch.addmm(self.bias, x, weight)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - needs CUDA
        # Per-token activation scales (`engine.kernels.fp8.quantize_per_token`, one Triton
        # kernel); _scaled_mm wants the second operand column-major, which `weight_t`
        # becomes once at load (`finish_loading`).
        from engine.kernels.triton.fp8_quant import quantize_per_token_triton

        x_q, x_scale = quantize_per_token_triton(x)
        out = torch._scaled_mm(
            x_q,
            self.weight_t,
            scale_a=x_scale,
            scale_b=self.weight_scale.view(1, -1),
            bias=self.bias,
            out_dtype=torch.bfloat16,
        )
        return out

    def finish_loading(self) -> None:
        """After the weights are in: on CUDA, lay `weight_t` out column-major for
        `torch._scaled_mm` (same shape and values)."""
        if self.weight_t.is_cuda:  # pragma: no cover - needs CUDA
            self.weight_t.data = self.weight_t.data.t().contiguous().t()


def finish_loading(model: nn.Module) -> None:
    """Call every `Fp8Linear.finish_loading` of `model`."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.finish_loading()
