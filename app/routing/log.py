"""The ingress's record of routing decisions: counts by (tenant, prefill pool, decode pool,
fallback trigger, shed reason) and the latest decisions in full, for the ingress's stats
report and its `routing_report` handle method. In memory, per ingress replica; the recent
list is bounded."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import asdict
from typing import Any

from app.prepared import PreparedRequest
from app.routing.prefix_choice import prefix_routing

MAX_RECENT = 1000


class RoutingLog:
    """Counts and keeps the routing decision of every request this ingress replica ran or
    refused."""

    def __init__(self, max_recent: int = MAX_RECENT) -> None:
        self.counts: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=max_recent)

    def record(self, prepared: PreparedRequest, shed: str | None = None) -> None:
        """Count and keep `prepared`'s routing decision (`shed`: why it was refused, if it
        was)."""
        route = prepared.route
        pool = "local" if route.local_prefill else route.prefill_pool
        key = f"{prepared.tenant}|{pool}|{route.decode_pool}"
        fallback = prepared.served.fallback
        if fallback is not None:
            key += f"|fallback:{fallback.trigger}"
        self.counts[f"{key}|shed:{shed}" if shed else key] += 1
        self.recent.append(
            {
                "request_id": prepared.request_id,
                "tenant": prepared.tenant,
                "num_prompt_tokens": len(prepared.prompt_token_ids),
                "time": time.time(),
                **asdict(route),
                **({"shed": shed} if shed else {}),
                **({"fallback": fallback.trigger} if fallback is not None else {}),
            }
        )

    def report(self) -> dict[str, Any]:
        """`{"counts": {key: n}, "recent": [decision, ...], "prefix": {pool: ...}}`: the
        decisions (oldest first), and the replica routers' prefix-aware choices in this
        process (`app/routing/prefix_choice.py`)."""
        return {
            "counts": dict(self.counts),
            "recent": list(self.recent),
            "prefix": prefix_routing.report(),
        }
