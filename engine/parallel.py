"""Tensor parallelism inside a replica: which part of the model a rank holds, and the
collectives that join the parts.

Megatron-style sharding over `size` ranks (rank 0 of 1 holds the whole model):

- attention: the fused QKV projection is column-parallel by KV-head group (a rank holds
  its KV heads and the query heads that attend with them); `o_proj` is row-parallel, so
  each rank's partial output is summed by one all-reduce;
- MLP: gate/up column-parallel, down row-parallel, one all-reduce;
- embedding and LM head are vocab-parallel: each rank owns `ceil(vocab / size)` rows
  (the last shard padded with zero rows); the embedding lookup is summed by an all-reduce,
  the LM head's logits are all-gathered and trimmed to the vocabulary.

Heads need not divide evenly: KV heads are split as evenly as possible (the first ranks
take one more), so the built-in `small` (3 KV heads) runs on 2 ranks. Every rank's KV
cache shard has room for `ceil(num_kv_heads / size)` heads so that all shards have one
shape; a rank with fewer heads leaves its last head slot unused.

The replica-wide KV cache is one buffer of `num_layers * size` *items*, item
`layer * size + rank` holding that rank's K and V of that layer (`tp_kv_spec`): to the KV
transfer it is an ordinary cache with more, narrower layers, so rank i's shard of a
prefill replica lands in rank i's shard of a decode replica of the same TP size.

Row-parallel biases are held by rank 0 only (zeros elsewhere), so the all-reduce adds
them once. Every collective runs under the group's timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.config import ModelConfig

COLLECTIVE_TIMEOUT_S = 60.0  # any collective (and the group's rendezvous) fails after this
# A gloo or NCCL backend object (`allreduce`, `allgather`); torch has no public common type.
Group = Any


def split(total: int, rank: int, size: int) -> range:
    """Rank `rank`'s contiguous share of `total` items; the first `total % size` ranks
    take one more."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise ValueError with the reason when `config` cannot run on `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if config.num_key_value_heads < size:
        raise ValueError(
            f"tensor_parallel_size {size} exceeds the model's {config.num_key_value_heads} "
            "KV heads: every rank needs at least one KV head"
        )
    if config.intermediate_size < size:
        raise ValueError(
            f"tensor_parallel_size {size} exceeds the MLP width {config.intermediate_size}"
        )


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`: the sizes of its part of a model of shape `config`."""

    config: ModelConfig
    rank: int = 0
    size: int = 1

    @property
    def kv_heads(self) -> range:
        return split(self.config.num_key_value_heads, self.rank, self.size)

    @property
    def q_heads(self) -> range:
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        kv = self.kv_heads
        return range(kv.start * group, kv.stop * group)

    @property
    def num_kv_head_slots(self) -> int:
        """KV heads every rank's cache shard has room for (the largest rank's count)."""
        return -(-self.config.num_key_value_heads // self.size)

    @property
    def mlp_columns(self) -> range:
        return split(self.config.intermediate_size, self.rank, self.size)

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and LM head on every rank (padded)."""
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows


class TensorParallel:
    """The collectives of one rank; with `size == 1` (no group) they are identities."""

    def __init__(self, shard: Shard, group: Group | None = None) -> None:
        if (group is None) != (shard.size == 1):
            raise ValueError("a process group is needed exactly when size > 1")
        self.shard = shard
        self.group = group

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns `x`."""
        if self.group is not None:
            self.group.allreduce([x]).wait(timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """`[rows, n]` on every rank -> `[rows, n * size]`, rank 0's columns first."""
        if self.group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait(timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return torch.cat(parts, dim=-1)


def single(config: ModelConfig) -> TensorParallel:
    """The whole model on one rank."""
    return TensorParallel(Shard(config))


def create_group(
    backend: str, store_port: int, rank: int, size: int, device: torch.device
) -> Group:
    """Join the group whose TCPStore rank 0 serves on 127.0.0.1:`store_port` (one host)."""
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", store_port, size, False, timeout=timeout)
    return new_group(backend, store, rank, size, device)


def new_group(backend: str, store: dist.Store, rank: int, size: int, device: torch.device) -> Group:
    """A process group over `store`, not registered as torch's default group (so several
    engines can live in one process)."""
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(store, rank, size, options)
    if backend == "nccl":  # pragma: no cover - needs CUDA
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, nccl_options)
    raise ValueError(f"unknown process group backend {backend!r}")


def shard_state_dict(state: Mapping[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors cut down to `shard` (same names, smaller shapes)."""
    if shard.size == 1:
        return dict(state)
    head_dim = shard.config.head_dim
    q, kv, cols = shard.q_heads, shard.kv_heads, shard.mlp_columns

    def rows(t: torch.Tensor, r: range, unit: int = 1) -> torch.Tensor:
        return t[r.start * unit : r.stop * unit]

    def vocab(t: torch.Tensor) -> torch.Tensor:
        part = t[shard.vocab_start : shard.vocab_start + shard.vocab_rows]
        padded = t.new_zeros((shard.vocab_rows, *t.shape[1:]))
        padded[: part.shape[0]] = part
        return padded

    def kv_scale(t: torch.Tensor) -> torch.Tensor:  # one per KV head, or one for all
        flat = t.reshape(-1)
        return flat[kv.start : kv.stop] if flat.numel() == shard.config.num_key_value_heads else t

    # name suffix -> this rank's part (FP8 checkpoints' per-output-channel `weight_scale`
    # follows its weight's rows; row-parallel layers' scales cover the replicated output)
    cut = {
        "self_attn.q_proj": lambda t: rows(t, q, head_dim),
        "self_attn.k_proj": lambda t: rows(t, kv, head_dim),
        "self_attn.v_proj": lambda t: rows(t, kv, head_dim),
        "mlp.gate_proj": lambda t: rows(t, cols),
        "mlp.up_proj": lambda t: rows(t, cols),
    }
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module, _, kind = name.rpartition(".")
        owner = module.split(".", 3)[-1]  # e.g. "self_attn.q_proj" of model.layers.N.
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = vocab(t)
        elif owner in cut and kind in ("weight", "bias", "weight_scale"):
            out[name] = cut[owner](t)
        elif owner == "self_attn.o_proj" and kind == "weight":
            out[name] = t[:, q.start * head_dim : q.stop * head_dim]
        elif owner == "mlp.down_proj" and kind == "weight":
            out[name] = t[:, cols.start : cols.stop]
        elif owner in ("self_attn.o_proj", "mlp.down_proj") and kind == "bias":
            out[name] = t if shard.rank == 0 else torch.zeros_like(t)
        elif name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
            out[name] = kv_scale(t)
        else:  # norms, row-parallel weight scales: replicated
            out[name] = t
    return out
