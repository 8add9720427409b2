"""Serve's side of the calls between pools: a call's routing identity, and Serve's
backpressure error recognised in one place.

**A call's own routing identity.**

Serve stamps every handle call made while serving a request with the *parent's* internal
request id, and a request router matches each pending call to its chosen replica by that id.
Ours (`app/serve/replica_router.py`) matches exactly, with no FIFO hand-over between calls, so that
a call's replica exclusions hold for that call; two concurrent calls of one parent would then
collide and one of them would never be routed. So each call that can have a sibling of the
same parent (the `n` choices of one request, the attempts of one remote prefill) first takes
a fresh id with `new_call_id()`. It changes only the calling task's context (a contextvar):
other tasks, and the rest of the request context (cancellation, app, route), are untouched.

**Backpressure.** A handle whose deployment's `max_queued_requests` is reached raises
`BackPressureError` (possibly as the cause of what the caller sees): the pool is busy, no
replica failed.

Decode replicas get both as `SERVE_CALLS` (`replica/calls.py`), so nothing below `app/`
imports Serve.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray.serve.exceptions import BackPressureError

from replica.calls import PoolCalls


def new_call_id() -> None:
    """Make the Serve handle calls this task makes from now on carry a fresh internal id."""
    # Private Ray Serve names: Serve offers no public way to set a call's routing id.
    from ray.serve._private.utils import generate_request_id
    from ray.serve.context import _get_serve_request_context, _serve_request_context

    context = _get_serve_request_context()
    variable: Any = _serve_request_context  # typed by Ray as holding only None
    variable.set(dataclasses.replace(context, _internal_request_id=generate_request_id()))


def is_backpressure(exc: BaseException) -> bool:
    """`exc`, or its cause, is Serve's `BackPressureError`: the pool's queue is full."""
    return isinstance(exc, BackPressureError) or isinstance(exc.__cause__, BackPressureError)


SERVE_CALLS = PoolCalls(new_call_id=new_call_id, is_backpressure=is_backpressure)
