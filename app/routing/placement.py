"""`Placement.place`: one call that routes a checked request, chaining the configured rules
(`RouterPolicy.route`), adaptive disaggregation (`AdaptivePrefill.apply`) and decode
overflow (`DecodeOverflow.apply`), in that order. Each step extends the decision's reason
with its figures, so the route a request carries says why it went where it went."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from app.errors import BadRequestError
from app.routing.adaptive import AdaptivePrefill
from app.routing.overflow import DecodeOverflow
from app.routing.pool_router import RouteDecision, RouterPolicy


class Placement:
    """The ingress's routing steps for one request (event loop only)."""

    def __init__(
        self, policy: RouterPolicy, adaptive: AdaptivePrefill, overflow: DecodeOverflow
    ) -> None:
        self.policy = policy
        self.adaptive = adaptive
        self.overflow = overflow

    def place(
        self,
        num_prompt_tokens: int,
        tenant: str,
        priority: int,
        num_sequences: int,
        max_tokens: int,
        checks: Callable[[], None] = lambda: None,
        prompt_param: str = "prompt",
        prompt_token_ids: Sequence[int] = (),
        local_prefill_max_tokens: int = 0,
    ) -> RouteDecision:
        """Where the request runs. The configured rules come first and raise the request's
        routing errors (`BadRequestError`: an empty or too long prompt, an unknown tenant,
        no pool it may use); then `checks()` (the request's other validation, which may
        raise); only then the load-dependent steps, which count the tokens they send to a
        pool, so a request refused by its checks is never counted. `prompt_param` names
        the prompt's field in the rules' errors about its length; `prompt_token_ids`, when
        given, let decode overflow keep a conversation where its history is cached. A
        prompt of at most `local_prefill_max_tokens` prefills on its decode pool whatever
        adaptive placement would choose (batch lines): its tokens count on the decode pool
        that computes them, never on a prefill pool it will not use."""
        try:
            route = self.policy.route(num_prompt_tokens, tenant)
        except BadRequestError as exc:
            exc.param = exc.param or prompt_param
            raise
        checks()
        if num_prompt_tokens <= local_prefill_max_tokens:
            route = route.prefilled_locally("a batch line: prefilled where it decodes")
        # Each step counts the tokens it sends to a pool.
        route = self.adaptive.apply(route, num_prompt_tokens, priority, prompt_token_ids, tenant)
        return self.overflow.apply(
            route, num_prompt_tokens, tenant, num_sequences, max_tokens, prompt_token_ids
        )
