"""`PreparedRequest`: a request that passed every ingress check, as `Frontend.prepare` hands
it to `Frontend.run` (and the fallback policy may move it to the fallback pool)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from app.admission.classes import ServiceClass
from app.admission.deadlines import Deadline
from app.routing.fallback import Served
from app.routing.pool_router import RouteDecision
from engine.request import RequestSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRequest(RequestSpec):
    """A request (`RequestSpec`; its `priority` is the service class's, as its route's)
    that passed every check, ready to run as `n` choices; `trace_context` carries the
    ingress span's W3C context."""

    n: int
    route: RouteDecision  # its priority is the service class's
    service_class: ServiceClass = ServiceClass("default", 0)
    deadline: Deadline | None = None  # None: no deadline (callers that never set one)
    # Set when the fallback pool serves it (`app/routing/fallback.py`); shared by copies.
    served: Served = dataclasses.field(default_factory=Served)
