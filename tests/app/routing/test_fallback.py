"""The fallback model (app/routing/fallback.py): config rules, the decision, the build check,
and `Frontend.prepare` moving a degradable request to the fallback pool when it is shed or
its prefill pool's breaker is open on its decode pool (what decode replicas publish as
`prefill_breakers`, from `decode/breaker.py`).

Shedding is driven by real pool load in `replica.placement.pool_view` (what the replica
routers publish), with the built-in tiny model as both the primary and the fallback model.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app.admission.controller import decode_pool_blocks
from app.config import ConfigError, PDServeConfig, load_config
from app.errors import ServiceUnavailableError
from app.frontend import Frontend
from app.routing.fallback import (
    TRIGGER_BACKPRESSURE,
    TRIGGER_BREAKER,
    TRIGGER_SHED,
    FallbackModel,
    FallbackPolicy,
    breaker_open,
    check_fallback_model,
    fallback_model_config,
)
from app.routing.pool_router import RouteDecision, RouterPolicy
from decode.breaker import BreakerBoard, BreakerSettings, PrefillPlanner
from engine.builtin import write_builtin_model
from engine.loader import load_model_config
from engine.request import SamplingParams
from replica.placement import PoolSnapshot, pool_view

FALLBACK = {"name": "degraded", "role": "decode", "fallback": True, "num_cpus": 0.5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


def args(model: str = "tiny", **extra: Any) -> dict[str, Any]:
    """Prefill `prefill`, decode `decode`, fallback `degraded` (model `model`), and two
    classes: `batch` degradable, `strict` not; both with a TTFT SLO nothing can meet."""
    return {
        "model": {"model": model, "dtype": "float32"},
        "pools": [
            {"name": "prefill", "role": "prefill"},
            {"name": "decode", "role": "decode"},
            {**FALLBACK, "model": {"model": model, "served_model_name": "fallback-tiny"}},
        ],
        "admission": {
            "classes": [
                {"name": "batch", "ttft_s": 0.001, "tpot_s": 1, "priority": 10, "degradable": True},
                {"name": "strict", "ttft_s": 0.001, "tpot_s": 1, "priority": 10},
            ]
        },
        **extra,
    }


# ---- config --------------------------------------------------------------------------


def test_fallback_pool_runs_its_own_model_and_is_never_the_primary_decode_pool() -> None:
    config = PDServeConfig.model_validate(
        args(tenants=[{"name": "acme", "api_keys": ["k1"], "default_class": "batch"}])
    )
    fallback = config.fallback_pool
    assert fallback is not None and fallback.name == "degraded"
    engine = config.engine_config(fallback)
    assert engine.model_dir == "tiny" and engine.dtype is None  # its own model settings
    assert config.engine_config(config.pools[1]).dtype == "float32"
    route = RouterPolicy(config).route(100, "acme")
    assert route.decode_pool == "decode"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a["pools"][2].pop("model"), "must have role 'decode' and its own `model`"),
        (lambda a: a["pools"][2].update(role="prefill"), "must have role 'decode'"),
        (
            lambda a: a["pools"][1].update(model={"model": "tiny"}),
            "only a fallback pool (fallback: true) has its own `model`",
        ),
        (
            lambda a: a["pools"].append({**a["pools"][2], "name": "other"}),
            "at most one pool may set fallback: true (got degraded, other)",
        ),
        (lambda a: a["pools"].pop(1), "at least one pool must have role 'decode' (and not be"),
        (
            lambda a: a["pools"].pop(2),
            "admission.classes batch are degradable, but no pool sets fallback: true",
        ),
        (
            lambda a: a.update(
                tenants=[{"name": "t", "api_keys": ["k"], "allowed_pools": ["prefill", "degraded"]}]
            ),
            "tenant 't': allowed_pools has no decode pool (the fallback pool serves only",
        ),
        (lambda a: a["pools"][2].update(fallback="maybe"), "valid boolean"),
    ],
)
def test_invalid_fallback_configs_are_refused_clearly(change: Any, message: str) -> None:
    document = args()
    change(document)
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PDServeConfig.model_validate(document)


def test_check_fallback_model_loads_it_and_compares_vocabularies(
    model_dir: Path, tmp_path: Path
) -> None:
    check_fallback_model(PDServeConfig.model_validate(args(str(model_dir))))
    without = {"model": {"model": "absent"}, "pools": [{"name": "d", "role": "decode"}]}
    check_fallback_model(PDServeConfig.model_validate({**without, "local_prefill_threshold": 9999}))

    missing = args(str(model_dir))
    missing["pools"][2]["model"]["model"] = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match="fallback pool 'degraded': model .* does not load"):
        check_fallback_model(PDServeConfig.model_validate(missing))

    other = tmp_path / "other-vocab"
    shutil.copytree(model_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    different = args(str(model_dir))
    different["pools"][2]["model"]["model"] = str(other)
    with pytest.raises(ConfigError, match="different tokenizer vocabulary"):
        check_fallback_model(PDServeConfig.model_validate(different))


def test_kv_share_counts_the_fallback_pool_with_its_own_model(model_dir: Path) -> None:
    document = args(str(model_dir))
    document["pools"][2]["model"]["dtype"] = "bfloat16"
    config = PDServeConfig.model_validate(document)
    primary = load_model_config(str(model_dir), "float32")
    fallback = fallback_model_config(config)
    assert fallback is not None
    blocks = decode_pool_blocks(config, primary, fallback)
    assert set(blocks) == {"decode", "degraded"}
    assert blocks["degraded"] == 2 * blocks["decode"]  # same budget, half the bytes per token


# ---- the decision --------------------------------------------------------------------

MODEL = FallbackModel("degraded", "fallback-tiny", max_model_len=100, vocab_size=300)


def policy(allowed: dict[str, bool] | None = None) -> FallbackPolicy:
    return FallbackPolicy(["batch"], MODEL, allowed or {"acme": True, "globex": False})


def test_degradable_class_goes_to_the_fallback_pool_with_a_reason() -> None:
    decision = policy().decide("acme", "batch", 40, 20, (5,), TRIGGER_SHED)
    assert decision.served and decision.pool == "degraded"
    assert decision.served_model_name == "fallback-tiny"
    assert decision.reason == (
        "shed: degradable class batch -> fallback pool degraded (model fallback-tiny)"
    )
    route = RouteDecision("prefill", "decode", False, 10, "len 40 -> pool prefill")
    moved = decision.reroute(route)
    assert moved == RouteDecision(None, "degraded", True, 10, f"{route.reason}; {decision.reason}")


@pytest.mark.parametrize(
    ("tenant", "slo_class", "num_prompt", "max_tokens", "stop", "why"),
    [
        ("acme", "strict", 40, 20, (), "class strict is not degradable"),
        ("globex", "batch", 40, 20, (), "tenant 'globex' may not use fallback pool degraded"),
        ("acme", "batch", 90, 20, (), "exceed the fallback model's context of 100 tokens"),
        ("acme", "batch", 40, 20, (300,), "outside the fallback model's vocabulary"),
    ],
)
def test_refused_when_class_tenant_or_size_do_not_allow(
    tenant: str, slo_class: str, num_prompt: int, max_tokens: int, stop: tuple[int, ...], why: str
) -> None:
    decision = policy().decide(
        tenant, slo_class, num_prompt, max_tokens, stop, TRIGGER_BACKPRESSURE
    )
    assert not decision.served and why in decision.reason
    assert decision.trigger == TRIGGER_BACKPRESSURE


def test_no_fallback_pool_refuses_everything() -> None:
    decision = FallbackPolicy(["batch"], None, {}).decide("", "batch", 1, 1, (), TRIGGER_SHED)
    assert not decision.served and decision.reason == "no fallback pool"


def test_tenants_allowed_pools_decide_who_may_be_degraded() -> None:
    config = PDServeConfig.model_validate(
        args(
            tenants=[
                {"name": "open", "api_keys": ["k1"]},  # every pool
                {
                    "name": "listed",
                    "api_keys": ["k2"],
                    "allowed_pools": ["prefill", "decode", "degraded"],
                },
                {"name": "unlisted", "api_keys": ["k3"], "allowed_pools": ["prefill", "decode"]},
            ]
        )
    )
    fallback = FallbackPolicy.from_config(config, fallback_model_config(config))
    served = {
        t: fallback.decide(t, "batch", 10, 10, (), TRIGGER_SHED).served
        for t in ("open", "listed", "unlisted")
    }
    assert served == {"open": True, "listed": True, "unlisted": False}


# ---- the frontend: a shed degradable request is prepared for the fallback pool ---------


def _acme_batch_preparer(model_dir: Path) -> tuple[Frontend, Callable[[str | None], Any]]:
    """A Frontend and `prepare(slo_class)`: its prepared request for tenant acme (default
    class batch) with a prompt long enough for the prefill pool."""
    config = load_config(
        args(
            str(model_dir),
            tenants=[{"name": "acme", "api_keys": ["k"], "default_class": "batch"}],
        )
    )
    front = Frontend(config, {})

    async def prepare(slo_class: str | None) -> Any:
        ids = await front.tokenize_prompt("a prompt for the prefill pool, long enough " * 2)
        return front.prepare(
            front.authenticate("k"), ids, SamplingParams(max_tokens=4), slo_class=slo_class
        )

    return front, lambda slo_class: asyncio.run(prepare(slo_class))


@pytest.fixture
def loaded_prefill_pool() -> Iterator[None]:
    """The prefill pool as its router would publish it: measured, with work queued."""
    pool_view.update(
        "prefill", [("prefill-0", {"queued_tokens": 500, "prefill_tokens_per_s": 100})]
    )
    yield
    pool_view.update("prefill", [])


def test_prepare_moves_shed_degradable_requests_to_the_fallback(
    model_dir: Path, loaded_prefill_pool: None
) -> None:
    front, prepare = _acme_batch_preparer(model_dir)

    prepared = prepare(None)
    assert prepared.route.decode_pool == "degraded" and prepared.route.local_prefill
    assert prepared.served.fallback is not None and prepared.served.route == prepared.route
    assert "shed" in prepared.route.reason and "-> fallback pool degraded" in prepared.route.reason
    assert front.served_model(prepared) == "fallback-tiny"
    assert front.routing_report()["recent"] == []  # recorded when it runs, like any request

    with pytest.raises(ServiceUnavailableError) as refused:
        prepare("strict")
    assert refused.value.code == "overloaded"
    [record] = front.routing_report()["recent"]
    assert record["shed"] == "overloaded" and "fallback" not in record


# ---- open breakers: what decode replicas publish, what the ingress makes of it ------------


def test_decode_replicas_publish_pools_cut_off_by_their_breakers() -> None:
    now = [0.0]
    board = BreakerBoard(BreakerSettings(failure_threshold=1, cooldown_s=10), lambda: now[0])
    known = {"short": ["p0", "p1"], "long": ["q0"]}
    planner = PrefillPlanner(board, known.get)
    board.record("short", "p0", ok=False)  # one replica of two open: the pool still serves
    board.record("long", None, ok=True)
    assert planner.blocked_pools() == {}
    board.record("short", "p1", ok=False)  # every known replica open
    board.record("long", None, ok=False)  # the pool's own breaker
    assert planner.blocked_pools() == {"short": "open", "long": "open"}
    now[0] = 10.0  # cool-down over: each lets a probe through
    assert planner.blocked_pools() == {"short": "half_open", "long": "half_open"}
    board.record("short", "p0", ok=True)
    board.record("long", "q0", ok=True)
    assert planner.blocked_pools() == {}


def snapshot(*breakers: dict[str, str] | None, updated_at: float = 100.0) -> PoolSnapshot:
    replicas = {
        f"decode-{i}": {"queued_tokens": 0} if b is None else {"prefill_breakers": b}
        for i, b in enumerate(breakers)
    }
    return PoolSnapshot(replicas, updated_at)


@pytest.mark.parametrize(
    ("view", "now", "is_open"),
    [
        (snapshot({"prefill": "open"}, {"prefill": "open"}), 101.0, True),
        (snapshot({"prefill": "open"}, {}), 101.0, False),  # one replica still sends there
        (snapshot({"prefill": "half_open"}), 101.0, False),  # it probes
        (snapshot({"other": "open"}), 101.0, False),
        (snapshot(None), 101.0, False),  # a replica that publishes nothing
        (snapshot({"prefill": "open"}), 200.0, False),  # stale
        (snapshot(), 101.0, False),  # no replica
        (None, 101.0, False),
    ],
)
def test_breaker_open_only_when_every_fresh_decode_replica_says_so(
    view: PoolSnapshot | None, now: float, is_open: bool
) -> None:
    why = breaker_open(view, "decode", "prefill", max_age_s=5.0, now=now)
    assert (why is not None) == is_open
    if why is not None:
        assert why == "breaker of prefill pool prefill open on decode pool decode"


@pytest.fixture
def open_breaker_on_decode_pool() -> Iterator[None]:
    """The decode pool as its router would publish it: the prefill pool's breaker open."""
    pool_view.update("prefill", [])  # no measured prefill load: nothing is shed
    pool_view.update("decode", [("decode-0", {"prefill_breakers": {"prefill": "open"}})])
    yield
    pool_view.update("decode", [])


def test_prepare_moves_degradable_requests_off_an_open_breaker(
    model_dir: Path, open_breaker_on_decode_pool: None
) -> None:
    front, prepare = _acme_batch_preparer(model_dir)

    prepared = prepare(None)
    fallback = prepared.served.fallback
    assert fallback is not None and fallback.trigger == TRIGGER_BREAKER
    assert prepared.route.decode_pool == "degraded" and prepared.route.local_prefill
    assert "breaker of prefill pool prefill open on decode pool decode" in prepared.route.reason
    assert "breaker: degradable class batch -> fallback pool degraded" in prepared.route.reason

    # Not degradable: it stays on its decode pool (which prefills it locally), not refused.
    strict = prepare("strict")
    assert strict.served.fallback is None
    assert strict.route.decode_pool == "decode" and strict.route.prefill_pool == "prefill"
