"""What the ingress sends to a decode replica: one request, already validated and routed."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """A tokenized, validated request and where its prompt is prefilled.

    `prefill_pool=None` means the decode replica prefills the prompt itself (short prompts,
    or the colocated mode); otherwise it names the prefill pool the router chose.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    tenant: str = ""
    priority: int = 0
    prefill_pool: str | None = None
    # Seconds left of the request's deadline when the ingress sent it (None: no deadline);
    # bounds the remote-prefill attempts (a duration, not a wall-clock instant).
    timeout_s: float | None = None
    # W3C trace context (traceparent, tracestate) of the ingress span this call belongs to.
    trace_context: dict[str, str] = field(default_factory=dict)
