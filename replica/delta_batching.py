"""Deltas of one stream sent together: for a caller that reads only the whole answer.

A stream whose `GenerationSpec.delta_interval_s` is above 0 (a batch job's line) holds its
deltas and sends what arrived as one delta at most that often, and at once when the stream
finishes. Each message through Serve costs the replica's event loop and the caller's CPU
(and the engine thread the GIL), so a batch of 64 streams saves 64 messages per step; the
tokens, text and logprobs are the same, concatenated in order.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator

from engine.outputs import RequestOutput


def merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """`first` followed by `then`, as one delta (counts and finish are `then`'s)."""
    return dataclasses.replace(
        then,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        new_text=first.new_text + then.new_text,
        new_logprobs=first.new_logprobs + then.new_logprobs,
        num_cached_tokens=then.num_cached_tokens or first.num_cached_tokens,
        num_transferred_tokens=then.num_transferred_tokens or first.num_transferred_tokens,
        ttft=first.ttft or then.ttft,
    )


async def batched(
    deltas: AsyncIterator[RequestOutput], interval_s: float
) -> AsyncGenerator[RequestOutput, None]:
    """`deltas`, merged so that at most one goes out per `interval_s` (the last at once)."""
    pending: RequestOutput | None = None
    sent_at = time.monotonic()
    async for delta in deltas:
        pending = delta if pending is None else merge(pending, delta)
        now = time.monotonic()
        if pending.finished or now - sent_at >= interval_s:
            yield pending
            pending, sent_at = None, now
    if pending is not None:
        yield pending
