"""Which SLO class a request runs in, and so its priority at every queue.

A tenant's `default_class` is its class; a request may ask for another one, through the
header `x-pdserve-slo-class` or the body extension `{"pdserve": {"slo_class": ...}}` (the
header wins when both are given), but only one no more important than the default (priority
value >= the default's). Asking for a more important class is 403 `slo_class_not_allowed`
(the tenant is not entitled to it); an unknown class is 400 `unknown_slo_class`. Without
classes a tenant's requests run at its `priority`, in the class named "default".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.config import AdmissionSettings, SLOClass, TenantConfig
from app.errors import BadRequestError, PermissionDeniedError

SLO_CLASS_HEADER = "x-pdserve-slo-class"
DEFAULT_CLASS = "default"


@dataclass(frozen=True, slots=True)
class ServiceClass:
    """The class a request runs in."""

    name: str
    priority: int  # lower is more important
    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def of(cls, slo_class: SLOClass) -> ServiceClass:
        return cls(slo_class.name, slo_class.priority, slo_class.ttft_s, slo_class.tpot_s)


def requested_class(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The class a request asks for (header first, then `pdserve.slo_class`), if any."""
    header = headers.get(SLO_CLASS_HEADER)
    if header is not None:
        return header.strip()
    extension = body.get("pdserve")
    if extension is None:
        return None
    if not isinstance(extension, Mapping):
        raise BadRequestError("pdserve: must be an object", param="pdserve")
    name = extension.get("slo_class")
    if name is not None and not isinstance(name, str):
        raise BadRequestError("pdserve.slo_class: must be a string", param="pdserve.slo_class")
    return name


class ClassResolver:
    """Resolves a tenant's request to its `ServiceClass` (see the module docstring)."""

    def __init__(self, admission: AdmissionSettings, tenants: list[TenantConfig]) -> None:
        self._admission = admission
        self._defaults: dict[str, ServiceClass] = {}
        for tenant in tenants:
            default = tenant.default_class
            slo = admission.slo_class(default) if default is not None else None
            if slo is not None:
                self._defaults[tenant.name] = ServiceClass.of(slo)
            else:
                self._defaults[tenant.name] = ServiceClass(DEFAULT_CLASS, tenant.priority)

    def resolve(self, tenant: str, requested: str | None) -> ServiceClass:
        """The class of `tenant`'s request asking for `requested` (None: the default)."""
        default = self._defaults.get(tenant, ServiceClass(DEFAULT_CLASS, 0))
        if requested is None or requested == default.name:
            return default
        slo = self._admission.slo_class(requested)
        if slo is None:
            known = ", ".join(c.name for c in self._admission.classes) or "none configured"
            raise BadRequestError(
                f"unknown SLO class {requested!r} (classes: {known})",
                param="pdserve.slo_class",
                code="unknown_slo_class",
            )
        if slo.priority < default.priority:
            raise PermissionDeniedError(
                f"tenant {tenant!r} may not use SLO class {requested!r}: it is more important "
                f"than the tenant's default class {default.name!r}",
                code="slo_class_not_allowed",
            )
        return ServiceClass.of(slo)
