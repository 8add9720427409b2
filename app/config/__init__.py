"""The application's configuration: one pydantic model tree, validated at the edge.

`PDServeConfig` (`root`) is a Serve config file's `applications[0].args`, assembled from one
module per section: `model`, `pools` (and their autoscaling), `transfer`, `tenants`,
`admission` (SLO classes, ingress replicas), `routing` (adaptive disaggregation), `http`
(listener and limits), `overload` (shedding, deadlines, breakers), `observability`, `batch`
(offline jobs). Every
model is strict (unknown keys are errors) and describes every field; cross-section checks
run on load, before any replica starts. `docs/configuration.md` is generated from these
models (`scripts/config_reference.py`).

Other code imports from this package; nothing here imports the rest of `app/`.
"""

from __future__ import annotations

from app.config.admission import AdmissionSettings, IngressSettings, SLOClass, check_tenant_classes
from app.config.base import NAME_PATTERN, ConfigError, read_api_keys
from app.config.batch import BatchSettings
from app.config.http import HttpSettings, LimitSettings
from app.config.model import EngineOverrides, ModelSettings
from app.config.observability import (
    CostSettings,
    MetricsSettings,
    ObservabilitySettings,
    PoolCost,
    RedactionRule,
    RequestLogSettings,
    TracingSettings,
)
from app.config.overload import BreakerConfig, OverloadSettings, SheddingSettings
from app.config.pools import AutoscalingSettings, PoolConfig, check_prefill_coverage
from app.config.root import PDServeConfig, load_config
from app.config.routing import AdaptivePrefillSettings
from app.config.tenants import TenantConfig, TenantQuota
from app.config.transfer import TransferSettings

__all__ = [
    "AdaptivePrefillSettings",
    "AdmissionSettings",
    "AutoscalingSettings",
    "BatchSettings",
    "BreakerConfig",
    "ConfigError",
    "CostSettings",
    "EngineOverrides",
    "HttpSettings",
    "IngressSettings",
    "LimitSettings",
    "MetricsSettings",
    "ModelSettings",
    "NAME_PATTERN",
    "ObservabilitySettings",
    "OverloadSettings",
    "PDServeConfig",
    "PoolConfig",
    "PoolCost",
    "RedactionRule",
    "RequestLogSettings",
    "SLOClass",
    "SheddingSettings",
    "TenantConfig",
    "TenantQuota",
    "TracingSettings",
    "TransferSettings",
    "check_prefill_coverage",
    "check_tenant_classes",
    "load_config",
    "read_api_keys",
]
