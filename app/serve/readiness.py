"""Whether the application can serve: every pool has a replica Serve counts as RUNNING.

The ingress answers `/health` from this. Serve runs each replica's `check_health` (engine
loop alive and progressing) and only counts replicas that pass as RUNNING; asking the
controller, rather than the pools, means a pool saturated with requests is not mistaken for
a dead one. The application is the one the asking replica belongs to, by the name Serve
gave it (`app.serve.apps.own_app_name`), never a configured name.

Probes are shared by concurrent callers and cached for `ttl_s`; each is bounded by
`timeout_s`. A change of state (ready, or not ready and why) is logged once, not per probe.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from types import SimpleNamespace
from typing import Any

from ray import serve
from ray.serve.context import _get_global_client

# A child of Serve's logger: in a replica it lands in the replica's log file at INFO.
logger = logging.getLogger("ray.serve.pdserve.readiness")

HEALTH_TTL_S = 1.0  # /health answers from a probe at most this old
HEALTH_TIMEOUT_S = 5.0  # a controller that does not answer within this: not ready


def num_running(replica_states: Mapping[Any, int]) -> int:
    """Replicas Serve counts as RUNNING in a deployment's `replica_states`."""
    return sum(
        n for state, n in replica_states.items() if getattr(state, "value", state) == "RUNNING"
    )


def replica_states() -> Any:
    """What `serve.status()` says of each application's deployments' replica states, read
    from the controller's details without building `serve.status()`'s models: those
    cloudpickle every deployment's request router class by value, ~40 ms of the ingress's
    CPU per probe with pdserve's router and five deployments, against ~3 ms for this. Falls
    back to `serve.status()` where the details are not as expected (another Ray)."""
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return serve.status()
    try:
        applications = {
            app_name: SimpleNamespace(
                deployments={
                    name: SimpleNamespace(
                        replica_states=Counter(r["state"] for r in deployment["replicas"])
                    )
                    for name, deployment in app["deployments"].items()
                }
            )
            for app_name, app in client.get_serve_details()["applications"].items()
        }
    except (KeyError, TypeError, AttributeError):
        return serve.status()
    return SimpleNamespace(applications=applications)


def pool_replicas(status: Any, app_name: str, pools: Collection[str]) -> dict[str, int]:
    """RUNNING replicas of each pool Serve's `status` (a `serve.status()`) lists for the app
    `app_name`; a pool it does not list is absent."""
    app = status.applications.get(app_name)
    deployments = app.deployments if app is not None else {}
    return {
        name: num_running(deployments[name].replica_states) for name in pools if name in deployments
    }


def not_ready_reason(app_name: str, pools: Collection[str], running: Mapping[str, int]) -> str:
    """Why the app is not ready given `pool_replicas`' counts; "" when it is."""
    idle = sorted(name for name in pools if running.get(name, 0) == 0)
    if not idle:
        return ""
    return f"no RUNNING replica in pool(s) {', '.join(idle)} of Serve app {app_name!r}"


class Readiness:
    """Cached, shared readiness probes of one application's pools; see the module docstring."""

    def __init__(
        self,
        app_name: str,
        pools: Collection[str],
        observe: Callable[[dict[str, int]], None] = lambda running: None,
        status: Callable[[], Any] = replica_states,
        ttl_s: float = HEALTH_TTL_S,
        timeout_s: float = HEALTH_TIMEOUT_S,
    ) -> None:
        """`observe` gets every probe's RUNNING replica counts (unit cost integrates them);
        `status` is Serve's status call or one shaped like it (`replica_states`; a
        blocking call, run off the event loop)."""
        self.app_name = app_name
        self.pools = tuple(pools)
        self._observe = observe
        self._status = status
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._probe: asyncio.Future[bool] | None = None
        self._is_ready = False
        self._checked_at = -math.inf
        self._reported: bool | None = None  # the state last logged; None before the first

    async def is_ready(self) -> bool:
        """Whether every pool has a RUNNING replica, from a probe at most `ttl_s` old."""
        if time.monotonic() - self._checked_at < self._ttl_s:
            return self._is_ready
        if self._probe is None:
            self._probe = asyncio.ensure_future(self._run_probe())
        # Shielded: a caller that goes away must not cancel the probe the others wait on.
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> bool:
        try:
            status = await asyncio.wait_for(asyncio.to_thread(self._status), self._timeout_s)
            running = pool_replicas(status, self.app_name, self.pools)
            self._observe(running)
            reason = not_ready_reason(self.app_name, self.pools, running)
        except Exception as exc:  # noqa: BLE001 - a controller not answering means not ready
            reason = f"the Serve controller did not answer: {exc!r}"
        finally:
            self._probe = None
        self._is_ready, self._checked_at = not reason, time.monotonic()
        self._report(reason)
        return self._is_ready

    def _report(self, reason: str) -> None:
        """Log a change of state (and the first state) in one line; nothing otherwise."""
        if self._reported is self._is_ready:
            return
        if self._is_ready:
            logger.info("ready: every pool of Serve app %r has a RUNNING replica", self.app_name)
        elif self._reported is None:
            logger.info("not ready yet: %s", reason)
        else:
            logger.warning("not ready: %s", reason)
        self._reported = self._is_ready
