"""What the ingress sends to a decode replica: one request, already validated and routed."""

from __future__ import annotations

from dataclasses import dataclass

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
