"""Decode overflow: a prefill pool with `serves_decode` takes whole requests while the
decode pool is busier. The decision on constructed loads, the route it rewrites, its
config, and a real prefill replica serving a whole request token-identical to a decode
replica."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app.admission.controller import decode_pool_blocks
from app.config import PDServeConfig
from app.routing.history import History
from app.routing.overflow import DecodeOverflow, OverflowChoice, choose_overflow
from app.routing.pool_router import RouteDecision
from decode.server import DecodeServer
from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from engine.loader import load_model_config
from engine.request import SamplingParams
from prefill.server import PrefillServer
from replica.placement import PoolView
from replica.protocol import GenerationSpec
from replica.signals import MIN_BUSY_SPAN_S, SIGNAL_WINDOW_S
from tests.app.routing.conftest import Caches

SETTLE_TIMEOUT_S = 10.0

# ---- the decision ----------------------------------------------------------------------


def test_busier_decode_pool_overflows_to_the_least_loaded_candidate() -> None:
    choice = choose_overflow(6.0, {"prefill": 1.0, "prefill-long": 0.0}, gap=2)
    assert choice.pool == "prefill-long"
    assert choice.reason == (
        "decode overflow: decode load 6.0 on decode vs 0.0 on prefill-long -> served "
        "whole on prefill-long"
    )


@pytest.mark.parametrize(("decode", "candidate", "moved"), [(3, 1, True), (2.9, 1, False)])
def test_the_gap_is_inclusive(decode: float, candidate: float, moved: bool) -> None:
    choice = choose_overflow(decode, {"prefill": candidate}, gap=2)
    assert (choice.pool == "prefill") is moved
    if not moved:
        assert "decode not above by 2, route stands" in choice.reason


@pytest.mark.parametrize(("decode", "candidate", "moved"), [(1.0, 1.0, False), (1.1, 1.0, True)])
def test_gap_zero_joins_the_shorter_queue_and_a_tie_stays(
    decode: float, candidate: float, moved: bool
) -> None:
    choice = choose_overflow(decode, {"prefill": candidate}, gap=0)
    assert (choice.pool == "prefill") is moved
    if not moved:
        assert choice.reason.endswith("decode not above, route stands")


def test_no_candidate_leaves_the_route() -> None:
    choice = choose_overflow(10.0, {}, gap=1)
    assert choice.pool is None and "no prefill pool that serves decode" in choice.reason


def test_pools_busy_with_prompts_are_no_candidates() -> None:
    choice = choose_overflow(10.0, {"prefill": None, "prefill-long": 1.0}, gap=1)
    assert choice.pool == "prefill-long"
    choice = choose_overflow(10.0, {"prefill": None}, gap=1)
    assert choice == OverflowChoice(None, "prefill pools prefill busy with prompts: route stands")


def history(prefill: int = 0, decode: int = 0, num_tokens: int = 600, least: int = 0) -> History:
    return History({"prefill": prefill}, decode, num_tokens, least)


def test_a_conversation_follows_the_side_caching_its_history() -> None:
    """Within the prefix margin (4 sequences, or half the smaller load) the side caching more
    of the prompt takes it, whichever the load rule would pick; past it the load decides."""
    moved = choose_overflow(2.0, {"prefill": 5.0}, 0, history(prefill=512))
    assert moved.pool == "prefill"
    assert moved.reason == (
        "prefix cached: 512 on prefill vs 0 on decode tokens, decode load 5.0 on prefill vs "
        "2.0 on decode -> served whole on prefill"
    )
    stays = choose_overflow(5.0, {"prefill": 1.0}, 0, history(prefill=16, decode=64))
    assert stays.pool is None and stays.reason.endswith("route stands")
    assert stays.reason.startswith("prefix cached: 16 on prefill vs 64 on decode tokens")
    # past the margin: 2 + max(4, 1) = 6 < 6.5, and 20 > 10 + max(4, 5)
    assert choose_overflow(2.0, {"prefill": 6.5}, 0, history(prefill=512)).pool is None
    past = choose_overflow(20.0, {"prefill": 10.0}, 0, history(decode=512))
    assert past.pool == "prefill" and past.reason.startswith("decode overflow")
    # equal caches: the load rule
    even = choose_overflow(3.0, {"prefill": 1.0}, 0, history(prefill=64, decode=64))
    assert even.pool == "prefill" and even.reason.startswith("decode overflow")


def test_a_prefix_is_followed_only_when_the_other_side_lacks_much() -> None:
    """What the other side lacks must be at least `local_prefill_threshold` tokens: a
    repeated short prompt, or a turn both sides hold but for its last answer, is cheap to
    compute anywhere, and the load decides."""
    short = choose_overflow(9.1, {"prefill": 7.1}, 2, history(decode=16, num_tokens=18, least=32))
    assert short.pool == "prefill" and short.reason.startswith("decode overflow")
    answer = history(prefill=512, decode=544, num_tokens=608, least=128)  # 96 < 128 lacking
    assert choose_overflow(9.1, {"prefill": 7.1}, 2, answer).pool == "prefill"
    stale = history(prefill=704, decode=544, num_tokens=712, least=128)  # 168 lacking
    followed = choose_overflow(2.0, {"prefill": 3.0}, 2, stale)
    assert followed.pool == "prefill" and followed.reason.startswith("prefix cached")


def test_a_pool_busy_with_prompts_is_not_followed_for_its_prefix() -> None:
    choice = choose_overflow(1.0, {"prefill": None}, 0, history(prefill=512))
    assert choice.pool is None and "busy with prompts" in choice.reason


# ---- the route -------------------------------------------------------------------------


def config(serves_decode: bool = True, **extra: Any) -> PDServeConfig:
    return PDServeConfig.model_validate(
        {
            "pools": [
                {"name": "prefill", "role": "prefill", "serves_decode": serves_decode},
                {"name": "decode", "role": "decode"},
            ],
            **extra,
        }
    )


class Loads:
    """Pool loads as the ingress's replica routers publish them (a real `PoolView`), read
    `age` seconds after they were published."""

    def __init__(self) -> None:
        self.view = PoolView()
        self.age = 0.0

    def publish(
        self,
        pool: str,
        *sequences: int,
        prompt_busy: float = 0.0,
        queued_tokens: int = 0,
        prefill_tokens_per_s: float = 0.0,
    ) -> None:
        stats = [
            {
                "num_sequences": n,
                "prompt_busy": prompt_busy,
                "queued_tokens": queued_tokens,
                "prefill_tokens_per_s": prefill_tokens_per_s,
            }
            for n in sequences
        ]
        self.view.update(pool, [(f"{pool}-{i}", s) for i, s in enumerate(stats)])

    def overflow(self, cfg: PDServeConfig | None = None) -> DecodeOverflow:
        return DecodeOverflow(cfg or config(), self.view.get, clock=self.clock)

    def clock(self) -> float:
        return time.monotonic() + self.age


LOCAL = RouteDecision(None, "decode", True, 0, "len 40 < local_prefill_threshold 64")
REMOTE = RouteDecision("prefill", "decode", False, 0, "len 900 in [64, inf] -> pool prefill")


def test_apply_moves_the_whole_request_and_says_why() -> None:
    loads = Loads()
    loads.publish("decode", 5)
    loads.publish("prefill", 1)
    for route in (LOCAL, REMOTE):
        moved = loads.overflow().apply(route, 40, "")
        assert moved.decode_pool == "prefill"
        assert moved.local_prefill and moved.prefill_pool is None
        assert moved.reason == (
            f"{route.reason}; decode overflow: decode load 6.0 on decode vs 2.0 on prefill "
            "-> served whole on prefill"
        )


SHORT = {"adaptive_prefill": {"serve_whole_max_output_tokens": 16}}


def test_a_short_output_is_served_whole_where_less_is_in_flight() -> None:
    """With `serve_whole_max_output_tokens`, a request asking for that few tokens goes whole
    to the pool with fewer prompt tokens to compute, then fewer requests in flight, whatever
    the route said: to the prefill pool from a local route, to the decode pool (prefilled
    there) from a remote one. Ties take turns."""
    loads = Loads()
    overflow = loads.overflow(config(**SHORT))
    loads.publish("decode", 1, queued_tokens=900)
    loads.publish("prefill", 3)
    route = overflow.apply(LOCAL, 40, "", max_tokens=16)
    assert route == RouteDecision(
        None,
        "prefill",
        True,
        0,
        f"{LOCAL.reason}; short output: max_tokens 16 <= 16, per replica 0 tokens, 3.0 "
        "requests on prefill, 900 tokens, 1.0 requests on decode -> served whole on prefill",
    )
    loads.publish("decode", 1)
    loads.publish("prefill", 3)
    route = overflow.apply(REMOTE, 900, "", max_tokens=16)
    assert route == RouteDecision(
        None,
        "decode",
        True,
        0,
        f"{REMOTE.reason}; short output: max_tokens 16 <= 16, per replica 0 tokens, 3.0 "
        "requests on prefill, 0 tokens, 1.0 requests on decode -> served whole on decode",
    )
    loads.publish("decode", 2)
    loads.publish("prefill", 2)
    tied = [overflow.apply(REMOTE, 900, "", max_tokens=1) for _ in range(2)]
    assert {r.decode_pool for r in tied} == {"prefill", "decode"}, [r.reason for r in tied]
    assert all(r.prefill_pool is None and r.local_prefill for r in tied)


def test_longer_outputs_and_the_setting_off_leave_short_output_placement_out() -> None:
    loads = Loads()
    loads.publish("decode", 1)
    loads.publish("prefill", 3)
    assert loads.overflow(config(**SHORT)).apply(REMOTE, 900, "", max_tokens=17) == (
        dataclasses.replace(
            REMOTE,
            reason=f"{REMOTE.reason}; decode load 2.0 on decode vs 4.0 on prefill: decode "
            "not above by 2, route stands",
        )
    )
    assert loads.overflow().apply(REMOTE, 900, "", max_tokens=1).prefill_pool == "prefill"
    unserving = config(serves_decode=False, **SHORT)
    assert loads.overflow(unserving).apply(REMOTE, 900, "", max_tokens=1) == REMOTE


def test_short_outputs_spread_as_they_are_sent() -> None:
    """Each short output counts where it went until the next snapshot, so a burst
    alternates between the pools as two colocated replicas would take it."""
    loads = Loads()
    loads.publish("decode", 0)
    loads.publish("prefill", 0)
    overflow = loads.overflow(config(**SHORT))
    pools = [overflow.apply(REMOTE, 900, "", max_tokens=16).decode_pool for _ in range(6)]
    assert sorted(pools) == ["decode"] * 3 + ["prefill"] * 3
    assert all(pools[i] != pools[i + 1] for i in range(0, 6, 2)), pools


def test_a_short_output_counts_what_the_ingress_has_running_and_computing() -> None:
    """A snapshot older than this ingress's own streams and prompts cannot hide them."""
    loads = Loads()
    loads.publish("decode", 0)
    loads.publish("prefill", 0)
    overflow = loads.overflow(config(**SHORT))
    overflow.started("prefill", 2)
    route = overflow.apply(REMOTE, 900, "", max_tokens=16)
    assert route.decode_pool == "decode", route.reason
    assert "0 tokens, 2.0 requests on prefill, 0 tokens, 0.0 requests on decode" in route.reason
    overflow.prompt_started("decode", 3000)  # its prompt computes there now
    route = overflow.apply(REMOTE, 900, "", max_tokens=16)
    assert route.decode_pool == "prefill", route.reason
    assert "3000 tokens, 1.0 requests on decode" in route.reason


def test_a_short_output_before_the_first_stats_is_placed_on_this_ingress_figures() -> None:
    """Before either pool has reported, each reads as this ingress's own: its prompt tokens
    computing there, then its streams there."""
    loads = Loads()
    overflow = loads.overflow(config(**SHORT))
    overflow.started("decode", 2)
    route = overflow.apply(REMOTE, 900, "", max_tokens=16)
    assert route.decode_pool == "prefill" and route.prefill_pool is None, route.reason
    assert "0 tokens, 0.0 requests on prefill, 0 tokens, 2.0 requests on decode" in route.reason
    overflow.prompt_started("prefill", 700)
    assert overflow.apply(REMOTE, 900, "", max_tokens=16).decode_pool == "decode"


def test_a_short_output_on_stale_loads_is_left_to_the_rules() -> None:
    """The decode pool's load is stale (its replicas stopped answering): the placement does
    not guess; the route stands as the overflow rule says."""
    loads = Loads()
    loads.publish("decode", 0)
    loads.publish("prefill", 0)
    loads.age = 6.0  # older than adaptive_prefill.max_age_s (5 s)
    overflow = loads.overflow(config(**SHORT))
    assert overflow.apply(REMOTE, 900, "", max_tokens=16) == dataclasses.replace(
        REMOTE, reason=f"{REMOTE.reason}; no recent load of decode pool decode"
    )


def test_a_prompt_too_long_to_prefill_locally_chooses_among_prefill_pools() -> None:
    """Over `max_local_prompt_tokens` the decode pool is no candidate: the short output
    goes whole to the serving prefill pool with fewer requests in flight."""
    cfg = PDServeConfig.model_validate(
        {
            "pools": [
                {"name": "prefill", "role": "prefill", "serves_decode": True},
                {"name": "prefill-b", "role": "prefill", "serves_decode": True},
                {"name": "decode", "role": "decode"},
            ],
            "adaptive_prefill": {
                "serve_whole_max_output_tokens": 16,
                "max_local_prompt_tokens": 512,
            },
        }
    )
    loads = Loads()
    loads.publish("decode", 0)
    loads.publish("prefill", 4)
    loads.publish("prefill-b", 2)
    route = loads.overflow(cfg).apply(REMOTE, 900, "", max_tokens=16)
    assert route.decode_pool == "prefill-b" and route.prefill_pool is None, route.reason
    assert route.reason.endswith(
        "per replica 0 tokens, 4.0 requests on prefill, 0 tokens, 2.0 requests on prefill-b "
        "-> served whole on prefill-b"
    )
    route = loads.overflow(cfg).apply(REMOTE, 500, "", max_tokens=16)
    assert route.decode_pool == "decode", route.reason


def test_apply_keeps_the_route_while_decode_has_room() -> None:
    loads = Loads()
    loads.publish("decode", 2, 7)  # the least loaded decode replica counts
    loads.publish("prefill", 1)
    route = loads.overflow().apply(REMOTE, 900, "")
    assert route.prefill_pool == "prefill" and route.decode_pool == "decode"
    assert route.reason.endswith("2.0 on prefill: decode not above by 2, route stands")


def test_apply_serves_a_turn_where_its_history_is_cached(caches: Caches) -> None:
    history = list(range(100, 612))  # 32 blocks
    turn = history + list(range(700, 900))  # 200 new tokens
    cfg = config(local_prefill_threshold=128)  # a decode replica computes suffixes below
    loads = Loads()
    loads.publish("decode", 1)
    loads.publish("prefill", 3)  # the load rule alone keeps it on decode
    assert loads.overflow(cfg).apply(REMOTE, len(turn), "", prompt_token_ids=turn).decode_pool == (
        "decode"
    )
    caches.hold("prefill", history, "acme")  # another tenant's blocks hash differently
    other = loads.overflow(cfg).apply(REMOTE, len(turn), "", prompt_token_ids=turn)
    assert other.decode_pool == "decode"
    caches.hold("prefill", history, "")
    moved = loads.overflow(cfg).apply(REMOTE, len(turn), "", prompt_token_ids=turn)
    assert moved.decode_pool == "prefill" and moved.local_prefill
    assert "prefix cached: 512 on prefill vs 0 on decode tokens" in moved.reason
    assert moved.computes == ("prefill", 200)  # only the new suffix computes there
    # the decode pool caching more keeps the turn, though the prefill replica is idler
    loads.publish("decode", 3)
    loads.publish("prefill", 1)
    caches.hold("decode", turn, "")
    kept = loads.overflow(cfg).apply(REMOTE, len(turn), "", prompt_token_ids=turn)
    assert kept.decode_pool == "decode" and kept.prefill_pool == "prefill"
    assert "prefix cached: 512 on prefill vs 704 on decode tokens" in kept.reason
    # the decode replica lacks 8 tokens: they compute there, nothing on the prefill pool
    assert kept.computes == ("decode", 8)
    caches.hold("decode", [], "")  # evicted there: back to the replica holding most
    back = loads.overflow(cfg).apply(REMOTE, len(turn), "", prompt_token_ids=turn)
    assert back.decode_pool == "prefill" and back.computes == ("prefill", 200)


def test_before_the_first_stats_a_pool_reads_as_this_ingress_own_streams() -> None:
    """A fresh deployment: no router has reported either pool yet. Each reads as its
    configured replicas holding what this ingress has running there, so a burst spreads
    over both pools instead of all standing on the decode pool; the prompt gate counts the
    tokens this ingress has computing on the prefill pool (no rate is known yet)."""
    loads = Loads()
    overflow = loads.overflow(config(adaptive_prefill={"decode_overflow_gap": 0}))
    tie = overflow.apply(REMOTE, 900, "")
    assert tie.decode_pool == "decode" and tie.prefill_pool == "prefill", tie.reason
    assert tie.reason.endswith(
        "decode load 1.0 on decode vs 1.0 on prefill: decode not above, route stands"
    )
    overflow.started("decode", 1)
    overflow.prompt_started("prefill", 900)  # its prompt computes on the prefill replica
    busy = overflow.apply(REMOTE, 900, "")
    assert busy.decode_pool == "decode", busy.reason
    assert busy.reason.endswith("prefill pools prefill busy with prompts: route stands")
    overflow.prompt_computed("prefill", 900)  # its first token came back
    moved = overflow.apply(REMOTE, 900, "")
    assert moved.decode_pool == "prefill" and moved.prefill_pool is None, moved.reason
    assert "decode load 2.0 on decode vs 1.0 on prefill -> served whole on prefill" in moved.reason
    # two decode replicas share this ingress's streams there
    two = PDServeConfig.model_validate(
        {
            "pools": [
                {"name": "prefill", "role": "prefill", "serves_decode": True},
                {"name": "decode", "role": "decode", "num_replicas": 2},
            ],
            "adaptive_prefill": {"decode_overflow_gap": 0},
        }
    )
    spread = loads.overflow(two)
    spread.started("decode", 1)
    route = spread.apply(REMOTE, 900, "")
    assert "decode load 1.5 on decode vs 1.0 on prefill -> served whole" in route.reason
    # replicas known to the router without stats yet count as unreported, their number known
    loads.view.update("decode", [("decode-0", {}), ("decode-1", {}), ("decode-2", {})])
    route = spread.apply(REMOTE, 900, "")
    assert "decode load 1.3 on decode vs 1.0 on prefill" in route.reason
    # still unreported max_age_s (5 s) after the first look: its replicas never answered
    loads.age = 5.5
    assert spread.apply(REMOTE, 900, "") == dataclasses.replace(
        REMOTE, reason=f"{REMOTE.reason}; no recent load of decode pool decode"
    )


def test_a_pool_without_running_replicas_or_that_lost_its_stats_gets_no_whole_requests() -> None:
    """Only a pool that has not reported yet reads as this ingress's own figures: one whose
    router knows no replica (none is running), or one that reported and then lost its stats
    (its replicas replaced), leaves the route standing."""
    loads = Loads()
    loads.publish("decode", 6)
    loads.view.update("prefill", [])  # no running replica
    overflow = loads.overflow()
    assert "no prefill pool that serves decode" in overflow.apply(LOCAL, 40, "").reason
    loads.publish("prefill", 0)
    assert overflow.apply(LOCAL, 40, "").decode_pool == "prefill"
    loads.view.update("prefill", [("prefill-new", {})])  # replaced, no stats yet
    assert "no prefill pool that serves decode" in overflow.apply(LOCAL, 40, "").reason


def test_an_autoscaled_pool_before_its_first_stats_counts_its_minimum() -> None:
    cfg = PDServeConfig.model_validate(
        {
            "pools": [
                {"name": "prefill", "role": "prefill", "serves_decode": True},
                {
                    "name": "decode",
                    "role": "decode",
                    "autoscaling": {"min_replicas": 2, "max_replicas": 4},
                },
            ],
            "adaptive_prefill": {"decode_overflow_gap": 0},
        }
    )
    overflow = Loads().overflow(cfg)
    overflow.started("decode", 1)
    route = overflow.apply(REMOTE, 900, "")
    assert "decode load 1.5 on decode vs 1.0 on prefill" in route.reason


def test_apply_leaves_routes_on_stale_loads() -> None:
    loads = Loads()
    overflow = loads.overflow()
    loads.publish("decode", 9)
    # the prefill pool has not reported yet: it reads as this ingress's own figures (idle)
    assert overflow.apply(LOCAL, 40, "").reason.endswith(
        "decode load 10.0 on decode vs 1.0 on prefill -> served whole on prefill"
    )
    loads.publish("prefill", 0)
    loads.age = 6.0  # older than adaptive_prefill.max_age_s (5 s)
    route = overflow.apply(LOCAL, 40, "")
    assert route == RouteDecision(
        None, "decode", True, 0, f"{LOCAL.reason}; no recent load of decode pool decode"
    )


def test_a_prefill_replica_busy_with_prompts_keeps_to_them() -> None:
    """Over `decode_overflow_max_prompt_busy` (0.5) of its recent time computing prompts, a
    prefill replica takes no whole request (they would stall behind each prompt)."""
    loads = Loads()
    loads.publish("decode", 6)
    loads.publish("prefill", 0, prompt_busy=0.6)
    route = loads.overflow().apply(LOCAL, 40, "")
    assert route.decode_pool == "decode"
    assert route.reason.endswith("prefill pools prefill busy with prompts: route stands")
    loads.publish("prefill", 0, prompt_busy=0.25)
    assert loads.overflow().apply(LOCAL, 40, "").decode_pool == "prefill"
    loads.view.update(
        "prefill",
        [
            ("prefill-0", {"num_sequences": 0, "prompt_busy": 0.9}),
            ("prefill-1", {"num_sequences": 3, "prompt_busy": 0.1}),  # the idle one counts
        ],
    )
    route = loads.overflow().apply(LOCAL, 40, "")
    assert route.decode_pool == "prefill" and "4.4 on prefill" in route.reason  # 4 / 0.9


def test_no_whole_request_while_a_long_prompt_computes_there() -> None:
    """A whole request landing while a long prompt computes would wait for it and stall at
    its chunks: over `decode_overflow_max_prompt_tokens` (256) computing per replica, sent by
    this ingress (until the first output) or reported queued, the pool takes none."""
    loads = Loads()
    loads.publish("decode", 6)
    loads.publish("prefill", 0)
    overflow = loads.overflow()
    overflow.prompt_started("prefill", 2048)  # a document this ingress sent to be prefilled
    route = overflow.apply(LOCAL, 40, "")
    assert route.decode_pool == "decode"
    assert route.reason.endswith("prefill pools prefill busy with prompts: route stands")
    overflow.prompt_computed("prefill", 2048)  # its first token came back
    overflow.prompt_started("prefill", 256)  # chat turns up to the limit share the replica
    assert overflow.computing("prefill") == 256
    assert overflow.apply(LOCAL, 40, "").decode_pool == "prefill"
    overflow.prompt_computed("prefill", 256)
    overflow.prompt_computed("prefill", 256)  # more than was started never goes below zero
    assert overflow.computing("prefill") == 0
    loads.publish("decode", 6)
    loads.publish("prefill", 0, queued_tokens=300)  # another ingress's document, reported
    assert overflow.apply(LOCAL, 40, "").decode_pool == "decode"
    loads.view.update(
        "prefill",
        [
            ("prefill-0", {"num_sequences": 0, "prompt_busy": 0.0, "queued_tokens": 4000}),
            ("prefill-1", {"num_sequences": 2, "prompt_busy": 0.0, "queued_tokens": 0}),
        ],
    )
    route = overflow.apply(LOCAL, 40, "")  # the free replica counts, at its load of 3
    assert route.decode_pool == "prefill" and "3.0 on prefill" in route.reason
    overflow.prompt_started("prefill", 600)  # 300 per replica: over the limit
    assert overflow.apply(LOCAL, 40, "").decode_pool == "decode"


def test_the_prompt_token_limit_is_configurable() -> None:
    loads = Loads()
    loads.publish("decode", 6)
    loads.publish("prefill", 0)
    cfg = config(adaptive_prefill={"decode_overflow_max_prompt_tokens": 4096})
    overflow = loads.overflow(cfg)
    overflow.prompt_started("prefill", 4000)
    assert overflow.apply(LOCAL, 40, "").decode_pool == "prefill"
    with pytest.raises(ValidationError, match="decode_overflow_max_prompt_tokens"):
        config(adaptive_prefill={"decode_overflow_max_prompt_tokens": -1})


def test_the_prompt_gate_in_time_where_the_rate_is_measured() -> None:
    """With `decode_overflow_max_prompt_ms` the gate is the time the prompts computing there
    take at the replica's measured rate: at 20k tokens/s and 50 ms, a 513-token first turn
    (26 ms) leaves room and a 2,048-token document (102 ms) does not; a replica that has
    not measured its rate keeps the token limit."""
    cfg = config(adaptive_prefill={"decode_overflow_max_prompt_ms": 50})
    loads = Loads()
    loads.publish("decode", 6)
    loads.publish("prefill", 0, prefill_tokens_per_s=20_000.0)
    overflow = loads.overflow(cfg)
    overflow.prompt_started("prefill", 513)  # over the 256-token limit, within 50 ms
    assert overflow.apply(LOCAL, 40, "").decode_pool == "prefill"
    overflow.prompt_started("prefill", 1535)  # 2,048 tokens: 102 ms
    assert overflow.apply(LOCAL, 40, "").decode_pool == "decode"
    overflow.prompt_computed("prefill", 2048)
    loads.publish("prefill", 0, queued_tokens=900, prefill_tokens_per_s=20_000.0)  # 45 ms
    assert overflow.apply(LOCAL, 40, "").decode_pool == "prefill"
    loads.publish("prefill", 0, queued_tokens=1100, prefill_tokens_per_s=20_000.0)  # 55 ms
    assert overflow.apply(LOCAL, 40, "").decode_pool == "decode"
    loads.publish("prefill", 0, queued_tokens=300)  # no rate measured: 300 > 256 tokens
    assert overflow.apply(LOCAL, 40, "").decode_pool == "decode"
    loads.publish("prefill", 0, queued_tokens=300, prefill_tokens_per_s=1_000.0)  # 300 ms
    assert overflow.apply(LOCAL, 40, "").decode_pool == "decode"
    with pytest.raises(ValidationError, match="decode_overflow_max_prompt_ms"):
        config(adaptive_prefill={"decode_overflow_max_prompt_ms": -1})


def test_time_spent_on_prompts_weighs_on_either_side() -> None:
    """A stream decodes only while its replica computes no prompt: the decode load is
    (sequences + 1) / (1 - prompt_busy) on both pools."""
    loads = Loads()
    overflow = loads.overflow(config(adaptive_prefill={"decode_overflow_max_prompt_busy": 1}))
    loads.publish("decode", 3)  # load 4
    loads.publish("prefill", 0, prompt_busy=0.8)  # load 5: its streams would wait on prompts
    assert overflow.apply(LOCAL, 40, "").reason.endswith(
        "5.0 on prefill: decode not above by 2, route stands"
    )
    loads.publish("prefill", 0, prompt_busy=0.4)  # load 1.7
    assert overflow.apply(LOCAL, 40, "").decode_pool == "prefill"
    loads.publish("decode", 1, prompt_busy=0.5)  # load 4: busy prefilling locally
    loads.publish("prefill", 0)
    assert overflow.apply(LOCAL, 40, "").decode_pool == "prefill"
    loads.publish("decode", 1)  # load 2: within the gap of the prefill pool's 1
    assert overflow.apply(LOCAL, 40, "").decode_pool == "decode"


def test_a_burst_is_split_between_the_pools() -> None:
    """Within one stats period the sequences sent each way count there: from a decode pool
    4 ahead, a burst overflows until the two are within the gap, then alternates."""
    loads = Loads()
    loads.publish("decode", 4)
    loads.publish("prefill", 0)
    overflow = loads.overflow()
    pools = [overflow.apply(LOCAL, 40, "").decode_pool for _ in range(6)]
    assert pools == ["prefill", "prefill", "prefill", "decode", "prefill", "decode"], pools


def test_a_snapshot_never_hides_what_this_ingress_has_running() -> None:
    """A snapshot measured before a sent request reached its replica, but received after it
    was sent, shows the replica idle: the request still counts until it ends."""
    loads = Loads()
    loads.publish("decode", 0)
    loads.publish("prefill", 0)
    overflow = loads.overflow(config(adaptive_prefill={"decode_overflow_gap": 0}))
    first = overflow.apply(LOCAL, 40, "")
    assert first.decode_pool == "decode"  # a tie stays on decode
    overflow.started("decode", 1)
    loads.publish("decode", 0)  # arrives after the send, measured before it landed
    loads.publish("prefill", 0)
    second = overflow.apply(LOCAL, 40, "")
    assert second.decode_pool == "prefill"
    assert "decode load 2.0 on decode vs 1.0 on prefill" in second.reason
    overflow.started("prefill", 1)
    overflow.ended("decode", 1)
    loads.publish("decode", 0)
    loads.publish("prefill", 0)  # stale the same way: the whole request is still running
    assert overflow.apply(LOCAL, 40, "").decode_pool == "decode"
    overflow.ended("prefill", 1)
    overflow.ended("prefill", 1)  # more ends than starts never go below zero
    loads.publish("decode", 0)
    loads.publish("prefill", 0)
    assert overflow.apply(LOCAL, 40, "").reason.endswith(
        "decode load 1.0 on decode vs 1.0 on prefill: decode not above, route stands"
    )


def test_n_counts_every_sequence() -> None:
    loads = Loads()
    loads.publish("decode", 4)
    loads.publish("prefill", 0)
    overflow = loads.overflow()
    assert overflow.apply(LOCAL, 40, "", num_sequences=8).decode_pool == "prefill"
    assert overflow.apply(LOCAL, 40, "").decode_pool == "decode"  # prefill now holds 8


def test_only_pools_the_tenant_may_use_and_that_cover_the_length() -> None:
    keys = {"keys": ["k-acme"]}
    cfg = PDServeConfig.model_validate(
        {
            "pools": [
                {"name": "prefill", "role": "prefill", "serves_decode": True},
                {"name": "decode", "role": "decode"},
                {
                    "name": "prefill-long",
                    "role": "prefill",
                    "serves_decode": True,
                    "min_context_tokens": 2048,
                },
            ],
            "tenants": [
                {"name": "acme", "api_keys": keys["keys"], "allowed_pools": ["prefill", "decode"]},
                {"name": "globex", "api_keys": ["k-globex"]},
            ],
        }
    )
    loads = Loads()
    loads.publish("decode", 6)
    loads.publish("prefill", 3)
    loads.publish("prefill-long", 0)
    overflow = loads.overflow(cfg)
    assert overflow.apply(LOCAL, 40, "globex").decode_pool == "prefill"  # long pool: > 40
    assert overflow.apply(LOCAL, 3000, "globex").decode_pool == "prefill-long"
    assert overflow.apply(LOCAL, 3000, "acme").decode_pool == "prefill"  # not allowed long


def test_no_serving_pool_means_no_change() -> None:
    overflow = Loads().overflow(config(serves_decode=False))
    assert not overflow.enabled and overflow.pools == []
    assert overflow.apply(LOCAL, 40, "") is LOCAL


# ---- config ----------------------------------------------------------------------------


def test_serves_decode_is_for_prefill_pools_with_adaptive_on() -> None:
    with pytest.raises(ValidationError, match="serves_decode applies to prefill pools only"):
        PDServeConfig.model_validate(
            {"pools": [{"name": "d", "role": "decode", "serves_decode": True}]}
        )
    with pytest.raises(ValidationError, match="needs adaptive_prefill.enabled"):
        config(adaptive_prefill={"enabled": False})
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        config(adaptive_prefill={"decode_overflow_gap": -1})
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        config(adaptive_prefill={"decode_overflow_max_prompt_busy": 1.5})


def test_a_serving_prefill_pool_has_a_kv_share(tmp_path: Path) -> None:
    """Tenant KV shares are of the blocks of every pool that decodes."""
    model_dir = write_builtin_model(tmp_path / "tiny", "tiny")
    cfg = config(model={"model": str(model_dir)})
    blocks = decode_pool_blocks(cfg, load_model_config(str(model_dir), "float32"))
    assert set(blocks) == {"prefill", "decode"} and blocks["prefill"] == blocks["decode"] > 0
    plain = config(serves_decode=False, model={"model": str(model_dir)})
    assert set(decode_pool_blocks(plain, load_model_config(str(model_dir), "float32"))) == {
        "decode"
    }


# ---- a real prefill replica serving a whole request ------------------------------------


def test_prefill_replica_serves_whole_requests_like_a_decode_replica(tmp_path: Path) -> None:
    """Greedy output of a prefill replica's `generate` equals a decode replica's, it
    reports its stream slots for load shedding and a prefill rate its decode steps do not
    dilute, and its KV pool is empty afterwards; a prefill replica without
    `serves_decode` refuses."""
    model_dir = write_builtin_model(tmp_path / "tiny", "tiny")
    engine_config = EngineConfig(model_dir=str(model_dir))
    serving = PrefillServer(engine_config, backend="shm", serves_decode=True)
    plain = PrefillServer(engine_config, backend="shm")
    decode = DecodeServer(engine_config, backend="shm")
    try:
        prompt = tuple(decode.engine.tokenize("the prefill replica decodes too, " * 6))
        spec = GenerationSpec(
            request_id="r0",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=12, temperature=0.0),
        )

        async def tokens(server: Any) -> list[int]:
            return [t async for delta in server.generate(spec) for t in delta.new_token_ids]

        expected = asyncio.run(tokens(decode))
        assert len(expected) == 12
        assert asyncio.run(tokens(serving)) == expected
        assert serving.replica.counters["whole_requests"] == 1
        # The engine loop publishes its occupancy after the step that ended the request.
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            before_s = time.perf_counter()  # the report reads its clock in between
            stats = asyncio.run(serving.record_routing_stats())
            after_s = time.perf_counter()
            if not stats["num_sequences"]:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.01)
        assert stats["admission"]["num_active"] == 0
        # The prompt took one step, the 11 other tokens one each: the rate is the prompt's.
        prompt_steps = list(serving.engine.prompt_steps)
        assert [n for _, _, n, _ in prompt_steps] == [len(prompt)]
        assert len(serving.engine.step_times) == 12
        rate = len(prompt) / prompt_steps[0][1]
        assert stats["prefill_tokens_per_s"] == pytest.approx(rate)
        # busy over the replica's life so far (younger than the 30 s window), at least 1 s:
        # the replica's age when it reported lies between the two readings around the call
        busy_s, started_at = prompt_steps[0][1], serving.engine.started_at
        assert after_s - started_at < SIGNAL_WINDOW_S
        least = busy_s / max(after_s - started_at, MIN_BUSY_SPAN_S)
        most = busy_s / max(before_s - started_at, MIN_BUSY_SPAN_S)
        assert least * (1 - 1e-9) <= stats["prompt_busy"] <= most * (1 + 1e-9)
        occupancy = serving.replica.loop.occupancy
        assert occupancy["num_free_blocks"] == occupancy["num_blocks"]
        with pytest.raises(RuntimeError, match="does not serve whole requests"):
            asyncio.run(tokens(plain))
        first, second = (asyncio.run(plain.record_routing_stats()) for _ in range(2))
        assert "admission" not in first
        # An idle replica's reports still differ, so Serve passes them on: never stale.
        assert second["num_reports"] == first["num_reports"] + 1
    finally:
        for server in (serving, plain, decode):
            server.shutdown()
