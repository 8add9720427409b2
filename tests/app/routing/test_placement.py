"""`Placement.place` with a batch line's local-prefill bound: a prompt within it prefills on
its decode pool whatever adaptive placement would choose (its tokens counted on the decode
pool that computes them, none on a prefill pool it will not use); past it, or with no
bound, the usual chain decides."""

from __future__ import annotations

from pathlib import Path

from app.config import load_config
from app.routing.adaptive import AdaptivePrefill
from app.routing.overflow import DecodeOverflow
from app.routing.placement import Placement
from app.routing.pool_router import RouteDecision, RouterPolicy

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _placement() -> tuple[Placement, AdaptivePrefill]:
    config = load_config(CONFIGS / "cpu-tenants.yaml")
    adaptive = AdaptivePrefill(config.adaptive_prefill, lambda pool: None)
    overflow = DecodeOverflow(config, lambda pool: None)
    return Placement(RouterPolicy(config), adaptive, overflow), adaptive


def test_a_prompt_within_the_bound_prefills_and_counts_where_it_decodes() -> None:
    placement, adaptive = _placement()
    route = placement.place(64, "acme", 10, 1, 16, local_prefill_max_tokens=64)
    assert (route.prefill_pool, route.decode_pool, route.local_prefill) == (None, "decode", True)
    assert route.computes is None
    assert route.reason.endswith("a batch line: prefilled where it decodes")
    assert adaptive._sent.since("short", -1.0) == 0  # the prefill pool saw nothing of it
    assert adaptive._sent.since("decode", -1.0) == 64  # the decode pool computes it


def test_past_the_bound_or_without_one_the_placed_route_stands() -> None:
    placement, _ = _placement()
    assert placement.place(65, "acme", 10, 1, 16, local_prefill_max_tokens=64).prefill_pool == (
        "short"
    )
    assert placement.place(64, "acme", 10, 1, 16).prefill_pool == "short"  # interactive
    short = placement.place(20, "acme", 10, 1, 16, local_prefill_max_tokens=64)
    assert short.local_prefill and "batch line" not in short.reason  # local by the rules


def test_prefilled_locally_keeps_a_local_route() -> None:
    local = RouteDecision(None, "decode", True, 10, "under 32 tokens")
    assert local.prefilled_locally("why") is local
    placed = RouteDecision("short", "decode", False, 10, "64 tokens: short", ("short", 64))
    moved = placed.prefilled_locally("why")
    assert (moved.prefill_pool, moved.local_prefill, moved.computes, moved.priority) == (
        None,
        True,
        None,
        10,
    )
    assert moved.reason == "64 tokens: short; why"
