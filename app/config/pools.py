"""Pool sections of the configuration: a pool and its autoscaling, and the check that the
prefill pools' context ranges cover every remotely prefilled prompt length.

`app/config/root.py` assembles them into `PDServeConfig` and calls
`check_prefill_coverage`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field, PositiveFloat, field_validator, model_validator

from app.config.base import NAME_PATTERN, _Strict
from app.config.model import EngineOverrides, ModelSettings

_RESERVED_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class AutoscalingSettings(_Strict):
    """Serve autoscaling of one pool (replaces a fixed `num_replicas`).

    `policy: slo` (default) scales the pool on its own signal (`app/serve/autoscaling.py`):
    prefill on predicted queue wait against `ttft_slo_ms`, decode on KV occupancy and ITL
    against `tpot_slo_ms`. `policy: ongoing_requests` is Serve's built-in policy.
    """

    min_replicas: int = Field(default=1, ge=1, description="Replicas kept at all times.")
    max_replicas: int = Field(default=1, ge=1, description="Most replicas scaled up to.")
    policy: Literal["slo", "ongoing_requests"] = Field(
        default="slo",
        description="slo: the pool's own signal (prefill: queue wait vs TTFT SLO; decode: KV "
        "occupancy and ITL vs TPOT SLO). ongoing_requests: Serve's built-in policy.",
    )
    target_ongoing_requests: float = Field(
        default=8.0,
        gt=0,
        description="Ongoing requests per replica Serve aims for (policy ongoing_requests).",
    )
    ttft_slo_ms: float = Field(
        default=1000.0, gt=0, description="Prefill: the TTFT SLO the pool is sized for, ms."
    )
    queue_wait_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Prefill: predicted queue wait may use this fraction of ttft_slo_ms.",
    )
    prefill_tokens_per_s: float = Field(
        default=1000.0,
        gt=0,
        description="Prefill: tokens/s one replica is assumed to prefill until it has measured "
        "its own rate.",
    )
    tpot_slo_ms: float = Field(
        default=100.0, gt=0, description="Decode: the TPOT/ITL SLO the pool is sized for, ms."
    )
    target_kv_usage: float = Field(
        default=0.7,
        gt=0,
        le=1,
        description="Decode: fraction of KV blocks in use the pool aims for.",
    )
    target_running_seqs: float | None = Field(
        default=None,
        gt=0,
        description="Decode: running sequences per replica the pool aims for; None = ignore.",
    )
    downscale_utilization: float = Field(
        default=0.6,
        gt=0,
        lt=1,
        description="Hysteresis: remove a replica only when the others would be loaded at most "
        "this fraction of target; a latency (TTFT, ITL) over its SLO counts only while the "
        "load is above this fraction of target per replica.",
    )
    upscale_cooldown_s: float = Field(
        default=10.0, ge=0, description="Seconds after a scale-up before scaling up again."
    )
    downscale_cooldown_s: float = Field(
        default=30.0,
        ge=0,
        description="Seconds after any scaling before scaling down (one replica at a time).",
    )
    upscale_delay_s: float = Field(
        default=2.0, ge=0, description="Serve: a scale-up decision must hold this long."
    )
    downscale_delay_s: float = Field(
        default=10.0, ge=0, description="Serve: a scale-down decision must hold this long."
    )
    look_back_period_s: float = Field(
        default=10.0, gt=0, description="Serve: window the replicas' signals are averaged over."
    )
    metrics_interval_s: float = Field(
        default=2.0,
        gt=0,
        description="Serve: seconds between a replica's signal reports to the controller.",
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s}) must exceed "
                f"metrics_interval_s ({self.metrics_interval_s}): each window needs a report"
            )
        return self

    def policy_knobs(self) -> dict[str, float | None]:
        """The knobs the SLO policies read (`app/serve/autoscaling.py` `PolicyKnobs` fields)."""
        return self.model_dump(
            exclude={
                "min_replicas",
                "max_replicas",
                "policy",
                "target_ongoing_requests",
                "upscale_delay_s",
                "downscale_delay_s",
                "look_back_period_s",
                "metrics_interval_s",
            }
        )


class PoolConfig(_Strict):
    """One Serve deployment of prefill or decode replicas.

    Replica count: give `num_replicas` or `autoscaling`, not both; with neither, the pool
    has one fixed replica. After validation exactly one of the two is set.
    """

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Unique pool name: a letter, then letters, digits, _ or -.",
    )
    role: Literal["prefill", "decode"] = Field(description="What the pool's replicas run.")
    num_replicas: int | None = Field(
        default=None, ge=1, description="Fixed replica count (default 1)."
    )
    autoscaling: AutoscalingSettings | None = Field(
        default=None, description="Autoscale instead of num_replicas."
    )
    num_cpus: float = Field(default=1.0, gt=0, description="CPUs reserved per replica.")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs reserved per replica.")
    resources: dict[str, PositiveFloat] = Field(
        default_factory=dict, description='Custom Ray resources per replica: {"h200_prefill": 1}.'
    )
    min_context_tokens: int | None = Field(
        default=None, ge=1, description="Prefill only: shortest prompt served (default 1)."
    )
    max_context_tokens: int | None = Field(
        default=None, ge=1, description="Prefill only: longest prompt served (default unbounded)."
    )
    max_ongoing_requests: int = Field(
        default=64,
        ge=1,
        description="Requests Serve sends one replica at once (Serve's own limit).",
    )
    max_queued_requests: int = Field(
        default=256,
        ge=1,
        description="Requests a caller's handle queues for this pool before refusing more "
        "(Serve's own limit, the last guard against overload: the ingress answers 503 "
        "overloaded; a decode replica prefills locally).",
    )
    engine: EngineOverrides = Field(
        default_factory=EngineOverrides,
        description="Engine sizes of this pool's replicas where they differ from `model`.",
    )
    fallback: bool = Field(
        default=False,
        description="Decode only: the fallback pool, which serves requests of `degradable` "
        "SLO classes when the primary pools are overloaded (never chosen otherwise). It runs "
        "its own `model` and prefills every prompt itself (no KV from the prefill pools).",
    )
    serves_decode: bool = Field(
        default=False,
        description="Prefill only: the pool's replicas also serve whole requests (prompt "
        "prefilled and decoded on the replica, no KV transfer) while the decode pool is busier "
        "by `adaptive_prefill.decode_overflow_gap` sequences (decode overflow), so the decode "
        "capacity of the prefill replicas is not lost on decode-bound load. Needs "
        "`adaptive_prefill.enabled`.",
    )
    model: ModelSettings | None = Field(
        default=None,
        description="Fallback pools only (and required there): the pool's own model and "
        "engine settings, in place of the top-level `model`.",
    )
    cpu_affinity: list[int] | None = Field(
        default=None,
        min_length=1,
        description="Core ids this pool's replicas run on (os.sched_setaffinity of the replica "
        "process and its torch threads, applied as the replica starts); the pool's replicas "
        "share them. None = wherever the OS schedules them.",
    )
    drain_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="A stopping replica (scale-down, redeploy) finishes its requests for at "
        "most this long before Serve stops it (Serve's graceful_shutdown_timeout_s).",
    )
    drain_poll_s: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between a draining replica's checks for unfinished requests "
        "(Serve's graceful_shutdown_wait_loop_s).",
    )

    @field_validator("cpu_affinity")
    @classmethod
    def _check_cpu_affinity(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        num_cores = os.cpu_count() or 1
        unknown = sorted({core for core in value if not 0 <= core < num_cores})
        if unknown:
            raise ValueError(
                f"cpu_affinity {value}: core ids {unknown} do not exist on this host "
                f"(its cores are 0-{num_cores - 1})"
            )
        if len(set(value)) != len(value):
            raise ValueError(f"cpu_affinity {value} names a core more than once")
        return value

    @field_validator("resources")
    @classmethod
    def _check_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for key in _RESERVED_RESOURCES.intersection(value):
            raise ValueError(f"resource {key!r} is set by num_cpus/num_gpus, not resources")
        return value

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError(f"pool {self.name!r}: set num_replicas or autoscaling, not both")
        if self.num_replicas is None and self.autoscaling is None:
            self.num_replicas = 1
        has_range = self.min_context_tokens is not None or self.max_context_tokens is not None
        if self.role == "decode" and has_range:
            raise ValueError(
                f"decode pool {self.name!r}: min_context_tokens/max_context_tokens apply to "
                "prefill pools only"
            )
        if self.serves_decode and self.role != "prefill":
            raise ValueError(
                f"pool {self.name!r}: serves_decode applies to prefill pools only (a decode "
                "pool serves whole requests anyway)"
            )
        if self.fallback and (self.role != "decode" or self.model is None):
            raise ValueError(
                f"fallback pool {self.name!r} must have role 'decode' and its own `model` "
                "(it prefills locally with that model)"
            )
        if self.model is not None and not self.fallback:
            raise ValueError(
                f"pool {self.name!r}: only a fallback pool (fallback: true) has its own "
                "`model`; other pools share the top-level `model` so their KV layouts agree"
            )
        if self.context_range[0] > self.context_range[1]:
            raise ValueError(
                f"pool {self.name!r}: min_context_tokens ({self.min_context_tokens}) > "
                f"max_context_tokens ({self.max_context_tokens})"
            )
        return self

    @property
    def context_range(self) -> tuple[int | float, int | float]:
        """Inclusive prompt-length range this prefill pool serves (upper bound may be inf)."""
        low = self.min_context_tokens if self.min_context_tokens is not None else 1
        high = self.max_context_tokens if self.max_context_tokens is not None else math.inf
        return low, high

    @property
    def max_num_replicas(self) -> int:
        """The most replicas the pool can have (fixed count, or autoscaling maximum)."""
        if self.autoscaling is not None:
            return self.autoscaling.max_replicas
        assert self.num_replicas is not None
        return self.num_replicas

    def serve_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options(...)` of this pool's deployment."""
        actor = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        options: dict[str, Any] = {
            "name": self.name,
            "ray_actor_options": {**actor, "resources": dict(self.resources)},
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "graceful_shutdown_timeout_s": self.drain_timeout_s,
            "graceful_shutdown_wait_loop_s": self.drain_poll_s,
        }
        if self.autoscaling is not None:
            return {**options, "autoscaling_config": self._autoscaling_config(self.autoscaling)}
        return {**options, "num_replicas": self.num_replicas}

    def _autoscaling_config(self, settings: AutoscalingSettings) -> dict[str, Any]:
        """Serve's `autoscaling_config` dict; the SLO policies: `app/serve/autoscaling.py`."""
        config: dict[str, Any] = settings.model_dump(
            include={
                "min_replicas",
                "max_replicas",
                "target_ongoing_requests",
                "upscale_delay_s",
                "downscale_delay_s",
                "look_back_period_s",
                "metrics_interval_s",
            }
        )
        if settings.policy == "slo":
            policy = "PrefillPolicy" if self.role == "prefill" else "DecodePolicy"
            config["policy"] = {
                "policy_function": f"app.serve.autoscaling:{policy}",
                "policy_kwargs": settings.policy_knobs(),
            }
        return config


def check_prefill_coverage(
    prefill: list[PoolConfig],
    needed: tuple[int, int] | None,
    threshold: int,
    max_prompt_tokens: int,
) -> None:
    """The prefill pools' context ranges cover every remotely prefilled length (`needed`:
    `threshold..max_prompt_tokens`, None when every prompt is prefilled locally), and
    each pool serves some of them; else a `ValueError` naming the gap or the pool."""
    if needed is None:
        if prefill:
            raise ValueError(
                f"local_prefill_threshold ({threshold}) > limits.max_prompt_tokens "
                f"({max_prompt_tokens}) prefills every prompt locally, so prefill pool(s) "
                f"{', '.join(p.name for p in prefill)} would never be used"
            )
        return
    if not prefill:
        raise ValueError(
            f"no prefill pool, but prompts of {needed[0]}..{needed[1]} tokens need remote "
            "prefill; add a prefill pool, or set local_prefill_threshold above "
            "limits.max_prompt_tokens for colocated serving"
        )
    low, high = needed
    for pool in prefill:
        pool_low, pool_high = pool.context_range
        if pool_high < low or pool_low > high:
            raise ValueError(
                f"prefill pool {pool.name!r} serves lengths {_fmt_range(pool_low, pool_high)}"
                f", which no remotely prefilled prompt ({low}..{high}) can have"
            )
    gaps = _uncovered(low, high, [pool.context_range for pool in prefill])
    if gaps:
        raise ValueError(
            "prefill pools' context ranges leave prompt lengths "
            f"{', '.join(_fmt_range(a, b) for a, b in gaps)} uncovered (remote prefill "
            f"covers {low}..{high}: local_prefill_threshold..limits.max_prompt_tokens)"
        )


def _fmt_range(low: int | float, high: int | float) -> str:
    return f"{low}.." + ("inf" if high == math.inf else f"{high}")


def _uncovered(
    low: int, high: int, ranges: list[tuple[int | float, int | float]]
) -> list[tuple[int, int]]:
    """Maximal integer intervals of `low..high` inside none of the inclusive `ranges`."""
    clipped = sorted(
        (max(int(start), low), high if end == math.inf else min(int(end), high))
        for start, end in ranges
    )
    gaps: list[tuple[int, int]] = []
    first_uncovered = low
    for start, end in clipped:
        if start > first_uncovered:
            gaps.append((first_uncovered, start - 1))
        first_uncovered = max(first_uncovered, end + 1)
    if first_uncovered <= high:
        gaps.append((first_uncovered, high))
    return gaps
