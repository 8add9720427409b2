"""What the engine hands back: per-step deltas while streaming, whole completions offline."""

from __future__ import annotations

from dataclasses import dataclass, field


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its step raised and the failure was isolated
    to it); other requests and the engine are unaffected. Maps to a 5xx for this request."""


@dataclass(frozen=True, slots=True)
class TTFTBreakdown:
    """Where a request's time to first token went, measured by the servers (milliseconds).

    queue: waiting for KV room, for the prefill engine (handshake included) and in
    attempts that failed; prefill: computing the prompt; transfer: KV still moving after
    the prompt was computed (the part not overlapped with compute); handover: the calls
    between the pools and confirming the KV arrived; first_step: the decode engine taking
    the request in and publishing its first token. A locally prefilled request has only
    queue and prefill.
    """

    queue_ms: float
    prefill_ms: float
    transfer_ms: float = 0.0
    handover_ms: float = 0.0
    first_step_ms: float = 0.0
    remote: bool = False

    @property
    def total_ms(self) -> float:
        phases = (self.queue_ms, self.prefill_ms, self.transfer_ms, self.handover_ms)
        return sum(phases) + self.first_step_ms


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request (a streaming delta)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefilled" | "error" | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens not computed for it (prefix cache hits)
    num_transferred_tokens: int = 0  # prompt tokens whose KV reached decode by a transfer
    stop_reason: int | str | None = None
    error: str | None = None  # why the request failed (finish_reason "error"), for the caller
    ttft: TTFTBreakdown | None = None  # set by a decode server on a stream's first token


@dataclass(slots=True)
class CompletionOutput:
    """A whole finished generation (offline `Engine.generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    def add(self, delta: RequestOutput) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.new_text
        self.logprobs.extend(delta.new_logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.num_cached_tokens = delta.num_cached_tokens
            self.error = delta.error

    def to_dict(self) -> dict[str, object]:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason}
