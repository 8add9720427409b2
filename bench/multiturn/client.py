"""One conversation against a running server: its turns in order, each streamed, a think
time between an answer and the next turn.

Prompts are token ids (the completions API takes them): turn t+1's prompt is turn t's
prompt, the expected answer's token ids and the next user message, so it extends the
tokens the server cached exactly, as a chat client resending the same history does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.serve.sse import stream_completion


@dataclass(frozen=True, slots=True)
class Turn:
    """What to send for one turn, and the answer expected (greedy, from the offline engine)."""

    conversation: int
    turn: int  # 0-based
    prompt_ids: tuple[int, ...]
    max_tokens: int
    expected: str
    think_s: float  # the pause before sending it (the conversation's start, for turn 0)


@dataclass(slots=True)
class TurnRecord:
    """What the client saw of one turn; times are seconds from the run's start."""

    conversation: int
    turn: int
    prompt_tokens: int
    start_s: float = 0.0
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    transferred_tokens: int | None = None  # usage's kv_transferred_tokens, when reported
    text: str = ""
    expected: str = ""
    route: str | None = None  # the x-pdserve-route header
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.chunk_times_s)

    @property
    def wrong(self) -> bool:
        """Completed with another text than the offline engine's greedy answer."""
        return self.success and self.text != self.expected

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None below two tokens."""
        if self.end_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)


def usage_figures(usage: dict[str, Any]) -> tuple[int | None, int | None]:
    """(cached tokens, KV-transferred tokens) of a usage object; None where not reported."""
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    moved = details.get("kv_transferred_tokens", usage.get("kv_transferred_tokens"))
    return (
        None if cached is None else int(cached),
        None if moved is None else int(moved),
    )


async def send_turn(
    client: httpx.AsyncClient, model: str, turn: Turn, t0: float, timeout_s: float
) -> TurnRecord:
    """Stream one greedy turn; the record says what came back (never raises for the server's
    or the network's failures)."""
    record = TurnRecord(turn.conversation, turn.turn, len(turn.prompt_ids), expected=turn.expected)
    body = {
        "model": model,
        "prompt": list(turn.prompt_ids),
        "max_tokens": turn.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record.start_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(timeout_s):
            streamed = await stream_completion(client, body, t0)
    except TimeoutError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.route, record.error = streamed.route, streamed.error
    record.first_token_s, record.chunk_times_s = streamed.first_token_s, streamed.chunk_times_s
    if streamed.usage is not None:
        record.output_tokens = int(streamed.usage.get("completion_tokens") or 0)
        record.cached_tokens, record.transferred_tokens = usage_figures(streamed.usage)
    if record.error is not None:
        return record
    record.end_s = streamed.end_s
    parts = streamed.texts
    record.text = "".join(parts)
    record.output_tokens = record.output_tokens or len(record.chunk_times_s)
    if not record.chunk_times_s:
        record.error = "stream ended without tokens"
    return record


async def run_conversation(
    client: httpx.AsyncClient,
    model: str,
    turns: list[Turn],
    t0: float,
    timeout_s: float,
    on_turn: Any = None,
) -> list[TurnRecord]:
    """A conversation's turns in order, each after its think time; `on_turn(record)` after
    each. A failed turn ends the conversation (its later prompts would hold an answer the
    user never saw)."""
    records = []
    for turn in turns:
        if turn.think_s > 0:
            await asyncio.sleep(turn.think_s)
        record = await send_turn(client, model, turn, t0, timeout_s)
        records.append(record)
        if on_turn is not None:
            on_turn(record)
        if not record.success:
            break
    return records
