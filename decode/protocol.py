"""What the ingress sends to a decode replica: one request, already validated and routed."""

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
