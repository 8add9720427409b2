"""The `transfer` section: how KV blocks move between the pools."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator

from app.config.base import _Strict


class TransferSettings(_Strict):
    """How KV blocks move from prefill to decode replicas."""

    backend: Literal["shm", "tcp", "nccl", "cuda_ipc"] = Field(
        default="shm",
        description="shm: same host; tcp: across hosts; nccl: GPU (the default between "
        "GPUs); cuda_ipc: GPUs of one node, written through CUDA IPC (one GPU shared by "
        "prefill and decode, or GPUs with peer access that both processes see).",
    )
    bind_host: str = Field(
        default="0.0.0.0",
        description="tcp/nccl: the IP address decode replicas listen on for KV (0.0.0.0: all).",
    )
    advertise_host: str | None = Field(
        default=None,
        min_length=1,
        description="tcp/nccl: the address prefill replicas reach a decode replica at; "
        "default: bind_host, or the node's IP from Ray when bind_host is a wildcard.",
    )
    source_host: str | None = Field(
        default=None,
        description="tcp: the local IP address prefill replicas' KV connections leave from "
        "(default: the system's choice).",
    )
    deadline_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a decode replica waits for a request's KV before failing it.",
    )
    checksum: bool = Field(default=False, description="Checksum blocks to detect corruption.")
    per_rank: bool | None = Field(
        default=None,
        description="Tensor-parallel replicas: every rank moves its own KV shard, rank i of a "
        "prefill replica to rank i of a decode replica (one endpoint per rank; prefill and "
        "decode pools of the same tensor_parallel_size). Default (null): on for cuda, where "
        "each rank's shard lives on its own GPU; off for cpu, where rank 0's one endpoint "
        "reaches every rank's shard in shared memory and re-shards KV heads between pools "
        "of different sizes.",
    )

    @field_validator("bind_host", "source_host")
    @classmethod
    def _ip_address(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise ValueError(f"{value!r} is not an IP address") from None
        return value

    @field_validator("advertise_host")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        if value in ("0.0.0.0", "::"):
            raise ValueError("advertise_host must be an address peers can connect to")
        return value
