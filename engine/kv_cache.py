"""Paged KV cache storage: per-layer K and V tensors over one flat buffer.

Layout of the flat buffer: `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]`, so layer `l`'s K is `buffer[l, 0]` with shape
`[num_blocks, block_size, num_kv_heads, head_dim]`. One flat buffer lets the `shm` transfer
backend place the whole cache in shared memory that a prefill process maps and writes.

With `kv_cache_dtype: fp8` the buffer holds `float8_e4m3fn` (1 byte per value, half of
bf16); the per-KV-head scales that give the values meaning are static and belong to the
model (`Attention.k_scale` / `v_scale`), so transfers move the bytes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import DTYPE_BYTES, EngineConfig, ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What a KV cache may store: the model dtypes, and FP8 (`kv_cache_dtype: fp8`).
KV_TORCH_DTYPES = {**TORCH_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Geometry of a paged KV cache; both ends of a KV transfer must agree on it."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "float8_e4m3fn"
    # A tensor-parallel replica's cache: `num_layers` is the model's layers x this, each item
    # `num_kv_heads` wide (the widest rank's heads) out of the model's `model_kv_heads`.
    tensor_parallel_size: int = 1
    model_kv_heads: int | None = None  # None: num_kv_heads (tensor_parallel_size 1)

    @classmethod
    def for_model(
        cls,
        model_config: ModelConfig,
        block_size: int,
        kv_cache_bytes: int,
        dtype: str,
        tensor_parallel_size: int = 1,
    ) -> KVCacheSpec:
        """The largest cache of `block_size` blocks that fits in `kv_cache_bytes`.

        With tensor parallelism the cache is replica-wide: `num_layers * size` items, one
        per (layer, rank), each of the widest rank's KV heads (`engine.parallel`).
        """
        size = tensor_parallel_size
        probe = cls(
            num_layers=model_config.num_hidden_layers * size,
            num_blocks=1,
            block_size=block_size,
            num_kv_heads=-(-model_config.num_key_value_heads // size),
            head_dim=model_config.head_dim,
            dtype=dtype,
        )
        num_blocks = kv_cache_bytes // probe.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} holds no block of "
                f"{probe.bytes_per_block} bytes (block_size={block_size})"
            )
        return cls(
            num_layers=probe.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=probe.num_kv_heads,
            head_dim=probe.head_dim,
            dtype=dtype,
            tensor_parallel_size=size,
            model_kv_heads=model_config.num_key_value_heads,
        )

    @classmethod
    def for_engine(cls, config: EngineConfig, model_config: ModelConfig) -> KVCacheSpec:
        """The geometry an engine built from `config` uses (decode's receiver needs it first)."""
        return cls.for_model(
            model_config,
            config.cache.block_size,
            config.cache.kv_cache_bytes,
            kv_storage_dtype(config.cache.kv_cache_dtype, model_config.dtype),
            config.tensor_parallel_size,
        )

    @property
    def num_model_layers(self) -> int:
        return self.num_layers // self.tensor_parallel_size

    @property
    def num_model_kv_heads(self) -> int:
        return self.num_kv_heads if self.model_kv_heads is None else self.model_kv_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_TORCH_DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K (or V): `[block_size, num_kv_heads, head_dim]`."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_per_layer(self) -> int:
        """K or V bytes of one block in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block across all layers."""
        return 2 * self.num_layers * self.bytes_per_block_per_layer

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def flat_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, *self.block_shape)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The cache's element dtype: the model's for "auto", `float8_e4m3fn` for "fp8"."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return "float8_e4m3fn"
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")


class KVCache:
    """The K and V tensors of every layer, views of one flat buffer."""

    def __init__(self, spec: KVCacheSpec, flat: torch.Tensor) -> None:
        if tuple(flat.shape) != spec.flat_shape or flat.dtype != spec.torch_dtype:
            raise ValueError(
                f"flat buffer {tuple(flat.shape)}/{flat.dtype} does not match "
                f"{spec.flat_shape}/{spec.torch_dtype}"
            )
        self.spec = spec
        self.flat = flat
        # [num_blocks, block_size, num_kv_heads, head_dim] per layer
        self.key_caches: list[torch.Tensor] = [flat[i, 0] for i in range(spec.num_layers)]
        self.value_caches: list[torch.Tensor] = [flat[i, 1] for i in range(spec.num_layers)]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, device: str | torch.device = "cpu") -> KVCache:
        """A zeroed cache in ordinary device memory."""
        flat = torch.zeros(spec.flat_shape, dtype=spec.torch_dtype, device=device)
        return cls(spec, flat)

    @classmethod
    def from_buffer(cls, spec: KVCacheSpec, buffer: memoryview | bytearray) -> KVCache:
        """A CPU cache over an existing writable buffer (e.g. shared memory); no copy."""
        if len(buffer) < spec.total_bytes:
            raise ValueError(f"buffer of {len(buffer)} bytes < cache of {spec.total_bytes}")
        flat = torch.frombuffer(
            buffer, dtype=spec.torch_dtype, count=spec.total_bytes // DTYPE_BYTES[spec.dtype]
        )
        return cls(spec, flat.view(spec.flat_shape))

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks

    @property
    def block_size(self) -> int:
        return self.spec.block_size
