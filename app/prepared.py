"""A request on its way through the front door (`app/frontend.py`):

    entry point ──Entry──▶ Frontend.admit (model, params, tokenize, class, place, shed)
      ──PreparedRequest──▶ Frontend.run (quota, n choices on the decode pool, deltas)

`Entry` is what an entry point (the OpenAI routes, the handle API) hands over once its body
has the right shape; `PreparedRequest` is a request that passed every check (and the
fallback policy may move it to the fallback pool)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from app.admission.classes import ServiceClass
from app.admission.deadlines import Deadline
from app.routing.fallback import Served
from app.routing.pool_router import RouteDecision
from engine.request import RequestSpec, SamplingParams


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRequest(RequestSpec):
    """A request (`RequestSpec`; its `priority` is the service class's, as its route's)
    that passed every check, ready to run as `n` choices; `trace_context` carries the
    ingress span's W3C context."""

    n: int
    route: RouteDecision  # its priority is the service class's
    service_class: ServiceClass = ServiceClass("default", 0)
    deadline: Deadline | None = None  # None: no deadline (callers that never set one)
    # Above 0: after the first token the decode pool sends its deltas merged, one per this
    # many seconds at most (a caller that reads only the whole answer: a batch line, a
    # response that is not streamed; `Engine._emit`).
    delta_interval_s: float = 0.0
    # Sent on an idle service (a batch line): `GenerationSpec.spare`.
    spare: bool = False
    # Set when the fallback pool serves it (`app/routing/fallback.py`); shared by copies.
    served: Served = dataclasses.field(default_factory=Served)


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One request as an entry point hands it to `Frontend.admit`: its body's shape is
    validated, nothing else is checked yet. Exactly one of `prompt` (text or token ids) and
    `messages` (a chat) is set."""

    model: str | None  # the model asked for; None: the one served
    sampling_params: Callable[[], SamplingParams]  # the body's; may raise InvalidRequestError
    prompt: str | list[int] | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    n: int = 1
    prompt_param: str = "prompt"  # the prompt's field, named in errors about it
    slo_class: str | None = None  # the class asked for, if any
    timeout_s: float | None = None  # the deadline asked for, if any
    timeout_param: str = "timeout"  # where it was asked for
    # A prompt of at most this many tokens prefills on its decode pool, whatever the load
    # (batch lines: `LineExecutor`); 0: placement decides.
    local_prefill_max_tokens: int = 0
