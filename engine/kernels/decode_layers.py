"""Every decoder layer of a CPU decode step in one C call, float32 or bfloat16.

A decode step of the `small` model spent ~12 of its ~54 ms in Python between its C kernels:
~15 calls per layer (module calls, wrappers' checks, views, the cache write's two
`index_copy_`), each a few to tens of microseconds, against kernels that take 3-400 us.
`DecodeLayers` keeps, for one model and one KV cache, the addresses of every layer's packed
weights and cache (`pd_layer`), and `run` hands a step to a C driver
(`csrc/decode_layers.c`).

- **float32** (projections packed for `gemm_f32`): the driver calls the same kernels the
  layer-by-layer path calls: `gemm_f32`, the float32 norm, rotary and gate of
  `cpu_elementwise`, and `decode_attention`, in the same order on the same values. The
  output is bit for bit that path's (tests/kernels/test_decode_layers.py).
- **bfloat16** (projections packed for the AMX GEMM, `gemm_bf16`; a bfloat16 cache): the
  same kernels on float32 activations, which are rounded to bfloat16 only where a GEMM reads
  them and where K/V enter the cache. The layer path rounds after every op instead, so the
  two agree to bfloat16's precision, not bit for bit; keeping the residual stream in float32
  is the more accurate of the two. Without AMX (AMD) bfloat16 stays on the layer path.

The layer path stays the reference and runs every step this one does not cover: prefill
and mixed steps, tensor parallelism, FP8, a layer hook, or a kernel that is not built here
(`DecodeLayers.build` returns None).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, cast

import torch

from engine.kernels import cpu_elementwise, gemm_bf16, gemm_f32
from engine.kernels.decode_attention import _check_tables, _kernels
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.native import kernel_source, labelled, load_library

if TYPE_CHECKING:
    from engine.kv_cache import KVCache
    from engine.layers import Linear
    from engine.model import CausalLM, DecoderLayer

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_FLOAT = ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [
        (name, _PTR)
        for name in (
            "gemm",
            "norm",
            "rope",
            "silu",
            "attention",
            "gemm_bf16",
            "to_bf16",
            "attention_bf16",
        )
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _PTR)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "o",
            "gate_up",
            "down",
            "qkv_bias",
            "o_bias",
            "gate_up_bias",
            "down_bias",
            "k_cache",
            "v_cache",
        )
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *[
            (name, _I64)
            for name in (
                "num_layers",
                "hidden",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "inter",
                "block_size",
                "bf16",
            )
        ],
        ("eps", _FLOAT),
        ("scale", _FLOAT),
        ("layers", ctypes.POINTER(_Layer)),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("num_seqs", _I64),
        ("h", _PTR),
        ("residual", _PTR),
        ("cos", _PTR),
        ("sin", _PTR),
        ("slots", _PTR),
        ("block_tables", _PTR),
        ("table_stride", _I64),
        ("seq_lens", _PTR),
        ("max_seq_len", _I64),
        *[(name, _PTR) for name in ("x", "qkv", "qk", "attn", "o", "gate_up", "act")],
        *[(name, _PTR) for name in ("xb", "qkb", "attnb")],
        ("threads", ctypes.c_int),
    ]


@functools.cache
def _driver() -> tuple[ctypes._CFuncPtr, _Kernels] | None:  # type: ignore[name-defined]
    """The driver and the kernels it calls, or None where one of them is not built here.
    The float32 GEMM may be missing (torch sums in an order it does not know): the
    bfloat16 step does not call it, and `build` runs a float32 one only with it."""
    gemm = gemm_f32._kernel()
    elementwise = cpu_elementwise._library()
    attention = _kernels() or {}
    if elementwise is None or torch.float32 not in attention:
        return None
    lib = load_library("decode_layers", kernel_source("decode_layers.c"))
    if lib is None:
        return None
    fn = lib.pd_decode_layers
    fn.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    fn.restype = ctypes.c_int

    def address(f: ctypes._CFuncPtr | None) -> int | None:  # type: ignore[name-defined]
        return None if f is None else ctypes.cast(f, _PTR).value

    bf16_lib, bf16_gemm = gemm_bf16._library(), gemm_bf16.kernel()
    kernels = _Kernels(
        address(gemm),
        address(elementwise.pd_add_rms_norm_f32),
        address(elementwise.pd_rope_f32),
        address(elementwise.pd_silu_mul_f32),
        address(attention[torch.float32]),
        address(bf16_gemm),
        address(None if bf16_lib is None else bf16_lib.pd_f32_to_bf16_n),
        address(attention.get(torch.bfloat16)),
    )
    return fn, kernels


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _layers(model: CausalLM) -> list[DecoderLayer]:
    return [cast("DecoderLayer", layer) for layer in model.layers]


def _projections(layer: DecoderLayer) -> list[Linear]:
    """qkv, o, gate/up, down (as `Linear`: `build` checked them)."""
    a, m = layer.self_attn, layer.mlp
    return [cast("Linear", p) for p in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]


class DecodeLayers:
    """One model's layers over one KV cache, for `run`; built by `build`."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, bf16: bool) -> None:
        driver = _driver()
        assert driver is not None
        self._fn, self._kernels = driver
        self.bf16 = bf16
        config = model.config
        decoder = _layers(model)
        first = decoder[0]
        attn, mlp = first.self_attn, first.mlp
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.inter = attn.head_dim, mlp.intermediate_size
        self.hidden = config.hidden_size
        self.kv_cache = kv_cache  # the tensors stay alive while their addresses are held
        # float32 norms and biases: the model's own, or (bfloat16) copies kept alive here
        self._float32: list[torch.Tensor] = []

        def float32(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if t.dtype != torch.float32:
                t = t.detach().float().contiguous()
                self._float32.append(t)
            return t.data_ptr()

        layers = (_Layer * len(decoder))()
        for i, layer in enumerate(decoder):
            projections = _projections(layer)
            layers[i] = _Layer(
                float32(layer.input_layernorm.weight),
                float32(layer.post_attention_layernorm.weight),
                *(_ptr(proj.weight_packed) for proj in projections),
                *(float32(proj.bias) for proj in projections),
                kv_cache.key_caches[i].data_ptr(),
                kv_cache.value_caches[i].data_ptr(),
            )
        self._layers = layers
        self._model = _Model(
            len(decoder),
            self.hidden,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.inter,
            kv_cache.spec.block_size,
            bf16,
            first.input_layernorm.eps,
            attn.scale,
            layers,
        )

    @classmethod
    def build(cls, model: CausalLM, kv_cache: KVCache) -> DecodeLayers | None:
        """The fused path for this model and cache, or None where it does not apply (then
        the layer-by-layer path runs, as it always may): float32 weights (the C GEMM's) and
        cache, or bfloat16 weights (the AMX GEMM's) and cache."""
        from engine.layers import Linear

        driver = _driver()
        if driver is None or model.tp.size != 1:
            return None
        decoder = _layers(model)
        packings = {
            p.packing if isinstance(p, Linear) else None
            for layer in decoder
            for p in _projections(layer)
        }
        if packings == {"f32"} and driver[1].gemm:
            dtype, bf16 = torch.float32, False
        elif packings == {"bf16"} and driver[1].gemm_bf16 and driver[1].attention_bf16:
            dtype, bf16 = torch.bfloat16, True
        else:
            return None
        caches = [*kv_cache.key_caches, *kv_cache.value_caches]
        if any(c.dtype != dtype or not c.is_contiguous() or c.is_cuda for c in caches):
            return None
        # the same rule as the layer path's norm and gate: where they run torch, so must this
        if not cpu_elementwise.exact_float32_norm(model.config.hidden_size):
            return None
        if not cpu_elementwise.exact_float32_gate(decoder[0].mlp.intermediate_size):
            return None
        for layer in decoder:
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
                return None
        return cls(model, kv_cache, bf16)

    def run(
        self,
        h: torch.Tensor,  # [num_seqs, hidden] embeddings
        cos: torch.Tensor,  # [num_seqs, 1, head_dim]
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream) of a decode-only step, as the
        layers one by one would return them; the step's K/V land in the cache."""
        num_seqs = h.shape[0]
        spec = self.kv_cache.spec
        _check_tables(
            metadata.block_tables,
            metadata.seq_lens,
            metadata.seq_lens_list,
            num_seqs,
            spec.num_blocks,
            spec.block_size,
        )
        slots = metadata.slot_mapping
        if slots.shape != (num_seqs,) or slots.dtype != torch.int64:
            raise ValueError(f"slot_mapping must be [{num_seqs}] int64")
        num_slots = spec.num_blocks * spec.block_size
        if num_seqs and not 0 <= int(slots.min()) <= int(slots.max()) < num_slots:
            raise IndexError(f"slot out of range [0, {num_slots})")
        dtype = h.dtype
        h = h.to(torch.float32, copy=True).contiguous()  # written in place
        heads = self.num_heads + self.num_kv_heads
        width = (heads + self.num_kv_heads) * self.head_dim

        def scratch(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(num_seqs, *shape, dtype=dtype)

        residual, x, o = scratch(self.hidden), scratch(self.hidden), scratch(self.hidden)
        qkv, qk = scratch(width), scratch(heads, self.head_dim)
        attn = scratch(self.num_heads * self.head_dim)
        gate_up, act = scratch(2 * self.inter), scratch(self.inter)
        bf16_scratch: tuple[torch.Tensor, ...] = ()  # the driver's bfloat16 buffers
        if self.bf16:
            bf16_scratch = (
                scratch(max(self.hidden, self.inter), dtype=torch.bfloat16),
                scratch(heads, self.head_dim, dtype=torch.bfloat16),
                scratch(self.num_heads * self.head_dim, dtype=torch.bfloat16),
            )
        cos = cos.reshape(num_seqs, self.head_dim).to(torch.float32).contiguous()
        sin = sin.reshape(num_seqs, self.head_dim).to(torch.float32).contiguous()
        slots = slots.contiguous()
        step = _Step(
            num_seqs,
            h.data_ptr(),
            residual.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            metadata.block_tables.data_ptr(),
            metadata.block_tables.stride(0),
            metadata.seq_lens.data_ptr(),
            metadata.max_seq_len,
            *(t.data_ptr() for t in (x, qkv, qk, attn, o, gate_up, act)),
            *(_ptr(t) for t in bf16_scratch or (None, None, None)),
            torch.get_num_threads(),
        )
        if num_seqs:
            with labelled("decode_layers"):
                status = self._fn(
                    ctypes.byref(self._kernels), ctypes.byref(self._model), ctypes.byref(step)
                )
            if status != 0:
                raise MemoryError("a decode kernel could not allocate its scratch buffers")
        return h.to(dtype), residual.to(dtype)
