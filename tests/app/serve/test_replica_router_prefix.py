"""Prefix-aware choice in the replica router (`app/serve/replica_router.py`), on Serve's real
`RequestRouter`, with replicas that publish a prefix digest in their routing stats: a
conversation's turns follow the replica caching its history, within a load margin; tenants
never match each other's prefixes; a cached prefix is prompt work the replica need not do."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from app.routing.prefix_choice import SEQUENCE_MARGIN, prefix_routing
from app.serve.replica_router import KVAwareRouter, call_cost
from engine.request import SamplingParams
from replica.prefix_digest import KEY_BYTES, prompt_block_keys
from replica.protocol import GenerationSpec

BLOCK = 16
_ids = itertools.count()


def digest_of(*prompts: list[int], tenant: str = "") -> bytes:
    keys = {k for p in prompts for k in prompt_block_keys(p, BLOCK, tenant)}
    return b"".join(k.to_bytes(KEY_BYTES, "little") for k in keys)


def replica(name: str, blob: bytes = b"", **stats: Any) -> Any:
    routing_stats = {"replica": name, "block_size": BLOCK, "prefix_digest": blob, **stats}
    return SimpleNamespace(routing_stats=routing_stats, replica_id=SimpleNamespace(unique_id=name))


def stream(prompt: list[int], tenant: str = "") -> GenerationSpec:
    return GenerationSpec(f"r{next(_ids)}", tuple(prompt), SamplingParams(), tenant=tenant)


def conversation(i: int, num_tokens: int) -> list[int]:
    return [1000 + i] + [(7 * i + t) % 500 for t in range(num_tokens - 1)]


@pytest.fixture
def router() -> KVAwareRouter:
    name = f"decode-{next(_ids)}"
    return KVAwareRouter(DeploymentID(name=name, app_name="t"), DeploymentHandleSource.UNKNOWN)


def send(router: KVAwareRouter, replicas: list[Any], call: GenerationSpec) -> str:
    """Route one call as Serve does (first rank, then the tracked send)."""
    request = SimpleNamespace(
        args=[call], metadata=SimpleNamespace(internal_request_id=f"call-{next(_ids)}")
    )
    chosen = asyncio.run(router.choose_replicas(replicas, request))[0][0]
    cost = call_cost(call)
    assert cost is not None
    router.in_flight.sent(request.metadata.internal_request_id, chosen.replica_id.unique_id, *cost)
    return str(chosen.routing_stats["replica"])


def finish_all(router: KVAwareRouter) -> None:
    """Every call sent so far completed (a conversation's turn ends before the next)."""
    for call_id, replica_id, _ in list(router.in_flight._sends.values()):
        router.on_request_completed(SimpleNamespace(unique_id=replica_id), call_id)  # type: ignore[arg-type]


def test_a_turn_goes_where_its_history_is_cached(router: KVAwareRouter) -> None:
    history = conversation(1, 300)
    replicas = [
        replica("a", num_sequences=1, num_free_blocks=100),
        replica("b", digest_of(history), num_sequences=2, num_free_blocks=50),
    ]
    assert send(router, replicas, stream(history + [5] * 40)) == "b"
    # Its prompt's uncached tokens only count in flight there (here: under two blocks' worth).
    assert router.in_flight.load("b") == (1, 40 + 300 % BLOCK)
    report = prefix_routing.report()[router._deployment_id.name]
    assert (report["routed"], report["hit"]) == (1, 1)


def test_another_tenant_never_matches(router: KVAwareRouter) -> None:
    history = conversation(2, 300)
    replicas = [
        replica("a", num_sequences=1, num_free_blocks=100),
        replica("b", digest_of(history, tenant="acme"), num_sequences=2, num_free_blocks=50),
    ]
    assert send(router, replicas, stream(history + [5] * 40, tenant="other")) == "a"
    assert send(router, replicas, stream(history + [5] * 40, tenant="acme")) == "b"


def test_conversations_spread_then_stick_before_any_report_shows_them(
    router: KVAwareRouter,
) -> None:
    # Eight conversations start at once; no digest shows anything yet: the first turns
    # spread by load, and each later turn follows its first (what this router sent).
    replicas = [replica("a", num_free_blocks=100), replica("b", num_free_blocks=100)]
    prompts = [conversation(i, 200) for i in range(8)]
    home = {i: send(router, replicas, stream(p)) for i, p in enumerate(prompts)}
    assert Counter(home.values()) == {"a": 4, "b": 4}
    for turn in range(1, 4):
        for i in range(8):
            prompts[i] = prompts[i] + [(i + turn) % 500] * 50
            assert send(router, replicas, stream(prompts[i])) == home[i]


def test_a_hot_replica_past_the_margin_loses_its_preference(router: KVAwareRouter) -> None:
    history = conversation(3, 300)
    busy = SEQUENCE_MARGIN + 1
    replicas = [
        replica("a", num_sequences=0, num_free_blocks=100),
        replica("b", digest_of(history), num_sequences=busy, num_free_blocks=100),
    ]
    assert send(router, replicas, stream(history + [9] * 20)) == "a"
    finish_all(router)
    report = prefix_routing.report()[router._deployment_id.name]
    assert report["moved_for_load"] == 1
    # That turn's blocks now count as sent to `a`: the next turn stays there.
    assert send(router, replicas, stream(history + [9] * 40)) == "a"


def test_an_evicted_prefix_stops_attracting(router: KVAwareRouter) -> None:
    history = conversation(4, 300)
    a = replica("a", num_sequences=0, num_free_blocks=100)
    b = replica("b", digest_of(history), num_sequences=1, num_free_blocks=100)
    assert send(router, [a, b], stream(history + [1] * 20)) == "b"
    router.prefix_index.retain(["a"])  # b restarted: its sends and digest are forgotten
    b_restarted = replica("b2", b"", num_sequences=1, num_free_blocks=100)
    assert send(router, [a, b_restarted], stream(history + [1] * 40)) == "a"
