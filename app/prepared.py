"""`PreparedRequest`: a request that passed every ingress check, as `Frontend.prepare` hands
it to `Frontend.run` (and the fallback policy may move it to the fallback pool)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from app.admission.classes import ServiceClass
from app.admission.deadlines import Deadline
from app.admission.fallback import Served
from app.router import RouteDecision
from engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request that passed every check, ready to run."""

    request_id: str
    tenant: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    n: int
    route: RouteDecision  # its priority is the service class's
    service_class: ServiceClass = ServiceClass("default", 0)
    deadline: Deadline | None = None  # None: no deadline (callers that never set one)
    trace_context: dict[str, str] = dataclasses.field(default_factory=dict)  # W3C carrier
    # Set when the fallback pool serves it (`app/admission/fallback.py`); shared by copies.
    served: Served = dataclasses.field(default_factory=Served)
