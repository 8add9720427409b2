"""Router policy: which pools serve a request, decided from its prompt length and tenant.

A pure class (no Ray, no I/O) that the ingress consults once per request. Replica choice
inside a pool is Serve's business; this only picks the pools. Its errors are `app.errors`
API errors, so the ingress's error handlers turn them into OpenAI-style responses as is.

Rules, in order:

1. Unknown tenant -> `UnknownTenantError` (401); authentication comes first.
2. An empty prompt -> `BadRequestError` (400); `num_prompt_tokens > limits.max_prompt_tokens`
   -> `PromptTooLongError` (400 `context_length_exceeded`, as OpenAI answers).
3. Decode pool: the first decode pool, in config order, that the tenant may use; never the
   fallback pool (`app/routing/fallback.py` moves overloaded requests there).
4. `num_prompt_tokens < local_prefill_threshold` -> no prefill pool: the decode replica
   prefills the prompt itself (`local_prefill=True`). At or above it, the ingress may still
   prefill locally when the prefill pool is the slower of the two (adaptive disaggregation,
   `app/routing/adaptive.py`, applied to this decision).
5. Otherwise the *primary* prefill pool is the first pool, in config order, whose context
   range contains the length. If the tenant may use it, it is chosen. If not, the request
   falls back to the first prefill pool the tenant may use whose range also contains the
   length (pools may overlap). If there is none -> `NoRouteError` (403): a tenant is never
   silently sent to a pool outside its `allowed_pools`, nor prefilled locally above the
   threshold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from app.config import PDServeConfig, PoolConfig, TenantConfig
from app.errors import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    PermissionDeniedError,
)

ANONYMOUS_TENANT = ""


class UnknownTenantError(AuthenticationError):
    """401: missing or unknown API key, or an unknown tenant name."""


class NoRouteError(PermissionDeniedError):
    """403: the tenant may not use any pool that can serve this request."""


class PromptTooLongError(ContextLengthExceededError):
    """400 `context_length_exceeded` (OpenAI's answer): prompt over `max_prompt_tokens`."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where one request goes. `prefill_pool` is None exactly when `local_prefill` is True."""

    prefill_pool: str | None
    decode_pool: str
    local_prefill: bool
    priority: int  # lower is more important (the tenant's priority)
    reason: str  # human-readable, for logs and span attributes
    # Where the prompt is expected to compute and how many of its tokens, when a cached
    # prefix changes that (decode overflow); None: all of it where the route says.
    computes: tuple[str, int] | None = None

    def prefilled_locally(self, why: str) -> RouteDecision:
        """This route with its prompt computed on its decode pool (no prefill call, ticket
        or KV transfer), `why` added to its reason; itself when it already is."""
        if self.local_prefill:
            return self
        return dataclasses.replace(
            self,
            prefill_pool=None,
            local_prefill=True,
            computes=None,
            reason=f"{self.reason}; {why}",
        )


@dataclass(frozen=True, slots=True)
class _TenantRoutes:
    """A tenant's precomputed view of the pools."""

    priority: int
    decode_pool: str
    prefill_pools: frozenset[str]


class RouterPolicy:
    """Places requests on pools by context length and tenant (see the module docstring)."""

    def __init__(self, config: PDServeConfig) -> None:
        self._config = config
        self._max_prompt_tokens = config.limits.max_prompt_tokens
        self._threshold = config.local_prefill_threshold
        self._prefill_pools: list[PoolConfig] = config.pools_by_role("prefill")
        self._tenants: dict[str, TenantConfig] = {t.name: t for t in config.tenants}
        self._tenant_by_key = config.resolve_tenant_keys()
        self._admin_keys = config.resolve_admin_keys()
        names = list(self._tenants) if config.tenants else [ANONYMOUS_TENANT]
        self._routes = {name: self._tenant_routes(name) for name in names}

    def _tenant_routes(self, tenant: str) -> _TenantRoutes:
        allowed = self._config.allowed_pools(tenant)
        decode = [pool.name for pool in allowed if pool.role == "decode" and not pool.fallback]
        assert decode, "config validation guarantees every tenant a decode pool"
        entry = self._tenants.get(tenant)
        return _TenantRoutes(
            priority=entry.priority if entry is not None else 0,
            decode_pool=decode[0],
            prefill_pools=frozenset(pool.name for pool in allowed if pool.role == "prefill"),
        )

    @property
    def requires_api_key(self) -> bool:
        """True when tenants are configured (requests must carry a known API key)."""
        return bool(self._tenants)

    def is_admin_key(self, api_key: str | None) -> bool:
        """True for a configured admin key."""
        return api_key is not None and api_key in self._admin_keys

    def tenant_for_key(self, api_key: str | None) -> str:
        """The tenant owning `api_key`; "" for everyone when no tenants are configured."""
        if not self._tenants:
            return ANONYMOUS_TENANT
        if not api_key:
            raise UnknownTenantError("missing API key")
        tenant = self._tenant_by_key.get(api_key)
        if tenant is None:
            raise UnknownTenantError("invalid API key")
        return tenant

    def tenant_config(self, tenant: str) -> TenantConfig | None:
        """The tenant's config (quota, priority), or None for the anonymous tenant."""
        if tenant not in self._routes:
            raise UnknownTenantError(f"unknown tenant {tenant!r}")
        return self._tenants.get(tenant)

    def route(self, num_prompt_tokens: int, tenant: str) -> RouteDecision:
        """Pick the prefill and decode pools for a prompt of `num_prompt_tokens` tokens."""
        routes = self._routes.get(tenant)
        if routes is None:
            raise UnknownTenantError(f"unknown tenant {tenant!r}")
        if num_prompt_tokens < 1:
            raise BadRequestError("the prompt is empty", code="empty_prompt")
        if num_prompt_tokens > self._max_prompt_tokens:
            raise PromptTooLongError(
                f"prompt has {num_prompt_tokens} tokens; the limit is {self._max_prompt_tokens}"
            )
        decode = routes.decode_pool
        if num_prompt_tokens < self._threshold:
            return RouteDecision(
                prefill_pool=None,
                decode_pool=decode,
                local_prefill=True,
                priority=routes.priority,
                reason=f"len {num_prompt_tokens} < local_prefill_threshold {self._threshold}"
                f" -> local prefill on decode pool {decode}",
            )
        covering = [pool for pool in self._prefill_pools if _contains(pool, num_prompt_tokens)]
        # Config validation guarantees coverage of every length in threshold..max_prompt_tokens.
        assert covering, f"no prefill pool covers length {num_prompt_tokens}"
        primary = covering[0]
        allowed = [pool for pool in covering if pool.name in routes.prefill_pools]
        if not allowed:
            raise NoRouteError(
                f"tenant {tenant!r} may not use prefill pool {primary.name!r}, which serves "
                f"prompts of {num_prompt_tokens} tokens, and no pool it may use covers that "
                "length"
            )
        chosen = allowed[0]
        reason = f"len {num_prompt_tokens} in {_fmt(chosen)} -> pool {chosen.name}"
        if chosen is not primary:
            reason += f" (fallback: tenant {tenant!r} may not use pool {primary.name})"
        return RouteDecision(
            prefill_pool=chosen.name,
            decode_pool=decode,
            local_prefill=False,
            priority=routes.priority,
            reason=f"{reason}, decode pool {decode}",
        )


def _contains(pool: PoolConfig, num_tokens: int) -> bool:
    low, high = pool.context_range
    return low <= num_tokens <= high


def _fmt(pool: PoolConfig) -> str:
    low, high = pool.context_range
    return f"[{low}, {'inf' if high == float('inf') else high}]"
