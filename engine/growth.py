"""The KV blocks running requests are still expected to take, so admission leaves them room.

Admitting a request on its prompt's blocks alone lets a batch outgrow the cache: as every
running request adds its output's blocks, the scheduler preempts the least important and
recomputes it from scratch later (its prompt and its output so far): work done twice. A
batch of equal lines of 64 prompt and 32 output tokens on 182 blocks admitted ~45 of them
on 4 blocks each, grew to 6 each, and preempted 22 of 128 lines. So admission keeps free,
for each request it admits, the blocks that running requests at least as important as it
are still expected to add (`Scheduler._admit_waiting`):

- a request that runs to `max_tokens` for certain (`ignore_eos` with no stop strings or
  stop ids, or `min_tokens` at `max_tokens`): every block up to that length;
- any other: up to the mean output length of the requests that finished recently (an
  exponential average; nothing before the first one finishes, so a cold engine admits as it
  did without this), and at least its `min_tokens`.

The growth of less important requests is not kept free for a more important one, and the
blocks less important running requests hold count as room for it: those are what
preemption takes back for it. An estimate is only that: a request that outgrows it still
preempts, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from engine.request import Request

# Weight of the latest finished request in the mean output length.
LENGTH_SMOOTHING = 1 / 16


def runs_to_max_tokens(request: Request) -> bool:
    """Whether nothing but `max_tokens` (or an abort) can end the request's output."""
    params = request.sampling_params
    if params.min_tokens >= params.max_tokens:
        return True
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
            expected = max(math.ceil(self.mean_output_tokens), params.min_tokens)
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
    """Blocks kept free for the growth of requests, and blocks held by running requests
    (which preemption can take back), by priority."""

    def __init__(self) -> None:
        self._growth: dict[int, int] = {}
        self._held: dict[int, int] = {}

    def add(self, priority: int, growth_blocks: int, held_blocks: int = 0) -> None:
        """A request of `priority` expected to add `growth_blocks`; `held_blocks`: what it
        holds, if preemption may take that back (a running request)."""
        if growth_blocks:
            self._growth[priority] = self._growth.get(priority, 0) + growth_blocks
        if held_blocks:
            self._held[priority] = self._held.get(priority, 0) + held_blocks

    def room(self, priority: int, num_free_blocks: int) -> int | None:
        """Blocks a request of `priority` may take: the free ones plus those running less
        important requests hold (preemption takes them back), less the growth kept for the
        requests at least as important (lower values). None when nothing is kept for them:
        it may take whatever fits."""
        kept = sum(b for p, b in self._growth.items() if p <= priority)
        if not kept:
            return None
        reclaimable = sum(b for p, b in self._held.items() if p > priority)
        return num_free_blocks + reclaimable - kept

    @property
    def total(self) -> int:
        """Blocks the requests holding blocks are still expected to add."""
        return sum(self._growth.values())
