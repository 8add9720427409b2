"""The replica router's choice within a pool (`app/serve/replica_router.py`), on Serve's real
`RequestRouter` with replicas that carry only what the router reads (name, id, stats).

The stats a replica reports lag by up to a stats period, so the router counts the calls it
has in flight itself; a burst must spread over the pool, not pile onto whichever replica
looked least loaded in the last report.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from app.serve.replica_router import InFlight, KVAwareRouter, call_cost, replica_load
from engine.request import SamplingParams
from replica.protocol import GenerationSpec, PrefillRequest

_ids = itertools.count()


def replica(name: str, **stats: Any) -> Any:
    """What `choose_replicas` reads of a Serve `RunningReplica`."""
    return SimpleNamespace(
        routing_stats={"replica": name, **stats}, replica_id=SimpleNamespace(unique_id=name)
    )


def pending(call: Any) -> Any:
    """What `choose_replicas` reads of Serve's `PendingRequest`."""
    return SimpleNamespace(
        args=[call], metadata=SimpleNamespace(internal_request_id=f"call-{next(_ids)}")
    )


def stream(num_prompt_tokens: int = 64, prefill_pool: str | None = None) -> GenerationSpec:
    """A stream's call; `prefill_pool=None`: the replica prefills its prompt itself."""
    ids = tuple(range(num_prompt_tokens))
    return GenerationSpec(f"r{next(_ids)}", ids, SamplingParams(), prefill_pool=prefill_pool)


def prefill(num_prompt_tokens: int, **hints: Any) -> PrefillRequest:
    ids = tuple(range(num_prompt_tokens))
    return PrefillRequest(f"p{next(_ids)}", ids, SamplingParams(), **hints)


@pytest.fixture
def router() -> KVAwareRouter:
    return KVAwareRouter(DeploymentID(name="decode", app_name="t"), DeploymentHandleSource.UNKNOWN)


def send(router: KVAwareRouter, replicas: list[Any], call: Any) -> tuple[str, str]:
    """Route one call as Serve does (first rank; the tracked send): (replica, call id)."""
    request = pending(call)
    chosen = asyncio.run(router.choose_replicas(replicas, request))[0][0]
    call_id = request.metadata.internal_request_id
    cost = call_cost(call)
    assert cost is not None
    router.in_flight.sent(call_id, chosen.replica_id.unique_id, *cost)
    return chosen.routing_stats["replica"], call_id


def test_calls_count_from_the_moment_they_are_ranked(router: KVAwareRouter) -> None:
    # Serve switches tasks between choosing and sending: a burst chosen before any send
    # must still spread.
    replicas = [replica("a", num_free_blocks=100), replica("b", num_free_blocks=90)]
    requests = [pending(stream()) for _ in range(4)]
    firsts = [
        asyncio.run(router.choose_replicas(replicas, r))[0][0].routing_stats["replica"]
        for r in requests
    ]
    assert Counter(firsts) == {"a": 2, "b": 2}
    # Serve sends the first to `b` after all (a's queue was full): it moves, not doubles.
    first = requests[0].metadata.internal_request_id
    router.in_flight.sent(first, "b", 64, False)
    assert router.in_flight.load("a") == (1, 64) and router.in_flight.load("b") == (3, 192)
    # Rejected there, Serve ranks the same call again: the retry's choice counts at once,
    # and the first send stops counting when Serve ends it, not before.
    router.in_flight.chosen(first, "a", 64)
    assert router.in_flight.load("a") == (2, 128) and router.in_flight.load("b") == (3, 192)
    router.on_request_completed(SimpleNamespace(unique_id="b"), first)  # type: ignore[arg-type]
    assert router.in_flight.load("a") == (2, 128) and router.in_flight.load("b") == (2, 128)


def test_what_the_reports_show_by_now_stops_counting() -> None:
    ledger = InFlight(report_lag_s=0.0)
    ledger.chosen("x", "a", 7)  # ranked, then cancelled while routing: never sent
    ledger.sent("y", "a", 100, until_done=True)  # a prefill call: until its hand-off
    ledger.sent("z", "a", 50, until_done=False)  # a stream: its prompt until reports show it
    time.sleep(0.01)
    assert ledger.load("a") == (2, 100)


def test_a_burst_of_streams_spreads_over_replicas_whatever_the_last_report_said(
    router: KVAwareRouter,
) -> None:
    # The last report says `a` is freer; nothing has been reported since the burst began.
    replicas = [
        replica("a", num_sequences=0, queued_tokens=0, num_free_blocks=100),
        replica("b", num_sequences=0, queued_tokens=0, num_free_blocks=90),
    ]
    placed = Counter(send(router, replicas, stream())[0] for _ in range(6))
    assert placed == {"a": 3, "b": 3}  # by the report alone: all six on `a`


def test_a_report_above_what_this_router_sent_still_counts(router: KVAwareRouter) -> None:
    # Another ingress replica keeps `a` busy: its report wins over this router's zero.
    replicas = [
        replica("a", num_sequences=4, num_free_blocks=10),
        replica("b", num_sequences=1, num_free_blocks=90),
    ]
    # Streams prefilled elsewhere (a decode pool) bring no prompt work: sequences decide.
    # b's report may already hold this router's calls, so b counts max(1, sent): four calls
    # go to b before it ties a's 4 (each figure is a lower bound of the replica's load).
    calls = [stream(prefill_pool="prefill") for _ in range(4)]
    assert [send(router, replicas, call)[0] for call in calls] == ["b"] * 4
    assert router.in_flight.load("b") == (4, 0)


def test_completed_calls_stop_counting(router: KVAwareRouter) -> None:
    replicas = [replica("a", num_free_blocks=100), replica("b", num_free_blocks=90)]
    first, call_id = send(router, replicas, stream())
    assert first == "a"
    assert send(router, replicas, stream())[0] == "b"
    router.on_request_completed(SimpleNamespace(unique_id="a"), call_id)  # type: ignore[arg-type]
    assert router.in_flight.load("a") == (0, 0)
    assert send(router, replicas, stream())[0] == "a"


def test_calls_rank_by_the_prompt_tokens_in_flight(router: KVAwareRouter) -> None:
    replicas = [replica("a", num_free_blocks=100), replica("b", num_free_blocks=90)]
    assert send(router, replicas, prefill(4000))[0] == "a"
    # `b` now has fewer queued tokens though it will hold more calls: tokens rank first.
    assert [send(router, replicas, prefill(100))[0] for _ in range(3)] == ["b", "b", "b"]
    assert router.in_flight.load("a") == (1, 4000)
    assert router.in_flight.load("b") == (3, 300)
    # A chat turn prefilled where it decodes (colocated) avoids the replica computing the
    # 4k-token prompt, though that one holds fewer calls; its own prompt then counts there.
    assert send(router, replicas, stream(64))[0] == "b"
    assert router.in_flight.load("b") == (4, 364)
    # A stream prefilled elsewhere adds a call, no prompt work.
    assert send(router, replicas, stream(64, prefill_pool="prefill"))[0] == "b"
    assert router.in_flight.load("b") == (5, 364)


def test_exclusions_and_probes_still_hold(router: KVAwareRouter) -> None:
    replicas = [replica("a", num_free_blocks=100), replica("b", num_free_blocks=90)]
    ranks = asyncio.run(
        router.choose_replicas(replicas, pending(prefill(8, exclude_replicas=("a",))))
    )
    assert [[r.routing_stats["replica"] for r in rank] for rank in ranks] == [["b"]]
    call = prefill(8, probe_replica="b")
    router.in_flight.sent("busy", "b", 10_000, True)
    ranks = asyncio.run(router.choose_replicas(replicas, pending(call)))
    assert [r.routing_stats["replica"] for rank in ranks for r in rank] == ["b", "a"]


def test_control_calls_are_not_load() -> None:
    assert call_cost(None) is None
    assert call_cost("stats") is None
    assert call_cost(stream(10)) == (10, False)  # prefilled where it runs
    assert call_cost(stream(10, prefill_pool="prefill")) == (0, False)
    assert call_cost(prefill(10)) == (10, True)


def test_replica_load_orders() -> None:
    stats = {"queued_tokens": 50, "num_sequences": 2, "num_free_blocks": 7}
    assert replica_load(stats, (0, 0)) == (50.0, 2.0, -7.0)
    assert replica_load(stats, (5, 20)) == (50.0, 5.0, -7.0)
    assert replica_load({}, (1, 900)) == (900.0, 1.0, -0.0)
    # in whole blocks: the token a handed-off request leaves a decode replica is no queue
    assert replica_load(stats, (0, 0), block_size=16) == (48.0, 2.0, -7.0)
    one_token = {"queued_tokens": 1, "num_sequences": 1, "num_free_blocks": 7}
    assert replica_load(one_token, (0, 0), block_size=16) < replica_load({}, (3, 0), 16)


def test_in_flight_ledger_is_exact_and_bounded() -> None:
    ledger = InFlight(max_entries=3)
    ledger.sent("x", "a", 5, True)
    ledger.sent("x", "a", 5, True)  # rejected, then sent to the same replica again
    assert ledger.load("a") == (2, 10)
    ledger.completed("never-sent", "a")
    ledger.completed("x", "a")
    assert ledger.load("a") == (1, 5)
    ledger.completed("x", "a")
    assert ledger.load("a") == (0, 0)
    # Rejected by `a`, sent to `b`; `a`'s end arrives after: `b`'s send still counts.
    ledger.sent("y", "a", 5, True)
    ledger.sent("y", "b", 5, True)
    ledger.completed("y", "a")
    assert ledger.load("a") == (0, 0) and ledger.load("b") == (1, 5)
    ledger.completed("y", "b")
    for i in range(5):
        ledger.sent(f"c{i}", "b", 1, True)
    assert ledger.load("b") == (3, 3)  # the two oldest dropped: a lost completion cannot leak
