"""Config of overload protection: load shedding, request deadlines, circuit breakers.

The `overload` section of `PDServeConfig`. Shedding predicts a request's TTFT from its
prefill pool's queued tokens and measured rate (`app/admission/shedding.py`); deadlines
bound every request (`app/admission/deadlines.py`); breakers stop a decode replica sending
remote prefills to a failing prefill replica or pool (`decode/breaker.py`).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from app.config.base import _Strict
from decode.breaker import BreakerSettings


class SheddingSettings(_Strict):
    """When the ingress refuses a request early (503 `overloaded`, with Retry-After)."""

    enabled: bool = Field(default=True, description="Predict TTFT and shed hopeless requests.")
    factor: float = Field(
        default=2.0,
        gt=0,
        allow_inf_nan=False,
        description="Shed when the predicted TTFT exceeds factor x the class's TTFT SLO "
        "(for the most important priority present; see priority_step).",
    )
    priority_step: float = Field(
        default=0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Each priority level less important than the most important class "
        "multiplies the factor by (1 - priority_step): batch is shed first. 0 = same factor.",
    )
    min_factor: float = Field(
        default=0.25,
        gt=0,
        allow_inf_nan=False,
        description="Lower bound of the scaled factor.",
    )
    default_ttft_s: float = Field(
        default=5.0,
        gt=0,
        allow_inf_nan=False,
        description="TTFT SLO of requests without an SLO class.",
    )
    refresh_s: float = Field(
        default=0.5,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between the ingress's calls to a prefill pool it does not yet "
        "see the load of (after that Serve pushes the load as it changes).",
    )
    max_age_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="Pool load older than this is ignored (nothing is shed on stale data).",
    )
    max_retry_after_s: float = Field(
        default=30.0,
        ge=1,
        allow_inf_nan=False,
        description="Cap of the Retry-After a shed request gets (the predicted drain time).",
    )

    @model_validator(mode="after")
    def _check(self) -> SheddingSettings:
        if self.min_factor > self.factor:
            raise ValueError(
                f"overload.shedding.min_factor ({self.min_factor}) must be <= factor "
                f"({self.factor})"
            )
        return self


class BreakerConfig(_Strict):
    """Circuit breakers of remote prefill, per prefill pool and per prefill replica."""

    failure_threshold: int = Field(
        default=3, ge=1, description="Consecutive failures or timeouts that open a breaker."
    )
    cooldown_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a breaker stays open before one probe request is let through.",
    )

    def to_settings(self) -> BreakerSettings:
        """The frozen settings decode replicas build their breakers from."""
        return BreakerSettings(self.failure_threshold, self.cooldown_s)


class OverloadSettings(_Strict):
    """Load shedding, request deadlines and circuit breakers."""

    shedding: SheddingSettings = Field(
        default_factory=SheddingSettings, description="Early rejection on predicted TTFT."
    )
    breaker: BreakerConfig = Field(
        default_factory=BreakerConfig, description="Circuit breakers of remote prefill."
    )
    default_timeout_s: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="Deadline of a request that names none (body `timeout`, header "
        "x-pdserve-timeout) and whose SLO class sets none; past it: 504 deadline_exceeded.",
    )
    class_timeouts_s: dict[str, float] = Field(
        default_factory=dict,
        description="Default deadline per SLO class name, seconds (overrides default_timeout_s).",
    )
    max_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest deadline a request may ask for (400 above it).",
    )

    @model_validator(mode="after")
    def _check(self) -> OverloadSettings:
        bad = {name: s for name, s in self.class_timeouts_s.items() if not 0 < s < float("inf")}
        if bad:
            raise ValueError(f"overload.class_timeouts_s must be positive and finite: {bad}")
        longest = max([self.default_timeout_s, *self.class_timeouts_s.values()])
        if longest > self.max_timeout_s:
            raise ValueError(
                f"default deadlines ({longest} s) must be <= overload.max_timeout_s "
                f"({self.max_timeout_s} s)"
            )
        return self
