"""What crosses a Serve call between the ingress and the two pools.

    ingress ──GenerationSpec──▶ decode (or a prefill replica serving whole requests)
    decode  ──PrefillRequest + Ticket──▶ prefill ──PrefillResult──▶ decode
    decode  ──WarmRequest──▶ prefill (connect to my KV receiver before the first transfer)

Both pools import these from here, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import RequestSpec


@dataclass(frozen=True, slots=True)
class GenerationSpec(RequestSpec):
    """A request (`RequestSpec`: one choice of the ingress's request) and where its prompt
    is prefilled.

    `prefill_pool=None` means the decode replica prefills the prompt itself (short prompts,
    or the colocated mode); otherwise it names the prefill pool the router chose.
    `trace_context`: the ingress span this call belongs to.
    """

    prefill_pool: str | None = None
    # Seconds left of the request's deadline when the ingress sent it (None: no deadline);
    # bounds the remote-prefill attempts (a duration, not a wall-clock instant).
    timeout_s: float | None = None
    # Above 0: send this stream's deltas merged, at most one per this many seconds (a caller
    # that reads only the whole answer; the first token still at once: `Engine._emit`).
    delta_interval_s: float = 0.0
    # Sent with nothing more important running (a batch line on an idle service): the
    # engine may give its steps the cores other replicas leave idle (`Request.spare`).
    spare: bool = False


@dataclass(frozen=True, slots=True)
class PrefillRequest(RequestSpec):
    """One prompt to prefill and hand off (the KV goes where the ticket says): one attempt
    of a decode request (`request_id` is the attempt's transfer id), with routing hints.
    `trace_context`: the decode span that made this call.
    """

    # Read by the replica router (app/serve/replica_router.py): replicas this call must not go to
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
