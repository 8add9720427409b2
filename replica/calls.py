"""How a replica calls another pool through the serving framework, as two injected hooks.

Below `app/` nothing imports Ray Serve: the application (`app/serve/calls.py`) hands each
decode replica the Serve versions of these when it builds the deployments; a server built
without them (tests, a bare engine) gets the defaults, which make calls as they come and
take no error for backpressure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _same_call_id() -> None:
    """No framework: calls carry no routing identity to renew."""


def _never(exc: BaseException) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class PoolCalls:
    """`new_call_id()`: the calls the current task makes from now on are routed as calls of
    their own, not as siblings of the request being served (called before each call that
    can have a sibling). `is_backpressure(exc)`: `exc` says the callee pool's queue is full
    (the pool is busy, no replica failed)."""

    new_call_id: Callable[[], None] = _same_call_id
    is_backpressure: Callable[[BaseException], bool] = _never
