"""What a `pdserve bench overload` run sends, and to which app (pure, no I/O).

- `without_quotas(args)` / `admission_off(args)`: the app args of the `no-quotas` and `off`
  modes, and a line per change (the JSON's `admission_off_changes`);
- `class_plans(args, options)`: per SLO class, the tenant that sends it (the first whose
  `default_class` it is), its API key, prompt and output lengths and SLO;
- `class_rates` and `arrivals`: the offered rate split between the classes, and the
  seeded Poisson arrivals of every class, merged in time order.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.overload.report import ClassSLO
from bench.serve.workloads import make_prompt

OFF_MAX_QUEUED_REQUESTS = 1_000_000  # "unbounded" for Serve's per-pool queue


def without_quotas(args: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The app args without tenant limits (keys and allowed pools kept: no
    `max_concurrent_requests`, no `quota`), and what was changed. Shedding, priorities and
    the pools' Serve queues stay as configured."""
    out = copy.deepcopy(dict(args))
    changes: list[str] = []
    tenants = []
    for tenant in out.get("tenants") or []:
        tenant = dict(tenant)
        dropped = [k for k in ("max_concurrent_requests", "quota") if tenant.pop(k, None)]
        if dropped:
            changes.append(f"tenant {tenant['name']}: no {' or '.join(dropped)}")
        tenants.append(tenant)
    out["tenants"] = tenants
    return out, changes


def admission_off(args: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The app args with every admission feature disabled, and what was changed.

    Tenants lose their limits (`without_quotas`); `overload.shedding.enabled` is false;
    every class and tenant gets the most important priority present (first come, first
    served at every queue; the classes keep their SLOs, which only label requests then);
    each pool's Serve queue is unbounded.
    """
    off, changes = without_quotas(args)
    admission = dict(off.get("admission") or {})
    classes = [dict(c) for c in admission.get("classes") or []]
    top = min((int(c["priority"]) for c in classes), default=0)
    if any(c["priority"] != top for c in classes):
        changes.insert(0, f"every SLO class at priority {top}")
    admission["classes"] = [{**c, "priority": top} for c in classes]
    off["admission"] = admission
    off["tenants"] = [{**t, "priority": top} if "priority" in t else t for t in off["tenants"]]
    overload = dict(off.get("overload") or {})
    overload["shedding"] = {**(overload.get("shedding") or {}), "enabled": False}
    off["overload"] = overload
    changes.append("overload.shedding.enabled: false")
    off["pools"] = [
        {**pool, "max_queued_requests": OFF_MAX_QUEUED_REQUESTS} for pool in off.get("pools", [])
    ]
    changes.append(f"pools' max_queued_requests: {OFF_MAX_QUEUED_REQUESTS}")
    return off, changes


@dataclass(frozen=True, slots=True)
class ClassPlan:
    """What one class sends: its tenant's key, prompt and output length, its SLO."""

    name: str
    tenant: str
    api_key: str
    prompt_tokens: int
    max_tokens: int
    slo: ClassSLO


def class_plans(args: Mapping[str, Any], options: argparse.Namespace) -> list[ClassPlan]:
    """One `ClassPlan` per class of `--classes`, from the config's classes and tenants."""
    from app.config import ConfigError, load_config

    config = load_config(dict(args))
    plans = []
    for name in options.classes:
        slo_class = config.admission.slo_class(name)
        tenant = next((t for t in config.tenants if t.default_class == name), None)
        if slo_class is None or tenant is None:
            raise ConfigError(f"--classes: {name!r} needs a class and a tenant defaulting to it")
        keys = sorted(tenant.resolve_api_keys())
        if not keys:
            raise ConfigError(f"tenant {tenant.name!r} has no API key to send {name!r} with")
        plans.append(
            ClassPlan(
                name,
                tenant.name,
                keys[0],
                getattr(options, f"{name}_prompt_tokens", options.prompt_tokens),
                getattr(options, f"{name}_max_tokens", options.max_tokens),
                ClassSLO(slo_class.ttft_s, slo_class.tpot_s),
            )
        )
    return plans


def class_rates(plans: Sequence[ClassPlan], total: float, first_share: float) -> dict[str, float]:
    """`total` requests/s split: `first_share` to the first class, the rest evenly."""
    if len(plans) == 1:
        return {plans[0].name: total}
    rest = (1 - first_share) * total / (len(plans) - 1)
    return {p.name: first_share * total if i == 0 else rest for i, p in enumerate(plans)}


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request to send: when (s from the phase start), in which class, what prompt."""

    at_s: float
    slo_class: str
    prompt: str


def arrivals(
    plans: Sequence[ClassPlan], rates: Mapping[str, float], duration_s: float, seed: int
) -> list[Arrival]:
    """Poisson arrivals of every class over `duration_s`, merged in time order."""
    rng = np.random.default_rng(seed)
    out: list[Arrival] = []
    for plan in plans:
        rate = rates[plan.name]
        t = float(rng.exponential(1 / rate)) if rate > 0 else duration_s
        while t < duration_s:
            out.append(Arrival(t, plan.name, make_prompt(plan.prompt_tokens, rng)))
            t += float(rng.exponential(1 / rate))
    return sorted(out, key=lambda a: a.at_s)
