"""RouterPolicy: pools chosen by prompt length and tenant, typed errors otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.config import PDServeConfig, load_config
from app.errors import APIError, error_response
from app.routing.pool_router import (
    NoRouteError,
    PromptTooLongError,
    RouteDecision,
    RouterPolicy,
    UnknownTenantError,
)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _policy(**overrides: Any) -> RouterPolicy:
    data: dict[str, Any] = {
        "pools": [
            {"name": "short", "role": "prefill", "max_context_tokens": 1024},
            {"name": "long", "role": "prefill", "min_context_tokens": 1025},
            {"name": "decode", "role": "decode"},
            {"name": "decode-b", "role": "decode"},
        ],
        "local_prefill_threshold": 32,
        "tenants": [
            {"name": "acme", "api_keys": ["sk-acme-1", "sk-acme-2"], "priority": 0},
            {
                "name": "globex",
                "api_keys": ["sk-globex"],
                "allowed_pools": ["short", "decode-b"],
                "priority": 3,
            },
        ],
        "limits": {"max_prompt_tokens": 4096},
    }
    data.update(overrides)
    return RouterPolicy(PDServeConfig.model_validate(data))


def test_tenant_for_key() -> None:
    policy = _policy()
    assert policy.requires_api_key
    assert policy.tenant_for_key("sk-acme-1") == "acme"
    assert policy.tenant_for_key("sk-acme-2") == "acme"
    assert policy.tenant_for_key("sk-globex") == "globex"
    with pytest.raises(UnknownTenantError, match="missing API key"):
        policy.tenant_for_key(None)
    with pytest.raises(UnknownTenantError, match="missing API key"):
        policy.tenant_for_key("")
    with pytest.raises(UnknownTenantError, match="invalid API key"):
        policy.tenant_for_key("sk-nobody")


def test_no_tenants_means_anonymous() -> None:
    policy = _policy(tenants=[])
    assert not policy.requires_api_key
    assert policy.tenant_for_key(None) == ""
    assert policy.tenant_for_key("anything") == ""
    assert policy.tenant_config("") is None
    decision = policy.route(2000, "")
    assert decision == RouteDecision("long", "decode", False, 0, decision.reason)
    with pytest.raises(UnknownTenantError):
        policy.route(100, "acme")


def test_unknown_tenant() -> None:
    policy = _policy()
    with pytest.raises(UnknownTenantError, match="unknown tenant 'initech'"):
        policy.route(100, "initech")
    with pytest.raises(UnknownTenantError):
        policy.route(100, "")  # tenants configured: no anonymous access
    with pytest.raises(UnknownTenantError):
        policy.tenant_config("initech")
    config = policy.tenant_config("globex")
    assert config is not None and config.priority == 3


@pytest.mark.parametrize(
    ("num_tokens", "prefill_pool"),
    [(32, "short"), (500, "short"), (1024, "short"), (1025, "long"), (4096, "long")],
)
def test_route_by_length(num_tokens: int, prefill_pool: str) -> None:
    decision = _policy().route(num_tokens, "acme")
    assert decision.prefill_pool == prefill_pool
    assert decision.decode_pool == "decode"  # the first decode pool in config order
    assert not decision.local_prefill
    assert decision.priority == 0


def test_reason_is_readable() -> None:
    policy = _policy()
    assert policy.route(3000, "acme").reason == (
        "len 3000 in [1025, inf] -> pool long, decode pool decode"
    )
    assert policy.route(31, "acme").reason == (
        "len 31 < local_prefill_threshold 32 -> local prefill on decode pool decode"
    )


@pytest.mark.parametrize("num_tokens", [1, 31])
def test_short_prompts_prefill_locally(num_tokens: int) -> None:
    decision = _policy().route(num_tokens, "globex")
    assert decision == RouteDecision(None, "decode-b", True, 3, decision.reason)


def test_tenant_uses_its_own_decode_pool() -> None:
    decision = _policy().route(100, "globex")
    assert (decision.prefill_pool, decision.decode_pool, decision.priority) == (
        "short",
        "decode-b",
        3,
    )


def test_disallowed_pool_without_fallback_is_no_route() -> None:
    with pytest.raises(NoRouteError, match="tenant 'globex' may not use prefill pool 'long'"):
        _policy().route(2000, "globex")


def test_disallowed_pool_falls_back_to_allowed_overlapping_pool() -> None:
    pools = [
        {"name": "long", "role": "prefill", "min_context_tokens": 1025},
        {"name": "any", "role": "prefill"},
        {"name": "decode", "role": "decode"},
    ]
    tenants = [
        {"name": "acme", "api_keys": ["a"]},
        {"name": "globex", "api_keys": ["g"], "allowed_pools": ["any", "decode"]},
    ]
    policy = _policy(pools=pools, tenants=tenants)
    assert policy.route(2000, "acme").prefill_pool == "long"  # first covering pool
    assert policy.route(100, "acme").prefill_pool == "any"
    decision = policy.route(2000, "globex")
    assert decision.prefill_pool == "any"
    assert "fallback: tenant 'globex' may not use pool long" in decision.reason


def test_prompt_limits() -> None:
    policy = _policy()
    assert policy.route(4096, "acme").prefill_pool == "long"
    with pytest.raises(PromptTooLongError, match="prompt has 4097 tokens; the limit is 4096"):
        policy.route(4097, "acme")
    with pytest.raises(APIError, match="empty"):
        policy.route(0, "acme")


def test_errors_map_to_http_statuses() -> None:
    policy = _policy()
    cases: list[tuple[Any, int]] = [
        (lambda: policy.tenant_for_key("bad"), 401),
        (lambda: policy.route(2000, "globex"), 403),
        (lambda: policy.route(5000, "acme"), 400),
        (lambda: policy.route(0, "acme"), 400),
    ]
    for call, status in cases:
        with pytest.raises(APIError) as info:
            call()
        assert error_response(info.value)[0] == status
    with pytest.raises(PromptTooLongError) as too_long:
        policy.route(5000, "acme")
    assert error_response(too_long.value)[1]["error"]["code"] == "context_length_exceeded"


def test_colocated_routes_everything_locally() -> None:
    policy = RouterPolicy(load_config(CONFIGS / "cpu-colocated.yaml"))
    for num_tokens in (1, 100, 4096):
        decision = policy.route(num_tokens, "")
        assert decision.local_prefill and decision.prefill_pool is None
        assert decision.decode_pool == "decode"


def test_cpu_tenants_file() -> None:
    policy = RouterPolicy(load_config(CONFIGS / "cpu-tenants.yaml"))
    acme = policy.tenant_for_key("sk-acme-0123456789abcdef")
    globex = policy.tenant_for_key("sk-globex-0123456789abcdef")
    assert policy.route(2000, acme).prefill_pool == "long"
    assert policy.route(500, globex).prefill_pool == "short"
    assert policy.route(10, globex).local_prefill
    with pytest.raises(NoRouteError):
        policy.route(2000, globex)


def test_h200_file(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "h200.yaml")
    keys = tmp_path / "keys"
    keys.write_text("sk-h200\n")
    tenants = [t.model_copy(update={"api_keys_file": str(keys)}) for t in config.tenants]
    config = config.model_copy(update={"tenants": tenants, "admin_api_keys_file": str(keys)})
    policy = RouterPolicy(config)
    tenant = policy.tenant_for_key("sk-h200")
    assert policy.route(255, tenant).local_prefill
    assert policy.route(256, tenant).prefill_pool == "short"
    assert policy.route(8193, tenant).prefill_pool == "long"
    assert policy.route(28672, tenant).prefill_pool == "long"
    with pytest.raises(PromptTooLongError):
        policy.route(28673, tenant)
