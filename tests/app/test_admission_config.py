"""The admission config: tenant quotas, SLO classes, ingress replicas; each check's message."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from app.admission.controller import tenant_quotas
from app.config import PDServeConfig

Config = dict[str, Any]


def _base() -> Config:
    return {
        "pools": [
            {"name": "prefill", "role": "prefill"},
            {"name": "decode", "role": "decode"},
        ],
        "ingress": {"num_replicas": 2},
        "admission": {
            "classes": [
                {"name": "interactive", "ttft_s": 1.0, "tpot_s": 0.1, "priority": 0},
                {"name": "batch", "ttft_s": 60.0, "tpot_s": 1.0, "priority": 10},
            ]
        },
        "tenants": [
            {
                "name": "acme",
                "api_keys": ["sk-acme"],
                "default_class": "interactive",
                "quota": {
                    "max_concurrent_sequences": 64,
                    "requests_per_second": 2.5,
                    "prompt_tokens_per_minute": 100_000,
                    "output_tokens_per_minute": 20_000,
                    "max_queued_requests": 8,
                    "kv_block_share": 0.5,
                },
            },
            {"name": "globex", "api_keys": ["sk-globex"], "default_class": "batch"},
            {"name": "initech", "api_keys": ["sk-initech"], "max_concurrent_requests": 1},
        ],
    }


def test_admission_config_parses() -> None:
    config = PDServeConfig.model_validate(_base())
    assert config.ingress.num_replicas == 2
    acme = config.tenants[0]
    assert acme.quota.burst == 3  # ceil(requests_per_second) by default
    assert config.admission.slo_class("batch") is not None
    assert config.admission.slo_class("gold") is None
    # Only tenants with a limit go to the quota service.
    assert sorted(tenant_quotas(config.tenants)) == ["acme", "initech"]


def test_defaults_keep_one_ingress_replica_and_no_classes() -> None:
    config = PDServeConfig.model_validate(
        {"pools": [{"name": "d", "role": "decode"}], "local_prefill_threshold": 10_000}
    )
    assert config.ingress.num_replicas == 1
    assert config.admission.classes == []
    assert tenant_quotas(config.tenants) == {}


def _set(path: str, value: Any) -> Config:
    config = copy.deepcopy(_base())
    *parents, last = path.split(".")
    node: Any = config
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[last] = value
    return config


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("tenants.1.default_class", "gold", "default_class 'gold' is not in admission.classes"),
        ("tenants.0.quota.max_concurrent_sequences", 0, "greater than or equal to 1"),
        ("tenants.0.quota.requests_per_second", 0, "greater than 0"),
        ("tenants.0.quota.requests_per_second", float("inf"), "finite number"),
        ("tenants.0.quota.prompt_tokens_per_minute", -1, "greater than or equal to 1"),
        ("tenants.0.quota.output_tokens_per_minute", 0, "greater than or equal to 1"),
        ("tenants.0.quota.max_queued_requests", -1, "greater than or equal to 0"),
        ("tenants.0.quota.request_burst", 0, "greater than or equal to 1"),
        ("tenants.0.quota.kv_block_share", 0, "greater than 0"),
        ("tenants.0.quota.kv_block_share", 1.5, "less than or equal to 1"),
        ("tenants.0.quota.kv_share", 0.5, "Extra inputs are not permitted"),
        ("tenants.2.quota", {"request_burst": 5}, "request_burst needs quota.requests_per_second"),
        ("admission.lease_fraction", 0, "greater than 0"),
        ("admission.lease_fraction", 1.5, "less than or equal to 1"),
        ("admission.lease_ttl_s", 0, "greater than 0"),
        ("admission.queue_timeout_s", -1, "greater than 0"),
        ("admission.classes.0.ttft_s", 0, "greater than 0"),
        ("admission.classes.1.name", "interactive", "names must be unique"),
        ("admission.classes.0.name", "9lives", "should match pattern"),
        ("ingress.num_replicas", 0, "greater than or equal to 1"),
        ("ingress.num_cpus", 0, "greater than 0"),
    ],
)
def test_invalid_admission_settings_say_what_is_wrong(path: str, value: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PDServeConfig.model_validate(_set(path, value))
