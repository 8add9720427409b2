"""What the engine hands back: per-step deltas while streaming, whole completions offline."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request (a streaming delta)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefilled" | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None


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

    def add(self, delta: RequestOutput) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.new_text
        self.logprobs.extend(delta.new_logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.num_cached_tokens = delta.num_cached_tokens

    def to_dict(self) -> dict[str, object]:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason}
