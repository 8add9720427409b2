"""What the decode pool sends to a prefill replica, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """One prompt to prefill and hand off (the KV goes where the ticket says)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    tenant: str = ""
    priority: int = 0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """The first output token, sampled by prefill after its last layer was sent."""

    request_id: str
    first_token_id: int
    logprobs: dict[int, float] | None
    num_cached_tokens: int  # prompt tokens the prefill replica reused from its prefix cache
    replica: str  # which prefill replica served it (for telemetry and tests)
    prefill_ms: float  # time on the prefill replica, admission to hand-off done
