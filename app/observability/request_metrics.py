"""Request metrics as the ingress sees them: TTFT, ITL, TPOT, latency, tokens, outcomes.

`RequestMetrics.start(...)` opens a `RequestRecorder` for one routed request; the frontend
feeds it every delta of every choice and closes it once with the request's HTTP status.
Token counts are those the client's `usage` reports: the prompt once per request that
reached an engine, the generated tokens of every choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.observability import metrics
from app.observability.metrics import DEFAULT_CLASS
from engine.outputs import RequestOutput

STATUS_OK = 200
STATUS_CLIENT_GONE = 499  # the client went away before the end (nginx's convention)


@dataclass(frozen=True, slots=True)
class SLOTargets:
    """A request's latency targets: it counts toward goodput when it meets both."""

    ttft_s: float
    tpot_s: float


@dataclass(slots=True)
class _Choice:
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_output_tokens: int = 0


@dataclass(slots=True)
class RequestRecorder:
    """Timings and counts of one request; `finish` records them (once)."""

    labels: dict[str, str]
    num_prompt_tokens: int
    slo: SLOTargets
    started_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    done: bool = False

    def on_delta(self, index: int, delta: RequestOutput) -> None:
        """Choice `index` streamed `delta` (call as it arrives, before passing it on)."""
        choice = self.choices.setdefault(index, _Choice())
        choice.num_output_tokens = delta.num_output_tokens
        if not delta.new_token_ids:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.observe("pdserve_ttft_seconds", now - self.started_at, self.labels)
        # A merged delta (held output: a response that is not streamed) says nothing of
        # single gaps; TPOT still covers it.
        if choice.last_token_at is not None and len(delta.new_token_ids) == 1:
            gap = now - choice.last_token_at
            metrics.observe("pdserve_itl_seconds", gap, self.labels)
        if choice.first_token_at is None:
            choice.first_token_at = now
        choice.last_token_at = now

    def finish(self, status: int) -> None:
        """The request ended with HTTP `status` (200: every choice finished); idempotent."""
        if self.done:
            return
        self.done = True
        labels = self.labels
        metrics.inc("pdserve_requests", 1, {**labels, "status": str(status)})
        if self.choices:  # the prompt reached an engine (a refused request's did not)
            metrics.inc("pdserve_prompt_tokens", self.num_prompt_tokens, labels)
        generated = sum(c.num_output_tokens for c in self.choices.values())
        metrics.inc("pdserve_generated_tokens", generated, labels)
        if status != STATUS_OK:
            return
        ends = [c.last_token_at for c in self.choices.values() if c.last_token_at is not None]
        end = max(ends, default=time.perf_counter())
        metrics.observe("pdserve_e2e_latency_seconds", end - self.started_at, labels)
        tpots = [_tpot(c) for c in self.choices.values()]
        for tpot in tpots:
            if tpot is not None:
                metrics.observe("pdserve_tpot_seconds", tpot, labels)
        ttft = None if self.first_token_at is None else self.first_token_at - self.started_at
        if (
            ttft is not None
            and ttft <= self.slo.ttft_s
            and all(t is None or t <= self.slo.tpot_s for t in tpots)
        ):
            metrics.inc("pdserve_good_requests", 1, labels)


def _tpot(choice: _Choice) -> float | None:
    if choice.first_token_at is None or choice.last_token_at is None:
        return None
    if choice.num_output_tokens < 2:
        return None
    return (choice.last_token_at - choice.first_token_at) / (choice.num_output_tokens - 1)


class RequestMetrics:
    """The ingress's request metrics; one per ingress replica."""

    def __init__(self, default_slo: SLOTargets) -> None:
        self.default_slo = default_slo

    @staticmethod
    def labels(
        tenant: str, slo_class: str | None, prefill_pool: str | None, decode_pool: str
    ) -> dict[str, str]:
        """A request's labels; `prefill_pool` None means prefilled on the decode replica."""
        return {
            "tenant": tenant,
            "class": slo_class or DEFAULT_CLASS,
            "prefill_pool": prefill_pool or "local",
            "decode_pool": decode_pool,
        }

    def start(
        self, labels: dict[str, str], num_prompt_tokens: int, slo: SLOTargets | None = None
    ) -> RequestRecorder:
        """Start timing a request that was admitted just now."""
        return RequestRecorder(labels, num_prompt_tokens, slo or self.default_slo)

    @staticmethod
    def shed(labels: dict[str, str], reason: str, status: int) -> None:
        """A request refused for load or quota (`reason`: a short fixed word, e.g.
        "concurrency_quota"), answered with `status` (429 or 503)."""
        metrics.inc("pdserve_shed_requests", 1, {**labels, "reason": reason, "status": str(status)})
