"""Connect each prefill replica to this decode replica before the first transfer between them.

A prefill replica connects to a decode replica's KV receiver on its first ticket: a
handshake and, on shm, populating the receiver's whole cache in its page tables (~0.1 s per
256 MiB); and the decode replica's first call through a prefill pool's handle sets up
Serve's router for it. A new pair (a deployment, a scale-up, a restart) paid all of it on
its first remote prefill: 215 ms to the first token against ~100 ms for the next ones
(BENCHMARKS.md, "a cold remote path").

`PrefillWarmer.tick()`, called by the decode replica at each routing-stats report (about
once a second, on its event loop), starts a round unless one is running: for each prefill
pool, a `warm` call to every replica its replica router knows and this replica has not
warmed yet (to the pool at large while the router has seen none), one call at a time, each
bounded by `WARM_TIMEOUT_S` there and `CALL_MARGIN_S` more here. A replica that could
not be warmed (or whose call another replica took) is tried again `RETRY_AFTER_S` later;
its first transfer connects by itself meanwhile, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from replica.calls import PoolCalls
from replica.protocol import WarmRequest

logger = logging.getLogger(__name__)

WARM_TIMEOUT_S = 20.0  # the prefill replica's connecting (`WarmRequest.timeout_s`)
CALL_MARGIN_S = 10.0  # the call's queueing and trips on top
RETRY_AFTER_S = 30.0


class PrefillWarmer:
    """One decode replica's warm-up of its prefill pools (event loop only)."""

    def __init__(
        self,
        pools: Mapping[str, Any],
        endpoint: str,
        replicas: Callable[[str], Collection[str] | None],
        clock: Callable[[], float] = time.monotonic,
        new_call_id: Callable[[], None] = PoolCalls().new_call_id,
    ) -> None:
        """`pools`: prefill pool -> its handle (with a `warm` method); `endpoint`: this
        replica's KV receiver; `replicas(pool)`: the pool's replica names as the replica
        router last saw them (None: not seen yet); `new_call_id`: `PoolCalls.new_call_id`."""
        self._pools, self._endpoint, self._replicas, self._clock = pools, endpoint, replicas, clock
        self._new_call_id = new_call_id
        self.warmed: set[tuple[str, str]] = set()  # (pool, replica)
        self._retry_at: dict[tuple[str, str | None], float] = {}
        self._round: asyncio.Task[None] | None = None

    def tick(self) -> asyncio.Task[None]:
        """Start a round of warm calls unless one is running; the round."""
        if self._round is None or self._round.done():
            self._round = asyncio.get_running_loop().create_task(self._warm_all())
        return self._round

    async def _warm_all(self) -> None:
        self._new_call_id()  # this task's calls are its own, whatever context it was started in
        for pool, handle in self._pools.items():
            known = self._replicas(pool)
            targets: list[str | None] = [None]  # the pool at large, until its router saw it
            if known is not None:
                targets = [r for r in known if (pool, r) not in self.warmed]
            for replica in targets:
                if self._clock() >= self._retry_at.get((pool, replica), 0.0):
                    await self._warm(pool, handle, replica)

    async def _warm(self, pool: str, handle: Any, replica: str | None) -> None:
        request = WarmRequest(self._endpoint, replica, WARM_TIMEOUT_S)
        try:
            timeout_s = WARM_TIMEOUT_S + CALL_MARGIN_S
            name = await asyncio.wait_for(handle.warm.remote(request), timeout_s)
        except Exception as exc:  # a replica going away, a pool with none: try again later
            name = ""
            logger.info("warming %s replica %s failed: %r", pool, replica or "(any)", exc)
        if name:
            self.warmed.add((pool, str(name)))
        if not name or (replica is not None and name != replica):  # failed, or taken by another
            self._retry_at[(pool, replica)] = self._clock() + RETRY_AFTER_S
