"""The ingress's view of each pool's load (prefill pools; decode pools too for adaptive
disaggregation), started in the background.

The load itself arrives without any call on the request path: this process's replica
routers (`app/serve/replica_router.py`) publish each pool's replicas and routing stats into
`replica.placement.pool_view` whenever Serve pushes new stats. A router exists only once its
handle has been used, and the ingress never calls the prefill pools on its own, so a
background task here calls each pool's `record_routing_stats` (bounded by a timeout) until
the pool has a view; after that Serve keeps it fresh. A pool that does not answer stays
without a view: nothing is shed on missing data. Load shedding needs the prefill pools;
`watch` adds pools (adaptive disaggregation's decode pools) and keeps the refresher on
whether or not shedding is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from app.config import SheddingSettings
from replica.placement import PoolSnapshot, PoolView, pool_view


class PoolLoadMonitor:
    """Pool name -> its latest `PoolSnapshot`, for the pools given (and those watched)."""

    def __init__(
        self,
        handles: Mapping[str, Any],
        settings: SheddingSettings,
        view: PoolView = pool_view,
    ) -> None:
        self._handles = dict(handles)
        self._settings = settings
        self._view = view
        self._task: asyncio.Task[None] | None = None
        self._watched = False  # a caller besides load shedding needs the views

    def watch(self, handles: Mapping[str, Any]) -> None:
        """Also get a view of these pools, and refresh views even when shedding is off.
        Call before the first `snapshot`."""
        self._handles.update(handles)
        self._watched = True

    def start(self) -> None:
        """Start the background refresher if it is needed and not running yet; on an event
        loop only (off one, e.g. a synchronous test, nothing starts). The ingress calls it at
        each health probe, so the views exist before the first request: a burst arriving at
        a fresh deployment is otherwise placed without them (the static rule, no shedding)
        until the first stats come back."""
        if self._task is None and (self._settings.enabled or self._watched) and self._handles:
            with contextlib.suppress(RuntimeError):  # no running event loop
                self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    def snapshot(self, pool: str) -> PoolSnapshot | None:
        """The pool's latest load (never waits); starts the refresher (`start`)."""
        self.start()
        return self._view.get(pool)

    async def _refresh_forever(self) -> None:
        """Until every pool has a view: call the pools that have none, then wait a period."""
        while missing := [name for name in self._handles if self._view.get(name) is None]:
            await asyncio.gather(*(self._touch(name) for name in missing))
            await asyncio.sleep(self._settings.refresh_s)

    async def _touch(self, pool: str) -> None:
        """Call the pool once, which starts this process's router for it."""
        with contextlib.suppress(Exception):  # a pool not answering just has no view yet
            await asyncio.wait_for(
                self._handles[pool].record_routing_stats.remote(), timeout=self._settings.max_age_s
            )

    def close(self) -> None:
        """Stop the background refresher."""
        if self._task is not None:
            self._task.cancel()
