"""The KV blocks running requests are still expected to take, so admission leaves them room.

Admitting a request on its prompt's blocks alone lets a batch outgrow the cache: as every
running request adds its output's blocks, the scheduler preempts the least important and
recomputes it from scratch later (its prompt and its output so far): work done twice. A
batch of equal lines of 64 prompt and 32 output tokens on 182 blocks admitted ~45 of them
on 4 blocks each, grew to 6 each, and preempted 22 of 128 lines. So admission keeps free,
for each request it admits, the blocks that running requests at least as important as it
are still expected to add (`Scheduler._admit_waiting`):

- a request that runs to `max_tokens` for certain (`ignore_eos`, no stop strings or stop
  ids): every block up to that length;
- any other: up to the mean output length of the requests that finished recently (an
  exponential average; nothing before the first one finishes, so a cold engine admits as it
  did without this).

The growth of less important requests is not kept free for a more important one: those
are what preemption takes back for it. An estimate is only that: a request that outgrows it
still preempts, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from engine.request import Request

# Weight of the latest finished request in the mean output length.
LENGTH_SMOOTHING = 1 / 16


def runs_to_max_tokens(request: Request) -> bool:
    """Whether nothing but `max_tokens` (or an abort) can end the request's output."""
    params = request.sampling_params
    return params.ignore_eos and not params.stop and not params.stop_token_ids


class OutputGrowth:
    """Expected output lengths, learned from finished requests."""

    def __init__(self, num_blocks_for: Callable[[int], int]) -> None:
        """`num_blocks_for(tokens)`: blocks that hold that many tokens."""
        self.num_blocks_for = num_blocks_for
        self.mean_output_tokens = 0.0  # of finished requests that could stop early
        self.num_finished = 0

    def expected_tokens(self, request: Request) -> int:
        """The tokens whose KV `request` is expected to hold when it ends (the last sampled
        token's KV is never computed)."""
        params = request.sampling_params
        if request.prefill_only:
            return request.num_prompt_tokens
        if runs_to_max_tokens(request):
            num_outputs = params.max_tokens
        else:
            expected = math.ceil(self.mean_output_tokens)
            num_outputs = min(params.max_tokens, max(expected, request.num_output_tokens))
        return max(request.num_tokens, request.num_prompt_tokens + num_outputs - 1)

    def growth_blocks(self, request: Request, num_held_blocks: int) -> int:
        """Blocks `request` (holding `num_held_blocks`) is expected to add."""
        return max(0, self.num_blocks_for(self.expected_tokens(request)) - num_held_blocks)

    def finished(self, request: Request) -> None:
        """Learn from a request that ended on its own (a stop or its length)."""
        if request.prefill_only or runs_to_max_tokens(request):
            return
        self.num_finished += 1
        weight = max(LENGTH_SMOOTHING, 1 / self.num_finished)
        self.mean_output_tokens += weight * (request.num_output_tokens - self.mean_output_tokens)


class GrowthReserve:
    """Blocks kept free for the growth of requests, by how important they are."""

    def __init__(self, entries: Iterable[tuple[int, int]]) -> None:
        """`entries`: (priority, growth blocks) of each request holding blocks."""
        self._by_priority: dict[int, int] = {}
        for priority, blocks in entries:
            self.add(priority, blocks)

    def add(self, priority: int, blocks: int) -> None:
        if blocks:
            self._by_priority[priority] = self._by_priority.get(priority, 0) + blocks

    def kept_for(self, priority: int) -> int:
        """Blocks kept for requests at least as important as `priority` (lower values)."""
        return sum(b for p, b in self._by_priority.items() if p <= priority)

    @property
    def total(self) -> int:
        """Blocks kept for every request."""
        return sum(self._by_priority.values())
