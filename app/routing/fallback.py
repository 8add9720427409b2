"""Fallback model: serve a degradable request on the fallback pool instead of refusing it.

A pool marked `fallback: true` is a decode pool with its own `model` that prefills every
prompt itself (it never receives KV from the prefill pools, whose model differs). The router
never picks it. It steps in when the primary path would refuse a request as overloaded:

- `TRIGGER_SHED`: the request's predicted TTFT on its prefill pool is over its class's limit
  (`app/admission/shedding.py`), decided in `Frontend.prepare`;
- `TRIGGER_BACKPRESSURE`: its decode pool's queue is full (Serve's `BackPressureError`,
  the pool's `max_queued_requests`) before any token was streamed, in `Frontend.run`;
- `TRIGGER_BREAKER`: every replica of its decode pool reports its prefill pool's circuit
  breaker open (`prefill_breakers` in their routing stats, `decode/breaker.py`), so the
  prompt would be prefilled on the decode replica instead (`breaker_open`, read in
  `Frontend.prepare` from `replica.placement.pool_view`). A non-degradable request goes on
  as before (prefilled locally by its decode replica): nothing is refused for this trigger.

`FallbackPolicy.decide` then serves the request on the fallback pool when all of these hold,
and otherwise the request is refused as it would have been (503 `overloaded`):

1. its SLO class is `degradable`;
2. its tenant may use the fallback pool (`allowed_pools` empty, or naming it): a tenant is
   never sent to a pool outside its `allowed_pools`, fallback or not;
3. its prompt plus `max_tokens` fit the fallback model's context, and its stop token ids
   the fallback model's vocabulary.

The ingress tokenizes once, with the primary model's tokenizer, so the fallback model must
use the same vocabulary (`check_fallback_model`, run by `build_app` before any replica
starts). A request served by the fallback carries `x-pdserve-fallback: <pool>` and
`x-pdserve-model: <its served model name>`, and its body's `model` is that name.
Pure: no Ray, no I/O (except `check_fallback_model`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.config import ConfigError, PDServeConfig
from app.routing.pool_router import RouteDecision
from app.serve import calls as serve_calls
from engine.builtin import resolve_model_dir
from engine.config import ModelConfig
from engine.loader import load_model_config, load_tokenizer
from replica.placement import PoolSnapshot

if TYPE_CHECKING:
    from app.prepared import PreparedRequest

TRIGGER_SHED = "shed"
TRIGGER_BACKPRESSURE = "backpressure"
TRIGGER_BREAKER = "breaker"
FALLBACK_HEADER = "x-pdserve-fallback"
MODEL_HEADER = "x-pdserve-model"


@dataclass(frozen=True, slots=True)
class FallbackModel:
    """What the ingress needs to know of the fallback pool's model."""

    pool: str
    served_model_name: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class FallbackDecision:
    """The outcome of one `decide`: `pool` serves the request (None: refused), and why."""

    pool: str | None
    trigger: str
    reason: str
    served_model_name: str | None = None

    @property
    def served(self) -> bool:
        return self.pool is not None

    def reroute(self, route: RouteDecision) -> RouteDecision:
        """`route` moved to the fallback pool (prefilled there), its reason extended."""
        assert self.pool is not None
        return RouteDecision(
            prefill_pool=None,
            decode_pool=self.pool,
            local_prefill=True,
            priority=route.priority,
            reason=f"{route.reason}; {self.reason}",
        )


@dataclass(slots=True)
class Served:
    """Which pool's model answers a request: set once if the fallback takes it over (at
    `prepare`, or in `run` before any token), read by the ingress for headers and `model`."""

    fallback: FallbackDecision | None = None
    route: RouteDecision | None = None  # the route to the fallback pool

    def model_name(self, primary: str) -> str:
        """The model name the response carries: the fallback's if it served, else `primary`."""
        if self.fallback is not None and self.fallback.served_model_name is not None:
            return self.fallback.served_model_name
        return primary


class FallbackPolicy:
    """Decides whether an overloaded request is served by the fallback pool (see above)."""

    def __init__(
        self,
        degradable_classes: Collection[str],
        model: FallbackModel | None,
        tenants_allowed: dict[str, bool],
    ) -> None:
        """`tenants_allowed`: tenant -> whether it may use the fallback pool (a tenant not
        named may: the anonymous tenant of a config without tenants)."""
        self._degradable = frozenset(degradable_classes)
        self.model = model
        self._tenants_allowed = dict(tenants_allowed)

    @classmethod
    def from_config(cls, config: PDServeConfig, model_config: ModelConfig | None) -> FallbackPolicy:
        """The policy of `config`; `model_config`: its fallback pool's model (None: none)."""
        pool = config.fallback_pool
        model = None
        if pool is not None:
            assert model_config is not None, "the fallback pool's model config is needed"
            settings = config.model_settings(pool)
            model = FallbackModel(
                pool.name,
                settings.served_model_name or settings.model,
                model_config.max_model_len,
                model_config.vocab_size,
            )
        allowed = {
            t.name: pool is not None and (not t.allowed_pools or pool.name in t.allowed_pools)
            for t in config.tenants
        }
        degradable = [c.name for c in config.admission.classes if c.degradable]
        return cls(degradable, model, allowed)

    def decide(
        self,
        tenant: str,
        slo_class: str,
        num_prompt_tokens: int,
        max_tokens: int,
        stop_token_ids: Collection[int],
        trigger: str,
    ) -> FallbackDecision:
        """Whether a request the primary path refuses for `trigger` goes to the fallback."""
        model = self.model
        if model is None:
            return FallbackDecision(None, trigger, "no fallback pool")
        if slo_class not in self._degradable:
            return FallbackDecision(None, trigger, f"class {slo_class} is not degradable")
        if not self._tenants_allowed.get(tenant, True):
            return FallbackDecision(
                None, trigger, f"tenant {tenant!r} may not use fallback pool {model.pool}"
            )
        if num_prompt_tokens + max_tokens > model.max_model_len:
            return FallbackDecision(
                None,
                trigger,
                f"prompt + max_tokens ({num_prompt_tokens} + {max_tokens}) exceed the fallback "
                f"model's context of {model.max_model_len} tokens",
            )
        if any(not 0 <= token_id < model.vocab_size for token_id in stop_token_ids):
            return FallbackDecision(
                None, trigger, "a stop token id is outside the fallback model's vocabulary"
            )
        reason = (
            f"{trigger}: degradable class {slo_class} -> fallback pool {model.pool} "
            f"(model {model.served_model_name})"
        )
        return FallbackDecision(model.pool, trigger, reason, model.served_model_name)

    def move(self, prepared: PreparedRequest, trigger: str) -> PreparedRequest | None:
        """`prepared` moved to the fallback pool (its `served` says so) when `decide` allows
        and it is not there already; None: refuse it as the primary path would."""
        if prepared.served.fallback is not None:
            return None
        decision = self.decide(
            prepared.tenant,
            prepared.service_class.name,
            len(prepared.prompt_token_ids),
            prepared.sampling_params.max_tokens,
            prepared.sampling_params.stop_token_ids,
            trigger,
        )
        if not decision.served:
            return None
        route = decision.reroute(prepared.route)
        prepared.served.fallback, prepared.served.route = decision, route
        return dataclasses.replace(prepared, route=route)


def is_backpressure(error: BaseException) -> bool:
    """True for the 503 the frontend makes of Serve's `BackPressureError` (a pool's queue is
    full), which it raises from that error."""
    cause = error.__cause__
    return cause is not None and serve_calls.is_backpressure(cause)


def breaker_open(
    snapshot: PoolSnapshot | None, decode_pool: str, prefill_pool: str, max_age_s: float, now: float
) -> str | None:
    """Why `prefill_pool` is cut off on `decode_pool` (`snapshot`: its view, `now` on the
    same monotonic clock): every replica reports the pool's breaker `open`. None when any
    replica does not (closed, or half-open: it probes), or without data fresher than
    `max_age_s`."""
    if snapshot is None or not snapshot.replicas or now - snapshot.updated_at > max_age_s:
        return None
    for stats in snapshot.replicas.values():
        breakers = stats.get("prefill_breakers")
        if not isinstance(breakers, Mapping) or breakers.get(prefill_pool) != "open":
            return None
    return f"breaker of prefill pool {prefill_pool} open on decode pool {decode_pool}"


def fallback_model_config(config: PDServeConfig) -> ModelConfig | None:
    """The fallback pool's model config (read from its directory); None: no fallback pool."""
    pool = config.fallback_pool
    if pool is None:
        return None
    settings = config.model_settings(pool)
    return load_model_config(str(resolve_model_dir(settings.model)), settings.dtype)


def check_fallback_model(config: PDServeConfig) -> None:
    """Raise `ConfigError` unless the fallback model loads and shares the primary model's
    vocabulary (the ingress tokenizes once, for both). No fallback pool: nothing to check."""
    pool = config.fallback_pool
    if pool is None:
        return
    fallback = config.model_settings(pool)
    try:
        fallback_dir = str(resolve_model_dir(fallback.model))
        load_model_config(fallback_dir, fallback.dtype)
        fallback_vocab = load_tokenizer(fallback_dir).get_vocab()
    except Exception as exc:  # noqa: BLE001 - any failure to load is the config's problem
        raise ConfigError(
            f"fallback pool {pool.name!r}: model {fallback.model!r} does not load: {exc}"
        ) from exc
    primary_vocab = load_tokenizer(str(resolve_model_dir(config.model.model))).get_vocab()
    if fallback_vocab != primary_vocab:
        raise ConfigError(
            f"fallback pool {pool.name!r}: model {fallback.model!r} has a different tokenizer "
            f"vocabulary from model {config.model.model!r} ({len(fallback_vocab)} vs "
            f"{len(primary_vocab)} entries); the ingress tokenizes once, so both must share it"
        )
