"""Adaptive disaggregation: the decision on constructed pool loads, its hysteresis, the
route it rewrites, its config, and the decode replica's measured prefill rate."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from app.admission.shedding import ReplicaLoad
from app.config import AdaptivePrefillSettings, PDServeConfig, load_config
from app.errors import ServiceUnavailableError
from app.frontend import Frontend
from app.routing.adaptive import AdaptivePrefill, DecodeLoad, choose_prefill, local_cost_s
from app.routing.pool_router import RouteDecision
from decode.server import DecodeServer
from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from engine.request import SamplingParams
from replica.engine_replica import PrefillRate
from replica.placement import PoolView, pool_view
from replica.protocol import GenerationSpec
from tests.app.routing.conftest import Caches

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
P = 400  # prompt tokens of the request being placed
RATE = 4000.0  # tokens/s of every replica below: a lone prompt takes 0.1 s

IDLE_PREFILL = [ReplicaLoad(0, RATE)]
SATURATED_PREFILL = [ReplicaLoad(40_000, RATE)]  # 10 s of queued prompts
IDLE_DECODE = [DecodeLoad(0, RATE, 0)]


def settings(**overrides: Any) -> AdaptivePrefillSettings:
    return AdaptivePrefillSettings(**overrides)


# ---- the decision ----------------------------------------------------------------------


def test_idle_prefill_pool_goes_remote() -> None:
    choice = choose_prefill(settings(), P, IDLE_PREFILL, IDLE_DECODE)
    assert choice.local is False
    assert choice.remote_wait_s == pytest.approx(0.1)
    assert choice.local_cost_s == pytest.approx(0.1)
    assert "-> remote prefill" in choice.reason


def test_saturated_prefill_pool_and_idle_decode_goes_local() -> None:
    choice = choose_prefill(settings(), P, SATURATED_PREFILL, IDLE_DECODE)
    assert choice.local is True
    assert choice.remote_wait_s == pytest.approx(10.1)
    assert choice.local_cost_s == pytest.approx(0.1)
    assert "predicted wait 10.100 s remote, local cost 0.100 s -> local prefill" in choice.reason


def test_the_best_replica_of_each_pool_counts() -> None:
    prefill = [ReplicaLoad(40_000, RATE), ReplicaLoad(0, RATE)]  # one idle replica
    assert choose_prefill(settings(), P, prefill, IDLE_DECODE).local is False
    decode = [DecodeLoad(400_000, RATE, 8), DecodeLoad(0, RATE, 0)]
    assert choose_prefill(settings(), P, SATURATED_PREFILL, decode).local is True


@pytest.mark.parametrize(
    ("prefill", "decode", "why"),
    [
        (None, IDLE_DECODE, "no recent load of the prefill pool"),
        ([ReplicaLoad(40_000, 0.0)], IDLE_DECODE, "prefill pool has no measured rate"),
        (SATURATED_PREFILL, None, "no recent load of the decode pool"),
        (SATURATED_PREFILL, [DecodeLoad(0, 0.0, 0)], "decode pool has no measured rate"),
    ],
)
def test_missing_data_leaves_the_static_rule(
    prefill: list[ReplicaLoad] | None, decode: list[DecodeLoad] | None, why: str
) -> None:
    choice = choose_prefill(settings(), P, prefill, decode)
    assert choice.local is None
    assert why in choice.reason and "static rule" in choice.reason


def test_borrowed_rate_stands_in_for_an_unmeasured_decode_replica() -> None:
    unmeasured = [DecodeLoad(0, 0.0, 0)]
    choice = choose_prefill(settings(borrow_prefill_rate=True), P, SATURATED_PREFILL, unmeasured)
    assert choice.local is True
    assert choice.local_cost_s == pytest.approx(P / RATE)


def test_long_prompts_always_go_remote() -> None:
    choice = choose_prefill(
        settings(max_local_prompt_tokens=P - 1), P, SATURATED_PREFILL, IDLE_DECODE
    )
    assert choice.local is False
    assert f"len {P} > max_local_prompt_tokens {P - 1}" in choice.reason


def test_running_sequences_make_local_prefill_dearer() -> None:
    busy = DecodeLoad(0, RATE, 3)
    assert local_cost_s(busy, P, RATE, 1.0) == pytest.approx(0.2)  # wait + one stall
    assert local_cost_s(busy, P, RATE, 0.0) == pytest.approx(0.1)
    assert local_cost_s(DecodeLoad(4000, RATE, 0), P, RATE, 1.0) == pytest.approx(1.1)
    # A 0.15 s remote wait beats the 0.2 s a busy replica would cost, not an idle one's 0.1 s.
    prefill = [ReplicaLoad(200, RATE)]
    tight = settings(margin=0.1, min_gain_s=0.0)
    assert choose_prefill(tight, P, prefill, [busy]).local is False
    assert choose_prefill(tight, P, prefill, IDLE_DECODE).local is True


def test_min_gain_keeps_tiny_savings_remote() -> None:
    prefill = [ReplicaLoad(400, RATE)]  # 0.2 s remote vs 0.1 s local: 2x, but 0.1 s saved
    assert choose_prefill(settings(min_gain_s=0.0), P, prefill, IDLE_DECODE).local is True
    assert choose_prefill(settings(min_gain_s=0.5), P, prefill, IDLE_DECODE).local is False


def test_hysteresis_does_not_flap_near_the_boundary() -> None:
    config = settings(margin=0.2, min_gain_s=0.0)
    # Remote wait 0.1 s x w against a local cost of 0.1 s, with w swinging across 1.
    walk = [0.9, 1.1, 1.3, 1.1, 1.05, 1.15, 0.95, 1.1, 1.15, 1.25, 1.0]
    was_local = False
    decisions = []
    for w in walk:
        queued = (w - 1) * P  # remote wait = (queued + P) / RATE = 0.1 x w
        prefill = [ReplicaLoad(queued, RATE)]
        choice = choose_prefill(config, P, prefill, IDLE_DECODE, was_local)
        assert choice.local is not None
        was_local = choice.local
        decisions.append(was_local)
    # Local only above 1.2, back to remote at 1 or below; in between the last choice holds.
    assert decisions == [False, False, True, True, True, True, False, False, False, True, False]


# ---- the route -------------------------------------------------------------------------


class Loads:
    """Pool loads as the ingress's replica routers publish them (a real `PoolView`), read
    `age` seconds after the latest was published: the clock stands still otherwise, so a
    slow machine's real seconds between two calls never count (a probe due at 10.0 s must
    not come at 9.9 because the test ran 0.1 s late)."""

    def __init__(self) -> None:
        self.view = PoolView()
        self.age = 0.0
        self.published_at = time.monotonic()

    def publish(self, pool: str, *replicas: dict[str, Any]) -> None:
        self.view.update(pool, [(f"{pool}-{i}", stats) for i, stats in enumerate(replicas)])
        self.published_at = time.monotonic()

    def adaptive(self, threshold: int = 0, **overrides: Any) -> AdaptivePrefill:
        """`threshold`: the decode replicas' `local_prefill_threshold`."""
        return AdaptivePrefill(settings(**overrides), self.view.get, self.clock, threshold)

    def clock(self) -> float:
        return self.published_at + self.age


REMOTE = RouteDecision(
    prefill_pool="prefill",
    decode_pool="decode",
    local_prefill=False,
    priority=0,
    reason="len 400 in [32, 4096] -> pool prefill, decode pool decode",
)


def prefill_stats(queued: int, rate: float = RATE, **extra: Any) -> dict[str, Any]:
    return {"queued_tokens": queued, "prefill_tokens_per_s": rate, **extra}


def decode_stats(queued: int = 0, rate: float = RATE, running: int = 0) -> dict[str, Any]:
    return {"queued_tokens": queued, "prefill_tokens_per_s": rate, "num_running": running}


def test_apply_rewrites_the_route_and_says_why() -> None:
    loads = Loads()
    loads.publish("prefill", prefill_stats(40_000))
    loads.publish("decode", decode_stats())
    route = loads.adaptive().apply(REMOTE, P, priority=0)
    assert route.local_prefill and route.prefill_pool is None
    assert route.decode_pool == "decode"
    assert route.reason.startswith(REMOTE.reason + "; adaptive (prefill vs decode): ")
    assert route.reason.endswith("-> local prefill")

    loads.publish("prefill", prefill_stats(0))
    route = loads.adaptive().apply(REMOTE, P, priority=0)
    assert not route.local_prefill and route.prefill_pool == "prefill"
    assert route.reason.endswith("-> remote prefill")


def test_apply_leaves_static_routes_on_missing_or_stale_data() -> None:
    loads = Loads()
    adaptive = loads.adaptive(max_age_s=5.0)
    route = adaptive.apply(REMOTE, P, priority=0)  # no pool seen yet
    assert route.prefill_pool == "prefill"
    assert "no recent load of the prefill pool: static rule" in route.reason

    loads.publish("prefill", prefill_stats(40_000))
    loads.publish("decode", decode_stats())
    loads.age = 6.0  # both snapshots are 6 s old
    route = adaptive.apply(REMOTE, P, priority=0)
    assert route.prefill_pool == "prefill" and "static rule" in route.reason


def test_apply_keeps_disabled_and_local_routes() -> None:
    loads = Loads()
    loads.publish("prefill", prefill_stats(40_000))
    loads.publish("decode", decode_stats())
    assert loads.adaptive(enabled=False).apply(REMOTE, P, priority=0) == REMOTE
    local = RouteDecision(None, "decode", True, 0, "len 10 < local_prefill_threshold 32")
    assert loads.adaptive().apply(local, 10, priority=0) == local


def test_a_burst_is_split_between_the_pools() -> None:
    """Within one stats period the tokens sent each way count as queued there: a burst on
    a backed-up prefill pool goes local only until the decode replica is as far behind."""
    loads = Loads()
    loads.publish("prefill", prefill_stats(4000))  # 1.1 s for the next prompt
    loads.publish("decode", decode_stats())
    adaptive = loads.adaptive(margin=0.0, min_gain_s=0.0)
    loads.age = 0.5  # the same snapshots for the whole burst
    local = [adaptive.apply(REMOTE, P, priority=0).local_prefill for _ in range(20)]
    # The decode replica takes prompts until its queue (10 x 400 tokens) matches the pool's.
    assert local[:10] == [True] * 10 and not all(local), local


def test_higher_priority_sees_only_the_work_ahead_of_it() -> None:
    loads = Loads()
    by_priority = {"0": 0, "10": 40_000}  # a batch flood behind an empty interactive queue
    loads.publish("prefill", prefill_stats(40_000, pending_tokens_by_priority=by_priority))
    loads.publish("decode", decode_stats())
    assert not loads.adaptive().apply(REMOTE, P, priority=0).local_prefill
    assert loads.adaptive().apply(REMOTE, P, priority=10).local_prefill


def test_an_idle_prefill_pool_judged_by_a_stale_rate_gets_a_probe() -> None:
    """A rate measured across a stall (here 100 tokens/s on an empty queue) would keep every
    prompt local for good: one prompt per probe interval goes remote to re-measure it."""
    loads = Loads()
    loads.publish("prefill", prefill_stats(0, rate=100.0))
    loads.publish("decode", decode_stats())
    adaptive = loads.adaptive(probe_interval_s=10.0, max_age_s=100.0)

    def route_at(age: float) -> RouteDecision:
        loads.age = age
        return adaptive.apply(REMOTE, P, priority=0)

    assert [route_at(t).local_prefill for t in (0.0, 5.0, 9.9)] == [True] * 3
    probe = route_at(10.0)
    assert not probe.local_prefill and probe.prefill_pool == "prefill"
    assert "probe: an idle prefill replica, no prompt sent for 10.0 s -> remote" in probe.reason
    # The probe's tokens count as queued there until the next snapshot: no second probe.
    assert [route_at(t).local_prefill for t in (10.1, 25.0)] == [True, True]


def test_no_probe_while_the_prefill_pool_is_busy_or_probing_is_off() -> None:
    loads = Loads()
    loads.publish("prefill", prefill_stats(40_000))  # its queue re-measures its rate
    loads.publish("decode", decode_stats())
    busy = loads.adaptive(probe_interval_s=10.0, max_age_s=100.0)
    loads.publish("prefill", prefill_stats(0, rate=100.0))
    off = loads.adaptive(probe_interval_s=0.0, max_age_s=100.0)
    for age in (0.0, 30.0, 60.0):
        loads.age = age
        assert off.apply(REMOTE, P, priority=0).local_prefill
    loads.publish("prefill", prefill_stats(40_000))
    for age in (0.0, 30.0, 60.0):
        loads.age = age
        assert busy.apply(REMOTE, P, priority=0).local_prefill


def test_each_side_weighs_only_what_it_would_compute(caches: Caches) -> None:
    """A chat turn resends its history: the side caching it computes only the rest."""
    history, turn = list(range(100, 612)), list(range(100, 812))  # 32 blocks, 200 new tokens
    loads = Loads()
    loads.publish("prefill", prefill_stats(0))  # an idle prefill pool
    loads.publish("decode", decode_stats(running=4))

    def place() -> RouteDecision:
        adaptive = loads.adaptive(threshold=128, margin=0.0, min_gain_s=0.0)
        return adaptive.apply(REMOTE, len(turn), 0, turn, "acme")

    assert not place().local_prefill  # 0.178 s remote vs 0.178 s local + a 0.178 s stall
    caches.hold("decode", history, "globex")  # another tenant's blocks are not the turn's
    assert not place().local_prefill
    caches.hold("decode", history, "acme")
    local = place()  # 0.178 s remote vs 0.05 s + a 0.05 s stall for the 200 new tokens
    assert local.local_prefill
    assert "local cost 0.100 s (computing 712 there, 200 here) -> local prefill" in local.reason
    caches.hold("prefill", turn, "acme")  # the prefill replica holds all but 8 tokens
    remote = place()
    assert not remote.local_prefill
    assert "wait 0.002 s remote, local cost 0.100 s (computing 8 there, 200 here)" in remote.reason


def test_a_short_suffix_after_a_cached_history_is_counted_where_it_computes(
    caches: Caches,
) -> None:
    """The decode replica computes a suffix shorter than `local_prefill_threshold` itself
    (`decode/server.py`): no choice to make, and only the suffix counts as sent there."""
    history, turn = list(range(100, 612)), list(range(100, 708))  # 96 new tokens
    loads = Loads()
    loads.publish("prefill", prefill_stats(40_000))  # the prefill pool is 10 s behind
    loads.publish("decode", decode_stats())
    adaptive = loads.adaptive(threshold=128, margin=0.0, min_gain_s=0.0)
    caches.hold("decode", history, "")
    for _ in range(10):
        route = adaptive.apply(REMOTE, len(turn), 0, turn, "")
        assert route.prefill_pool == "prefill" and not route.local_prefill
        assert route.reason.endswith("caches 512 tokens, computes the 96-token suffix itself")
    # A new prompt's local cost counts the 10 suffixes (960 tokens) ahead of it, not 6,080.
    first = adaptive.apply(REMOTE, P, 0, list(range(2000, 2400)), "")
    assert "local cost 0.340 s -> local prefill" in first.reason


class NeverCalled:
    """A decode pool's handle for requests that are only placed, never run."""

    def options(self, **_: Any) -> NeverCalled:
        return self


def test_a_turn_whose_suffix_decode_computes_is_not_shed_for_the_prefill_pool(
    caches: Caches, tmp_path: Path
) -> None:
    """Load shedding weighs the pool that computes the prompt: a backed-up prefill pool
    refuses a new prompt it would compute, not a chat turn whose history the decode replica
    caches and whose suffix it computes itself."""
    model_dir = write_builtin_model(tmp_path / "tiny", "tiny")
    pools = [{"name": "shed-prefill", "role": "prefill"}, {"name": "shed-decode", "role": "decode"}]
    config = load_config(
        {"model": {"model": str(model_dir)}, "pools": pools, "local_prefill_threshold": 64}
    )
    front = Frontend(config, {"shed-decode": NeverCalled()})
    # 1000 s of prompts queued on the prefill pool; no local rate measured on decode yet
    pool_view.update("shed-prefill", [("p0", prefill_stats(1_000_000, rate=1000.0))])
    pool_view.update("shed-decode", [("d0", decode_stats(rate=0.0))])
    history = [i % 256 for i in range(512)]
    fresh = [(7 * i) % 256 for i in range(532)]
    with pytest.raises(ServiceUnavailableError) as refused:
        front.prepare(front.authenticate(None), fresh, SamplingParams(max_tokens=4))
    assert refused.value.code == "overloaded"
    caches.hold("shed-decode", history, "")
    turn = front.prepare(front.authenticate(None), [*history, *[9] * 20], SamplingParams())
    assert turn.route.computes == ("shed-decode", 20)
    assert "shed-decode caches 512 tokens, computes the 20-token suffix itself" in turn.route.reason


# ---- config ----------------------------------------------------------------------------


def _config(**adaptive: Any) -> PDServeConfig:
    return PDServeConfig.model_validate(
        {
            "pools": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}],
            "adaptive_prefill": adaptive,
        }
    )


def test_adaptive_is_the_default() -> None:
    config = _config()
    assert config.adaptive_prefill.enabled
    assert 0 < config.adaptive_prefill.margin < 1


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("margin", 1.0, "less than 1"),
        ("margin", -0.1, "greater than or equal to 0"),
        ("local_cost_factor", -1, "greater than or equal to 0"),
        ("max_local_prompt_tokens", 0, "greater than or equal to 1"),
        ("max_age_s", 0, "greater than 0"),
        ("min_gain_s", float("inf"), "finite number"),
        ("enable", True, "Extra inputs are not permitted"),
    ],
)
def test_bad_settings_are_refused_clearly(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        _config(**{field: value})
    assert f"adaptive_prefill.{field}" in str(info.value)


def test_benchmark_configs() -> None:
    """cpu-disagg measures static disaggregation; cpu-adaptive is the same app with the
    adaptive rule on for prompts of any admitted length, its prefill replica serving whole
    requests (decode overflow), chat turns (under 128 tokens) prefilled where they
    decode, and outputs of at most 16 tokens served whole where less is in flight."""
    disagg = load_config(CONFIGS / "cpu-disagg.yaml")
    adaptive = load_config(CONFIGS / "cpu-adaptive.yaml")
    assert not disagg.adaptive_prefill.enabled
    assert adaptive.adaptive_prefill.enabled
    assert [p.serves_decode for p in adaptive.pools] == [True, False]
    assert [p.serves_decode for p in disagg.pools] == [False, False]
    assert (adaptive.local_prefill_threshold, disagg.local_prefill_threshold) == (128, 32)
    # any prompt the app admits may be prefilled locally when that is cheaper (long-context)
    assert adaptive.adaptive_prefill.max_local_prompt_tokens == adaptive.limits.max_prompt_tokens
    assert adaptive.adaptive_prefill.serve_whole_max_output_tokens == 16

    def rest(config: PDServeConfig) -> dict[str, Any]:
        dumped = config.model_dump()
        for pool in dumped["pools"]:
            del pool["serves_decode"], pool["max_ongoing_requests"]
        return {
            k: v
            for k, v in dumped.items()
            if k not in ("adaptive_prefill", "local_prefill_threshold")
        }

    assert rest(adaptive) == rest(disagg)
    with open(CONFIGS / "cpu-adaptive.yaml", encoding="utf-8") as f:
        assert yaml.safe_load(f)["applications"][0]["import_path"] == "app.main:build_app"


# ---- the decode replica's rate -----------------------------------------------------------


def test_prefill_rate_is_windowed_and_then_kept() -> None:
    rate = PrefillRate()
    assert rate.tokens_per_s(now=0.0) == 0.0
    rate.add(400, 0.9, 1.0)
    rate.add(0, 0.9, 1.0)  # nothing computed (all cached): no sample
    rate.add(200, 1.9, 2.0)
    assert rate.tokens_per_s(now=2.0) == pytest.approx(3000.0)
    assert rate.tokens_per_s(now=1000.0) == pytest.approx(3000.0)  # window empty: kept
    rate.add(100, 1000.9, 1001.0)
    assert rate.tokens_per_s(now=1001.0) == pytest.approx(1000.0)


def test_decode_replica_publishes_its_local_prefill_rate(tmp_path: Path) -> None:
    """A real decode server (no prefill pool: every prompt is local) reports the rate of the
    prompts it prefilled, and a report counter that makes every report differ."""
    model_dir = write_builtin_model(tmp_path / "tiny", "tiny")
    decode = DecodeServer(EngineConfig(model_dir=str(model_dir)), backend="shm")
    try:
        idle = asyncio.run(decode.record_routing_stats())
        assert idle["prefill_tokens_per_s"] == 0.0
        spec = GenerationSpec(
            request_id="r0",
            prompt_token_ids=tuple(decode.engine.tokenize("a prompt of some forty tokens, " * 2)),
            sampling_params=SamplingParams(max_tokens=4, temperature=0.0),
        )

        async def run() -> int:
            return sum([len(delta.new_token_ids) async for delta in decode.generate(spec)])

        assert asyncio.run(run()) == 4
        busy = asyncio.run(decode.record_routing_stats())
        assert busy["prefill_tokens_per_s"] > 0
        assert busy["num_reports"] == idle["num_reports"] + 1
        assert DecodeLoad.from_stats(busy).tokens_per_s == busy["prefill_tokens_per_s"]
    finally:
        decode.shutdown()
