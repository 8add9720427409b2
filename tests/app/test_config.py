"""PDServeConfig: good configs parse, every validator fires with its message, files load."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from app.admission.controller import decode_pool_blocks
from app.config import (
    AutoscalingSettings,
    ConfigError,
    ModelSettings,
    PDServeConfig,
    PoolConfig,
    load_config,
)
from app.routing.pool_router import RouterPolicy
from app.serve.cadence import SERVE_ENV_VARS
from engine.builtin import resolve_model_dir
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.kv_cache import KVCacheSpec
from engine.loader import load_model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))

Config = dict[str, Any]


def _base() -> Config:
    """A valid disaggregated config: short/long prefill pools, one decode pool, two tenants."""
    return {
        "pools": [
            {"name": "short", "role": "prefill", "max_context_tokens": 1024},
            {"name": "long", "role": "prefill", "min_context_tokens": 1025},
            {"name": "decode", "role": "decode"},
        ],
        "local_prefill_threshold": 32,
        "tenants": [
            {"name": "acme", "api_keys": ["sk-acme"]},
            {"name": "globex", "api_keys": ["sk-globex"], "allowed_pools": ["short", "decode"]},
        ],
        "limits": {"max_prompt_tokens": 4096},
    }


def _edit(change: Callable[[Config], object]) -> Config:
    config = copy.deepcopy(_base())
    change(config)
    return config


def test_base_config_parses_with_defaults() -> None:
    config = PDServeConfig.model_validate(_base())
    assert config.model.model == "tiny"
    assert config.model.served_model_name == "pdserve-tiny"
    assert config.transfer.backend == "shm" and config.transfer.deadline_s == 30
    assert config.limits.max_output_tokens == 1024
    assert config.limits.max_body_bytes == 1024 * 1024
    assert (config.http.host, config.http.port) == ("127.0.0.1", 8000)
    assert (config.app_name, config.route_prefix) == ("pdserve", "/")
    assert [p.num_replicas for p in config.pools] == [1, 1, 1]
    assert not config.colocated
    assert config.remote_prefill_lengths == (32, 4096)
    assert [p.name for p in config.allowed_pools("globex")] == ["short", "decode"]
    assert len(config.allowed_pools("acme")) == 3


def test_served_model_name_defaults_to_basename() -> None:
    settings = ModelSettings(model="/models/Llama-3.1-8B-Instruct/")
    assert settings.served_model_name == "pdserve-Llama-3.1-8B-Instruct"
    assert ModelSettings(model="x", served_model_name="mine").served_model_name == "mine"


def test_to_engine_config() -> None:
    settings = ModelSettings(
        model="small",
        dtype="bfloat16",
        block_size=32,
        kv_cache_bytes=1 << 20,
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        long_prefill_token_threshold=256,
        enable_prefix_caching=False,
        num_threads=2,
    )
    assert settings.to_engine_config() == EngineConfig(
        model_dir="small",
        dtype="bfloat16",
        device="cpu",
        cache=CacheConfig(block_size=32, kv_cache_bytes=1 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=1024, max_num_seqs=8, long_prefill_token_threshold=256
        ),
        num_threads=2,
    )


def test_cuda_graphs_only_where_decode_steps_run() -> None:
    config = PDServeConfig.model_validate(
        {
            "model": {"model": "tiny", "device": "cuda", "kv_cache_bytes": 1 << 24},
            "transfer": {"backend": "nccl"},
            "pools": [
                {"name": "prefill", "role": "prefill", "num_gpus": 1},
                {"name": "decode", "role": "decode", "num_gpus": 1, "num_replicas": 2},
            ],
        }
    )
    prefill, decode = (config.engine_config(pool) for pool in config.pools)
    assert prefill.enforce_eager and not decode.enforce_eager
    # Each decode replica keeps one block for its graphs' padding rows: out of the KV share.
    model_config = load_model_config(resolve_model_dir("tiny"), "float32")
    spec = KVCacheSpec.for_engine(decode, model_config)
    blocks = decode_pool_blocks(config, model_config)
    assert blocks == {"decode": 2 * (spec.num_blocks - 1)}


def test_colocated_needs_no_prefill_pool() -> None:
    config = PDServeConfig.model_validate(
        {
            "pools": [{"name": "decode", "role": "decode", "num_replicas": 2}],
            "local_prefill_threshold": 4097,
        }
    )
    assert config.colocated and config.remote_prefill_lengths is None


def test_overlapping_prefill_ranges_are_allowed() -> None:
    config = _edit(lambda c: c["pools"][1].update(min_context_tokens=512))
    PDServeConfig.model_validate(config)


def test_autoscaling_pool_and_serve_options() -> None:
    pool = PoolConfig(
        name="p",
        role="decode",
        autoscaling=AutoscalingSettings(min_replicas=1, max_replicas=4, target_ongoing_requests=16),
        num_gpus=1,
        resources={"h200_decode": 1},
    )
    assert pool.num_replicas is None and pool.max_num_replicas == 4
    options = pool.serve_options()
    assert options["autoscaling_config"]["max_replicas"] == 4
    assert "num_replicas" not in options
    assert options["ray_actor_options"] == {
        "num_cpus": 1.0,
        "num_gpus": 1.0,
        "resources": {"h200_decode": 1},
    }
    fixed = PoolConfig(name="q", role="prefill", num_replicas=3).serve_options()
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed


def _set_model(config: Config, **fields: object) -> None:
    config.setdefault("model", {}).update(fields)


INVALID: list[tuple[str, Callable[[Config], object], str]] = [
    ("typo is an error", lambda c: c.update(local_prefil_threshold=3), "Extra inputs"),
    ("nested typo", lambda c: _set_model(c, blocksize=16), "Extra inputs"),
    ("block size not pow2", lambda c: _set_model(c, block_size=24), "power of two in 1..128"),
    ("block size too big", lambda c: _set_model(c, block_size=256), "power of two in 1..128"),
    ("kv bytes", lambda c: _set_model(c, kv_cache_bytes=0), "greater than 0"),
    ("bad dtype", lambda c: _set_model(c, dtype="int8"), "float32"),
    (
        "chunk over budget",
        lambda c: _set_model(c, max_num_batched_tokens=256, long_prefill_token_threshold=512),
        "long_prefill_token_threshold \\(512\\) must be <= max_num_batched_tokens \\(256\\)",
    ),
    ("bad pool name", lambda c: c["pools"][0].update(name="1st pool"), "should match pattern"),
    ("bad role", lambda c: c["pools"][0].update(role="both"), "'prefill' or 'decode'"),
    ("zero replicas", lambda c: c["pools"][0].update(num_replicas=0), "greater than or equal"),
    (
        "replicas and autoscaling",
        lambda c: c["pools"][2].update(num_replicas=2, autoscaling={"max_replicas": 3}),
        "set num_replicas or autoscaling, not both",
    ),
    (
        "autoscaling max < min",
        lambda c: c["pools"][2].update(autoscaling={"min_replicas": 3, "max_replicas": 2}),
        "max_replicas \\(2\\) < min_replicas \\(3\\)",
    ),
    ("cpus", lambda c: c["pools"][0].update(num_cpus=0), "greater than 0"),
    ("gpus", lambda c: c["pools"][0].update(num_gpus=-1), "greater than or equal to 0"),
    (
        "reserved resource",
        lambda c: c["pools"][0].update(resources={"GPU": 1}),
        "is set by num_cpus/num_gpus",
    ),
    ("zero resource", lambda c: c["pools"][0].update(resources={"x": 0}), "greater than 0"),
    (
        "range on decode pool",
        lambda c: c["pools"][2].update(max_context_tokens=100),
        "decode pool 'decode': min_context_tokens/max_context_tokens apply to prefill pools",
    ),
    (
        "inverted range",
        lambda c: c["pools"][1].update(max_context_tokens=1000),
        "min_context_tokens \\(1025\\) > max_context_tokens \\(1000\\)",
    ),
    ("no pools", lambda c: c.update(pools=[]), "at least 1 item"),
    (
        "duplicate pool",
        lambda c: c["pools"][1].update(name="short"),
        "pool names must be unique; repeated: short",
    ),
    ("no decode pool", lambda c: c["pools"].pop(2), "at least one pool must have role 'decode'"),
    (
        "no prefill pool",
        lambda c: c.update(pools=[{"name": "decode", "role": "decode"}], tenants=[]),
        "no prefill pool, but prompts of 32..4096 tokens need remote prefill",
    ),
    (
        "gap between pools",
        lambda c: c["pools"][1].update(min_context_tokens=2000),
        "leave prompt lengths 1025..1999 uncovered",
    ),
    (
        "gap at the top",
        lambda c: c["pools"][1].update(max_context_tokens=3000),
        "leave prompt lengths 3001..4096 uncovered",
    ),
    (
        "gap at the bottom",
        lambda c: c["pools"][0].update(min_context_tokens=64),
        "leave prompt lengths 32..63 uncovered",
    ),
    (
        "unreachable prefill pool",
        lambda c: c["pools"].insert(
            0, {"name": "tiny", "role": "prefill", "min_context_tokens": 1, "max_context_tokens": 8}
        ),
        "prefill pool 'tiny' serves lengths 1..8, which no remotely prefilled prompt",
    ),
    (
        "prefill pool when colocated",
        lambda c: c.update(local_prefill_threshold=5000),
        "would never be used",
    ),
    (
        "nccl on cpu",
        lambda c: c.update(transfer={"backend": "nccl"}),
        "transfer.backend 'nccl' requires model.device 'cuda'",
    ),
    (
        "cuda without gpus",
        lambda c: _set_model(c, device="cuda"),
        "model.device is 'cuda' but pools short, long, decode set num_gpus 0",
    ),
    ("bad backend", lambda c: c.update(transfer={"backend": "rdma"}), "'shm', 'tcp'"),
    ("deadline", lambda c: c.update(transfer={"deadline_s": 0}), "greater than 0"),
    ("bind host", lambda c: c.update(transfer={"bind_host": "node-a"}), "not an IP address"),
    (
        "advertise wildcard",
        lambda c: c.update(transfer={"advertise_host": "0.0.0.0"}),
        "advertise_host must be an address peers can connect to",
    ),
    (
        "no keys",
        lambda c: c["tenants"][0].update(api_keys=[]),
        "tenant 'acme' has no API key: set api_keys_env, api_keys_file or api_keys",
    ),
    ("empty key", lambda c: c["tenants"][0].update(api_keys=[""]), "API keys must be non-empty"),
    (
        "repeated key",
        lambda c: c["tenants"][0].update(api_keys=["a", "a"]),
        "API keys must not repeat",
    ),
    (
        "public without tenants",
        lambda c: c.update(tenants=[], http={"host": "0.0.0.0"}),
        "http.host '0.0.0.0' is reachable from other machines and no tenants are configured",
    ),
    (
        "public with inline keys",
        lambda c: c.update(http={"host": "0.0.0.0"}),
        "inline API keys \\(acme, globex\\) on non-loopback host '0.0.0.0'",
    ),
    (
        "public with inline admin keys",
        lambda c: c.update(
            http={"host": "10.1.2.3"},
            tenants=[{"name": "acme", "api_keys_env": "PDSERVE_TEST_KEYS"}],
            admin_api_keys=["sk-admin"],
        ),
        "inline API keys \\(admin_api_keys\\)",
    ),
    (
        "key shared by tenants",
        lambda c: c["tenants"][1].update(api_keys=["sk-acme"]),
        "an API key of tenant 'globex' is also a key of tenant 'acme'",
    ),
    (
        "duplicate tenant",
        lambda c: c["tenants"][1].update(name="acme"),
        "tenant names must be unique; repeated: acme",
    ),
    (
        "unknown allowed pool",
        lambda c: c["tenants"][1].update(allowed_pools=["short", "decode", "medium"]),
        "tenant 'globex': allowed_pools names unknown pool\\(s\\) medium",
    ),
    (
        "tenant without decode",
        lambda c: c["tenants"][1].update(allowed_pools=["short"]),
        "tenant 'globex': allowed_pools has no decode pool",
    ),
    (
        "tenant without prefill",
        lambda c: c["tenants"][1].update(allowed_pools=["decode"]),
        "tenant 'globex': allowed_pools has no prefill pool",
    ),
    ("quota", lambda c: c["tenants"][0].update(max_concurrent_requests=0), "greater than"),
    ("prompt limit", lambda c: c["limits"].update(max_prompt_tokens=0), "greater than"),
    ("output limit", lambda c: c.update(limits={"max_output_tokens": 0}), "greater than"),
    ("port", lambda c: c.update(http={"port": 70000}), "less than or equal to 65535"),
    ("route prefix", lambda c: c.update(route_prefix="v1"), "should match pattern"),
    ("threshold", lambda c: c.update(local_prefill_threshold=-1), "greater than or equal"),
    (
        "spare threads on cuda",
        lambda c: [
            c.update(model={"device": "cuda", "spare_num_threads": 2}),
            *(pool.update(num_gpus=0.25) for pool in c["pools"]),
        ],
        "spare_num_threads is for CPU replicas",
    ),
    (
        "spare threads below num_threads",
        lambda c: c.update(model={"num_threads": 4, "spare_num_threads": 2}),
        r"spare_num_threads \(2\) below num_threads \(4\)",
    ),
]


@pytest.mark.parametrize(
    ("change", "message"), [(c, m) for _, c, m in INVALID], ids=[i for i, _, _ in INVALID]
)
def test_invalid_config_is_rejected_with_message(
    change: Callable[[Config], object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        PDServeConfig.model_validate(_edit(change))


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_config_files_are_valid_serve_configs(path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    (app,) = schema.applications
    assert app.import_path == "app.main:build_app"
    args = raw["applications"][0]["args"]
    # Serve passes `args` to build_app as is, so they must hold the whole config themselves.
    config = PDServeConfig.model_validate(args)
    assert config == load_config(path)
    assert config.app_name == app.name and config.route_prefix == app.route_prefix
    assert config.http.host == schema.http_options.host
    assert config.http.port == schema.http_options.port
    # Serve's controller and proxies run at the cadence the replicas get (app/serve/cadence.py)
    assert schema.controller_options is not None
    assert schema.controller_options.runtime_env == {"env_vars": SERVE_ENV_VARS}
    assert app.runtime_env == {"env_vars": SERVE_ENV_VARS}  # the replicas'


def test_expected_config_files_exist() -> None:
    names = {p.name for p in CONFIG_FILES}
    assert {"cpu-disagg.yaml", "cpu-colocated.yaml", "cpu-tenants.yaml", "h200.yaml"} <= names


def test_config_file_shapes() -> None:
    disagg = load_config(CONFIGS / "cpu-disagg.yaml")
    assert [p.role for p in disagg.pools] == ["prefill", "decode"]
    assert disagg.transfer.backend == "shm" and not disagg.colocated
    colocated = load_config(CONFIGS / "cpu-colocated.yaml")
    assert colocated.colocated and [p.num_replicas for p in colocated.pools] == [2]
    tenants = load_config(CONFIGS / "cpu-tenants.yaml")
    assert [t.name for t in tenants.tenants] == ["acme", "globex"]
    h200 = load_config(CONFIGS / "h200.yaml")
    assert h200.model.device == "cuda" and h200.transfer.backend == "nccl"
    for config in (disagg, colocated, tenants):
        assert sum(p.num_cpus * p.max_num_replicas for p in config.pools) <= 1.5  # 2 cores


def test_load_config_bare_document(tmp_path: Path) -> None:
    path = tmp_path / "bare.yaml"
    path.write_text(yaml.safe_dump(_base()))
    assert load_config(path) == PDServeConfig.model_validate(_base())
    assert load_config(_base()) == PDServeConfig.model_validate(_base())


def test_load_config_checks_args_agree_with_serve_file() -> None:
    args = {**_base(), "app_name": "llm", "route_prefix": "/llm", "http": {"port": 9000}}
    serve_file = {
        "http_options": {"port": 9000},
        "applications": [{"name": "llm", "route_prefix": "/llm", "args": args}],
    }
    config = load_config(serve_file)
    assert (config.app_name, config.route_prefix, config.http.port) == ("llm", "/llm", 9000)
    serve_file["http_options"] = {"port": 9001}
    with pytest.raises(ConfigError, match="args.http.port is 9000 but the Serve file says 9001"):
        load_config(serve_file)
    serve_file["http_options"] = {}
    serve_file["applications"][0]["name"] = "other"  # type: ignore[index]
    with pytest.raises(ConfigError, match="args.app_name is 'llm' but the Serve file says"):
        load_config(serve_file)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "config must be a mapping"),
        ({"applications": []}, "non-empty list"),
        ({"applications": [{"args": [1]}]}, "args must be a mapping"),
    ],
)
def test_load_config_rejects_bad_shapes(data: object, message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_build_app_takes_one_args_parameter() -> None:
    """Serve calls `build_app(args)` with exactly one positional argument (the args dict)."""
    main = pytest.importorskip("app.main")
    assert len(inspect.signature(main.build_app).parameters) == 1


def _public(tenants: list[dict[str, object]], **extra: object) -> PDServeConfig:
    return PDServeConfig.model_validate(
        _edit(lambda c: c.update(http={"host": "0.0.0.0"}, tenants=tenants, **extra))
    )


def test_public_host_allows_anonymous_only_when_asked() -> None:
    config = _public([], allow_anonymous=True)
    assert config.resolve_tenant_keys() == {}
    assert not RouterPolicy(config).requires_api_key


def test_keys_are_read_from_env_and_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "globex-keys"
    keys.write_text("# globex\nsk-g1\n\n  sk-g2  \n")
    admin = tmp_path / "admin-keys"
    admin.write_text("sk-admin\n")
    monkeypatch.setenv("PDSERVE_TEST_ACME_KEYS", "sk-a1, sk-a2 sk-a3")
    config = _public(
        [
            {"name": "acme", "api_keys_env": "PDSERVE_TEST_ACME_KEYS"},
            {"name": "globex", "api_keys_file": str(keys), "allowed_pools": ["short", "decode"]},
        ],
        admin_api_keys_file=str(admin),
    )
    assert config.resolve_tenant_keys() == {
        "sk-a1": "acme",
        "sk-a2": "acme",
        "sk-a3": "acme",
        "sk-g1": "globex",
        "sk-g2": "globex",
    }
    policy = RouterPolicy(config)
    assert policy.tenant_for_key("sk-g2") == "globex"
    assert policy.is_admin_key("sk-admin") and not policy.is_admin_key("sk-a1")
    # The keys themselves never appear in what Serve stores as the app's args.
    dumped = str(config.model_dump(mode="json"))
    assert "sk-a1" not in dumped and "sk-g1" not in dumped and "sk-admin" not in dumped


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        ({"api_keys_env": "PDSERVE_TEST_UNSET"}, "environment variable 'PDSERVE_TEST_UNSET'"),
        ({"api_keys_file": "/nonexistent/keys"}, "cannot read API key file '/nonexistent/keys'"),
    ],
)
def test_missing_key_source_fails_the_build(tenant: dict[str, str], message: str) -> None:
    from app.main import build_app

    config = _public([{"name": "acme", **tenant}])
    with pytest.raises(ConfigError, match=message):
        build_app(config)


def test_keys_shared_across_sources_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_TEST_A", "same")
    monkeypatch.setenv("PDSERVE_TEST_G", "same")
    config = _public(
        [
            {"name": "acme", "api_keys_env": "PDSERVE_TEST_A"},
            {
                "name": "globex",
                "api_keys_env": "PDSERVE_TEST_G",
                "allowed_pools": ["short", "decode"],
            },
        ]
    )
    with pytest.raises(ConfigError, match="also a key of tenant 'acme'"):
        config.resolve_tenant_keys()


def test_h200_config_refuses_to_start_without_its_key_files() -> None:
    from app.main import build_app

    config = load_config(CONFIGS / "h200.yaml")
    assert not config.http.is_loopback and config.tenants and not config.allow_anonymous
    with pytest.raises(ConfigError, match="cannot read API key file '/etc/pdserve/api-keys'"):
        build_app(config)
    without_tenants = config.model_dump(mode="json") | {"tenants": [], "admin_api_keys_file": None}
    with pytest.raises(ValidationError, match="add tenants with API keys, or set allow_anonymous"):
        PDServeConfig.model_validate(without_tenants)


def test_random_weights_for_speed_runs_reach_every_pool() -> None:
    """`load_format: dummy` (the GPU serve check's Llama-3-8B shape) reaches each pool's
    engine; anything else is refused."""
    data = yaml.safe_load((CONFIGS / "gpu-single.yaml").read_text())["applications"][0]["args"]
    assert {load_config(data).engine_config(p).load_format for p in load_config(data).pools} == {
        "auto"
    }
    data["model"]["load_format"] = "dummy"
    config = load_config(data)
    assert {config.engine_config(p).load_format for p in config.pools} == {"dummy"}
    data["model"]["load_format"] = "random"
    with pytest.raises(ValidationError, match="load_format"):
        load_config(data)
