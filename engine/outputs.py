"""What the engine hands back: per-step deltas while streaming, whole completions offline."""

from __future__ import annotations

from dataclasses import dataclass, field


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its step raised and the failure was isolated
    to it); other requests and the engine are unaffected. Maps to a 5xx for this request."""


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
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    error: str | None = None  # why the request failed (finish_reason "error"), for the caller


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
