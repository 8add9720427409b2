"""The Ray Serve application: `serve run app.main:app` or `serve run configs/<name>.yaml`.

`build_app(args)` turns a `PDServeConfig` (the Serve config file's application args) into
the deployment graph: one deployment per prefill pool, one per decode pool (each decode
replica holds handles to every prefill pool), and the HTTP ingress in front.
"""

from __future__ import annotations

import atexit
import secrets
from functools import partial
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.admission.controller import tenant_quotas
from app.admission.quota_service import QUOTA_SERVICE_OPTIONS, QuotaService
from app.config import PDServeConfig, PoolConfig, load_config
from app.driver_exit import exit_cleanly
from app.ingress import Ingress
from app.observability.replica_metrics import replica_metrics_factory
from app.observability.tracing import check_exporter, configure_tracing
from app.routing.fallback import check_fallback_model
from app.serve.apps import INGRESS_DEPLOYMENT
from app.serve.cadence import set_defaults
from app.serve.calls import SERVE_CALLS
from decode.server import DecodeServer
from kvtransfer import TransferOptions
from prefill.server import PrefillServer

# `serve run app.main:app`: the built-in tiny model, 1 prefill + 1 decode replica, no auth.
DEFAULT_ARGS: dict[str, Any] = {
    "model": {"model": "tiny", "num_threads": 1},
    "pools": [
        {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
        {"name": "decode", "role": "decode", "num_cpus": 0.5},
    ],
    "transfer": {"backend": "shm"},
    "local_prefill_threshold": 0,
}

ROUTER_CONFIG = RequestRouterConfig(
    request_router_class="app.serve.replica_router:KVAwareRouter",  # type: ignore[arg-type]
    request_routing_stats_period_s=1.0,  # type: ignore[arg-type]
    request_routing_stats_timeout_s=5.0,  # type: ignore[arg-type]
)


INGRESS_MAX_QUEUED_REQUESTS = 2000
_KV_NAMESPACE = "pdserve"  # Ray internal KV namespace of the apps' KV-transfer secrets


def _deployment(cls: type) -> Any:
    """`serve.deployment(cls)`: the class stays importable and testable without Serve."""
    return serve.deployment(cls)


def _options(pool: PoolConfig) -> dict[str, Any]:
    return {
        **pool.serve_options(),
        "request_router_config": ROUTER_CONFIG,
        "health_check_period_s": 5,
    }


def kv_secret(app_name: str) -> str:
    """The KV-transfer secret of the app `app_name` on the connected Ray cluster: random,
    created once and kept in the cluster's internal KV store (where Serve keeps the replicas'
    init args, which carry it anyway), so the replicas of a redeploy and the old ones still
    draining prove the same secret. Never logged, never in the config. Without a connected
    Ray (`serve run module:build_app` builds before it connects): a fresh one per build."""
    import ray
    from ray.experimental import internal_kv

    fresh = secrets.token_hex(32)
    if not ray.is_initialized():
        return fresh
    key = f"kv-secret/{app_name}"
    # Create-if-absent is atomic in the GCS: concurrent builds agree on the first one stored.
    internal_kv._internal_kv_put(key, fresh, overwrite=False, namespace=_KV_NAMESPACE)
    stored = internal_kv._internal_kv_get(key, namespace=_KV_NAMESPACE)
    return stored.decode() if stored else fresh


def build_app(args: dict[str, Any] | PDServeConfig | None = None) -> serve.Application:
    """The whole pdserve application for `args` (a PDServeConfig or its dict)."""
    config = args if isinstance(args, PDServeConfig) else load_config(dict(args or DEFAULT_ARGS))
    # Fail here, before any replica starts, when a key source named in the config is missing
    # (the ingress reads the keys again where it runs; they never travel in the args).
    config.resolve_tenant_keys()
    config.resolve_admin_keys()
    check_exporter(config.observability.tracing)
    check_fallback_model(config)  # it loads and shares the primary model's vocabulary
    # Each replica sets up its process's tracing from this (partial pickles by reference).
    telemetry = partial(configure_tracing, config.observability.tracing)
    # One secret per app, shared by every replica of it: a KV endpoint only talks to peers
    # that prove they hold it (HMAC handshake), never to another app or a stray client.
    options = TransferOptions(checksum=config.transfer.checksum, secret=kv_secret(config.app_name))
    backend = config.transfer.backend
    # tcp/nccl: where decode replicas listen; a wildcard advertises each node's own IP.
    receiver_endpoint = {
        "host": config.transfer.bind_host,
        "advertise_host": config.transfer.advertise_host,
    }

    def bind(server: type, pool: PoolConfig, **role_args: Any) -> Any:
        """`server` (a pool's deployment class) bound for `pool`: what both roles take,
        then `role_args`."""
        return (
            _deployment(server)
            .options(**_options(pool))
            .bind(
                config.engine_config(pool),
                backend,
                options,
                pool=pool.name,
                observers=(replica_metrics_factory(config, pool),),
                telemetry=telemetry,
                cpu_affinity=pool.cpu_affinity,
                per_rank=config.per_rank_transfer(pool),
                **role_args,
            )
        )

    prefill = {
        pool.name: bind(
            PrefillServer,
            pool,
            source_host=config.transfer.source_host,
            serves_decode=pool.serves_decode,
        )
        for pool in config.pools_by_role("prefill")
    }
    decode = {
        pool.name: bind(
            DecodeServer,
            pool,
            deadline_s=config.transfer.deadline_s,
            breaker=config.overload.breaker.to_settings(),
            # The fallback pool runs its own model: it prefills every prompt itself.
            prefill_pools={} if pool.fallback else prefill,
            receiver_endpoint=receiver_endpoint,
            calls=SERVE_CALLS,
            local_prefill_threshold=config.local_prefill_threshold,
        )
        for pool in config.pools_by_role("decode")
    }
    ingress = _deployment(Ingress).options(
        name=INGRESS_DEPLOYMENT,  # how the handle API tells pdserve from other apps
        num_replicas=config.ingress.num_replicas,
        ray_actor_options={"num_cpus": config.ingress.num_cpus},
        max_ongoing_requests=1000,
        # Past this many HTTP requests queued for an ingress replica, Serve's proxy answers 503.
        max_queued_requests=INGRESS_MAX_QUEUED_REQUESTS,
        # The ingress relays every stream: on a redeploy it drains as long as the pools do.
        graceful_shutdown_timeout_s=max(pool.drain_timeout_s for pool in config.pools),
        graceful_shutdown_wait_loop_s=min(pool.drain_poll_s for pool in config.pools),
    )
    quotas = tenant_quotas(config.tenants)
    # Every ingress replica draws on this one replica's state (app/admission/quota_service.py).
    quota_service = (
        _deployment(QuotaService).options(**QUOTA_SERVICE_OPTIONS).bind(quotas) if quotas else None
    )
    return ingress.bind(
        config.model_dump(mode="json"), decode, prefill, quota_service=quota_service
    )


# Registered after Ray's own atexit handler, so it runs first: the torch and engine modules
# imported here make the exit of `serve run app.main:app`'s driver outlast the abort Ray
# arms on SIGTERM, and the replicas of its cluster die without unlinking their KV segments
# (app/driver_exit.py).
atexit.register(exit_cleanly)
# `serve run app.main:app` imports this before it starts Ray: the cluster it starts here
# (Serve's controller and proxies included) runs at the cadence of `app/serve/cadence.py`.
set_defaults()
app = build_app()
