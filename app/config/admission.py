"""The `admission` and `ingress` sections: SLO classes (a tenant's `default_class` names
one; `check_tenant_classes` checks that it exists) and how many ingress replicas share the
tenants' quotas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pydantic import Field, model_validator

from app.config.base import NAME_PATTERN, _Strict


class SLOClass(_Strict):
    """A service class: its latency targets and its priority at every queue."""

    name: str = Field(pattern=NAME_PATTERN, description="Unique class name (e.g. interactive).")
    ttft_s: float = Field(gt=0, allow_inf_nan=False, description="Time-to-first-token target.")
    tpot_s: float = Field(gt=0, allow_inf_nan=False, description="Time-per-output-token target.")
    priority: int = Field(
        description="Priority at the ingress queue, the prefill queue, decode admission and "
        "preemption; lower = more important (preempted last)."
    )
    degradable: bool = Field(
        default=False,
        description="Requests of this class that the primary pools would refuse as overloaded "
        "(shed, or a decode pool's queue full) are served by the fallback pool's model "
        "instead (response header x-pdserve-fallback); needs a pool with fallback: true.",
    )


class AdmissionSettings(_Strict):
    """SLO classes and how ingress replicas share the global quota state."""

    classes: list[SLOClass] = Field(
        default_factory=list,
        description="Named SLO classes; a request may ask for a class no more important than "
        "its tenant's default_class (header x-pdserve-slo-class or body pdserve.slo_class).",
    )
    lease_fraction: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="Share of a bucket's capacity an ingress replica takes per remote call "
        "(at least what the request needs); unused tokens go back after lease_ttl_s.",
    )
    lease_ttl_s: float = Field(
        default=2.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds an ingress replica keeps an idle lease before returning it.",
    )
    queue_timeout_s: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest wait for a concurrency slot in a tenant's queue, then 429.",
    )
    quota_call_timeout_s: float = Field(
        default=5.0,
        gt=0,
        allow_inf_nan=False,
        description="Bound on one call to the quota service; past it the request gets 503.",
    )

    @model_validator(mode="after")
    def _check(self) -> AdmissionSettings:
        names = [c.name for c in self.classes]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"admission.classes names must be unique; repeated: {repeated}")
        return self

    def slo_class(self, name: str) -> SLOClass | None:
        """The class called `name`, if configured."""
        return next((c for c in self.classes if c.name == name), None)


class IngressSettings(_Strict):
    """The HTTP ingress deployment (quotas hold across all its replicas)."""

    num_replicas: int = Field(default=1, ge=1, description="Ingress replicas behind the proxy.")
    num_cpus: float = Field(default=0.1, gt=0, description="CPUs reserved per ingress replica.")


class _TenantLike(Protocol):
    name: str
    default_class: str | None


def check_tenant_classes(admission: AdmissionSettings, tenants: Sequence[_TenantLike]) -> None:
    """Every tenant's `default_class` names a configured class (ValueError otherwise)."""
    known = [c.name for c in admission.classes]
    for tenant in tenants:
        if tenant.default_class is not None and tenant.default_class not in known:
            raise ValueError(
                f"tenant {tenant.name!r}: default_class {tenant.default_class!r} is not in "
                f"admission.classes ({', '.join(known) or 'none configured'})"
            )
