"""What the decode pool sends to a prefill replica, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import RequestSpec


@dataclass(frozen=True, slots=True)
class PrefillRequest(RequestSpec):
    """One prompt to prefill and hand off (the KV goes where the ticket says): one attempt
    of a decode request (`request_id` is the attempt's transfer id), with routing hints.
    `trace_context`: the decode span that made this call.
    """

    # Read by the replica router (app/replica_router.py): replicas this call must not go to
    # (their breaker is open, or they just failed this request), and a half-open replica
    # to probe with it. Names as in the replicas' routing stats (`replica`).
    exclude_replicas: tuple[str, ...] = ()
    probe_replica: str | None = None


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """The first output token, sampled by prefill after its last layer was sent."""

    request_id: str
    first_token_id: int
    logprobs: dict[int, float] | None
    num_cached_tokens: int  # prompt tokens the prefill replica reused from its prefix cache
    replica: str  # which prefill replica served it (for telemetry and tests)
    prefill_ms: float  # time on the prefill replica, admission to hand-off done
    # prefill_ms by phase: handshake and queue, computing the prompt, KV still moving after
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    transfer_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class WarmRequest:
    """A decode replica asks a prefill replica to connect to its KV receiver at `endpoint`
    before any transfer between them (`decode/warm_up.py`). `probe_replica` names the
    replica meant (the replica router offers it first); `timeout_s` bounds the connecting
    (on shm, populating the receiver's cache included)."""

    endpoint: str
    probe_replica: str | None = None
    timeout_s: float = 20.0
