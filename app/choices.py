"""One request's choices as streaming calls to a decode pool, merged into one queue.

`Frontend.run` starts `pump_choice` once per choice (`n`); each puts `(index, delta)` items,
then `None` when its choice has finished, or the error that ended it, as a clean API error
where there is one (`run` takes whatever is ready at once: `ready_items`):

- a decode replica that died under the call (`RayActorError`): `ReplicaLostError` (503);
- a request the engine failed and isolated (`RequestFailedError`): 500 `request_failed`;
- Serve's `BackPressureError` (the decode pool's `max_queued_requests`): 503 `overloaded`,
  raised from it (`app/admission/fallback.is_backpressure` recognises it, so `run` may move
  the request to the fallback pool);
- anything else as it is.

Cancelling a pump cancels its call, on the decode replica and (through it) on the prefill
pool.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.exceptions import RayActorError

from app.admission.overload import OverloadGuard
from app.errors import InternalServerError, ReplicaLostError
from app.prepared import PreparedRequest
from app.protocol import choice_sampling_params
from app.serve.calls import new_call_id
from engine.outputs import RequestFailedError
from replica.protocol import GenerationSpec

logger = logging.getLogger(__name__)


async def pump_choice(
    decode_handle: Any, prepared: PreparedRequest, index: int, queue: asyncio.Queue
) -> None:
    """Stream choice `index` of `prepared` from `decode_handle` (a streaming handle of its
    route's decode pool) into `queue` (see the module docstring for what it puts)."""
    route = prepared.route
    spec = GenerationSpec.derive(
        prepared,
        request_id=f"{prepared.request_id}-{index}",
        sampling_params=choice_sampling_params(prepared.sampling_params, index),
        prefill_pool=None if route.local_prefill else route.prefill_pool,
        timeout_s=prepared.deadline.remaining_s() if prepared.deadline else None,
        delta_interval_s=prepared.delta_interval_s,
        spare=prepared.spare,
    )
    new_call_id()  # this choice's call must not share a routing id with its siblings
    stream = decode_handle.generate.remote(spec)
    try:
        async for delta in stream:
            queue.put_nowait((index, delta))
        queue.put_nowait(None)
    except asyncio.CancelledError:
        stream.cancel()
        raise
    except RayActorError as exc:  # ActorDiedError, ActorUnavailableError: replica gone
        logger.warning("decode replica lost under %s: %r", spec.request_id, exc)
        queue.put_nowait(ReplicaLostError())
    except RequestFailedError as exc:  # isolated to this request; the replica serves on
        logger.warning("request %s failed in the engine: %s", spec.request_id, exc)
        queue.put_nowait(
            InternalServerError("generation failed for this request", code="request_failed")
        )
    except BaseException as exc:  # noqa: BLE001 - surfaced to the caller
        error = OverloadGuard.backpressure(exc)
        if error is not None:
            error.__cause__ = exc
        queue.put_nowait(error or exc)


async def ready_items(queue: asyncio.Queue) -> list[Any]:
    """The next item of `queue` (waited for) and every other item already in it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def cancel_choices(tasks: list[asyncio.Task[None]], timer: asyncio.TimerHandle | None) -> None:
    """Stop a request's deadline timer and cancel every one of its choices."""
    if timer is not None:
        timer.cancel()
    for task in tasks:
        task.cancel()
