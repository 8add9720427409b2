"""Config sections of admission control: tenant quotas, SLO classes, ingress replicas,
adaptive disaggregation.

`TenantQuota` is a tenant's `quota` (every limit optional: None = unlimited). `SLOClass`es are
listed in `admission.classes`; a tenant's `default_class` names one. `IngressSettings` is the
`ingress` section (how many ingress replicas share the quotas). `AdaptivePrefillSettings` is
`adaptive_prefill` (where a prompt is prefilled, and when a prefill pool serves a whole
request). Cross-section checks (a tenant's class exists) run in `check_tenant_classes`,
called by `PDServeConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,62}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantQuota(_Strict):
    """A tenant's limits, held globally (every ingress replica draws on the same ones).

    Exceeding one gives 429 with a `code` naming it and a Retry-After from the bucket's
    refill time. Rates are token buckets: `requests_per_second` refills at that rate up to
    `request_burst`; the per-minute token limits refill at value/60 per second up to one
    minute's worth.
    """

    max_concurrent_sequences: int | None = Field(
        default=None,
        ge=1,
        description="Sequences in flight at once; a request with n choices counts n "
        "(code tenant_concurrent_sequences).",
    )
    requests_per_second: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Sustained request rate (code tenant_rate_limit).",
    )
    request_burst: int | None = Field(
        default=None,
        ge=1,
        description="Requests admitted at once above the rate; default ceil(requests_per_second).",
    )
    prompt_tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Prompt tokens admitted per minute, charged at admission "
        "(code tenant_prompt_tokens_per_minute).",
    )
    output_tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Output tokens per minute, charged as they are produced; a tenant in debt "
        "is refused until the bucket refills (code tenant_output_tokens_per_minute).",
    )
    kv_block_share: float | None = Field(
        default=None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Share of each decode pool's KV blocks the tenant's requests may hold, "
        "counted at admission as n x blocks of (prompt + max_tokens), the most a request can "
        "fill (code tenant_kv_share).",
    )
    max_queued_requests: int = Field(
        default=0,
        ge=0,
        description="Requests that may wait for a concurrency slot (higher class first); "
        "0 = refuse at once. Past it: code tenant_queue_full.",
    )

    @model_validator(mode="after")
    def _check(self) -> TenantQuota:
        if self.request_burst is not None and self.requests_per_second is None:
            raise ValueError("quota.request_burst needs quota.requests_per_second")
        return self

    @property
    def burst(self) -> int | None:
        """Capacity of the request bucket (None without a request rate)."""
        if self.requests_per_second is None:
            return None
        return self.request_burst or max(1, math.ceil(self.requests_per_second))


class SLOClass(_Strict):
    """A service class: its latency targets and its priority at every queue."""

    name: str = Field(pattern=_NAME_PATTERN, description="Unique class name (e.g. interactive).")
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


class AdaptivePrefillSettings(_Strict):
    """Adaptive disaggregation (`app/routing/adaptive.py`): a prompt the static rule sends
    to a prefill pool is prefilled on its decode replica instead while that is cheaper."""

    enabled: bool = Field(
        default=True,
        description="Compare the prefill pool's predicted wait with the cost of prefilling on "
        "the decode replica, per request at or above local_prefill_threshold; off = the "
        "static threshold alone decides.",
    )
    margin: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="Hysteresis: go local when the predicted remote wait exceeds the local "
        "cost x (1 + margin), back to remote once it is no longer than the local cost; in "
        "between a (prefill pool, decode pool) pair keeps its last choice.",
    )
    min_gain_s: float = Field(
        default=0.1,
        ge=0,
        allow_inf_nan=False,
        description="Go local only when that is predicted to save at least this many seconds "
        "of TTFT (no local prefill, which stalls decoding, for a saving within the noise).",
    )
    local_cost_factor: float = Field(
        default=1.0,
        ge=0,
        allow_inf_nan=False,
        description="A local prefill's compute time is charged this many times more when the "
        "decode replica has running sequences (they stall while the prompt is computed); "
        "0 = count only the new request's wait.",
    )
    max_local_prompt_tokens: int = Field(
        default=2048,
        ge=1,
        description="Longer prompts always go to their prefill pool (too long a stall for "
        "the decode replica's running sequences).",
    )
    max_age_s: float = Field(
        default=5.0,
        gt=0,
        allow_inf_nan=False,
        description="Pool load older than this counts as missing: the static rule decides.",
    )
    probe_interval_s: float = Field(
        default=10.0,
        ge=0,
        allow_inf_nan=False,
        description="While prompts go local although a prefill replica is idle, send one "
        "prompt per this many seconds to the prefill pool anyway, so that its prefill rate is "
        "measured again (a rate measured on a stalled or cold replica would otherwise keep "
        "every prompt local for good); 0 = never probe.",
    )
    borrow_prefill_rate: bool = Field(
        default=False,
        description="Until a decode replica has measured its own prefill rate (from prompts "
        "it prefilled itself), assume the prefill pool's measured rate (both run the same "
        "model); off = the static rule decides until it has.",
    )
    decode_overflow_gap: float = Field(
        default=2,
        ge=0,
        allow_inf_nan=False,
        description="Prefill pools with `serves_decode` take a whole request (its prompt "
        "prefilled and decoded there, no KV transfer) while the decode pool's least loaded "
        "replica's decode load, (sequences + 1) / (1 - prompt_busy), is above theirs by at "
        "least this much (`app/routing/overflow.py`). 0 joins the shorter queue, ties "
        "staying on decode (CPU replicas, where a decode step's cost grows with its batch and "
        "two replicas serve best evenly loaded); a larger gap keeps prompts isolated until "
        "decode is that far ahead (GPUs, where a bigger batch costs little until memory or "
        "the batch limit binds).",
    )
    decode_overflow_max_prompt_busy: float = Field(
        default=0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="A prefill replica takes whole requests only while it spent at most this "
        "share of the last 30 s computing prompts (`prompt_busy`): a stream there stalls "
        "while each prompt is computed (over half the time: its TPOT more than doubles), so "
        "a pool busy with prompts (the prefill-bound case, where disaggregation pays) keeps "
        "to them.",
    )
    serve_whole_max_output_tokens: int = Field(
        default=0,
        ge=0,
        description="A request asking for at most this many new tokens (max_tokens) is "
        "placed as two colocated replicas would place it: whole, no KV hand-off, on the "
        "decode pool (prefilled there) or on a prefill pool with `serves_decode`, whichever "
        "has fewer prompt tokens to compute, then fewer requests in flight, per replica "
        "(ties take turns). For a few tokens "
        "the hand-off buys nothing, and the decode replica would otherwise decode every "
        "such request while the prefill replica only computes prompts "
        "(`app/routing/overflow.py`). 0 = off.",
    )
    decode_overflow_max_prompt_tokens: int = Field(
        default=256,
        ge=0,
        description="A prefill replica takes no whole request while more than this many "
        "prompt tokens compute there (sent by this ingress and not yet answered, or reported "
        "queued): the new stream would wait for them and then stall at each of their chunks. "
        "The default lets a few chat turns share the replica and keeps whole requests off it "
        "while a long document is prefilled (`app/routing/overflow.py`).",
    )
