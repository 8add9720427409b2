"""The ingress's per-request telemetry: trace context out, stream end into the request's
span, one request-log line, the TTFT breakdown and the usage behind unit cost.

`IngressTelemetry.start(...)` opens a `RequestTelemetry` for one routed request; the
frontend feeds it every delta and closes it once with the request's HTTP status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from app.config import PDServeConfig
from app.observability.cost import CostMeter
from app.observability.request_log import LogEntry, RequestLog
from app.observability.tracing import trace_id_of
from app.observability.ttft import TTFTStats
from app.routing.pool_router import RouteDecision
from engine.outputs import RequestOutput, TTFTBreakdown

_tracer = trace.get_tracer("pdserve.ingress")


@dataclass(slots=True)
class _Choice:
    num_output_tokens: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestTelemetry:
    """One request's counts and timings; `finish` records them (once)."""

    owner: IngressTelemetry
    request_id: str
    tenant: str
    service_class: str
    route: RouteDecision
    prompt_token_ids: tuple[int, ...]
    span: Span
    with_content: bool
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    ttft: TTFTBreakdown | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    done: bool = False

    def on_delta(self, index: int, delta: RequestOutput) -> None:
        """Choice `index` streamed `delta`."""
        choice = self.choices.setdefault(index, _Choice())
        choice.num_output_tokens = delta.num_output_tokens
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        if self.with_content:
            choice.token_ids.extend(delta.new_token_ids)
        if delta.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if delta.ttft is not None and self.ttft is None:
            self.ttft = delta.ttft

    def finish(self, status: int) -> None:
        """The request ended with HTTP `status`; idempotent."""
        if self.done:
            return
        self.done = True
        end = time.perf_counter()
        num_output = sum(c.num_output_tokens for c in self.choices.values())
        reasons = [self.choices[i].finish_reason for i in sorted(self.choices)]
        span = self.span
        span.add_event(
            "stream_end",
            {
                "pdserve.num_output_tokens": num_output,
                "pdserve.finish_reasons": [r or "" for r in reasons],
                "pdserve.status": status,
            },
        )
        span.set_attribute("pdserve.request_id", self.request_id)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        owner = self.owner
        reached_engine = bool(self.choices)
        if reached_engine:
            owner.cost.add_usage(len(self.prompt_token_ids), num_output)
        if self.ttft is not None and status == 200:
            owner.ttft.add(self.ttft)
        if owner.request_log is None:
            return
        ttft_ms = (self.first_token_at - self.started) * 1000 if self.first_token_at else None
        record: dict[str, Any] = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "request_id": self.request_id,
            "trace_id": trace_id_of(span),
            "tenant": self.tenant,
            "class": self.service_class,
            "route": {
                "prefill_pool": self.route.prefill_pool,
                "decode_pool": self.route.decode_pool,
                "local_prefill": self.route.local_prefill,
                "reason": self.route.reason,
            },
            "status": status,
            "n": len(self.choices),
            "num_prompt_tokens": len(self.prompt_token_ids),
            "num_output_tokens": num_output,
            "finish_reasons": reasons,
            "ttft_ms": ttft_ms,
            "e2e_ms": (end - self.started) * 1000,
            "queue_ms": self.ttft.queue_ms if self.ttft is not None else None,
            "ttft_breakdown": asdict(self.ttft) if self.ttft is not None else None,
        }
        owner.request_log.submit(
            LogEntry(
                record,
                self.prompt_token_ids,
                [self.choices[i].token_ids for i in sorted(self.choices)],
                self.with_content,
            )
        )


class IngressTelemetry:
    """Per-process state behind `RequestTelemetry`: the request log, TTFT stats, cost."""

    def __init__(self, config: PDServeConfig, detokenize: Callable[[list[int]], Any]) -> None:
        settings = config.observability
        self.request_log = (
            RequestLog(settings.request_log, detokenize) if settings.request_log.enabled else None
        )
        self.ttft = TTFTStats()
        self.cost = CostMeter(settings.cost, config.pools)

    def start(
        self,
        request_id: str,
        tenant: str,
        service_class: str,
        route: RouteDecision,
        prompt_token_ids: tuple[int, ...],
    ) -> RequestTelemetry:
        """Begin recording a request, under the current span (the request's server span)."""
        return RequestTelemetry(
            owner=self,
            request_id=request_id,
            tenant=tenant,
            service_class=service_class,
            route=route,
            prompt_token_ids=prompt_token_ids,
            span=trace.get_current_span(),
            with_content=self.request_log is not None and self.request_log.sample_content(),
        )

    def report(self, since: float | None = None) -> dict[str, Any]:
        """The stats endpoint's part: TTFT breakdown (requests finished since `since`, Unix
        seconds, if given) and unit cost since this ingress started."""
        report: dict[str, Any] = {"ttft_breakdown": self.ttft.report(since)}
        report["cost"] = self.cost.report()
        if self.request_log is not None:
            report["request_log"] = {
                "path": str(self.request_log.path),
                "num_dropped": self.request_log.num_dropped,
            }
        return report


def route_span(
    started_ns: int,
    tenant: str,
    service_class: str,
    route: RouteDecision,
    num_prompt_tokens: int,
) -> None:
    """A `route` span from `started_ns` to now under the current span, the decision as
    attributes (none without a current span)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return
    span = _tracer.start_span(
        "route",
        start_time=started_ns,
        attributes={
            "pdserve.tenant": tenant,
            "pdserve.class": service_class,
            "pdserve.num_prompt_tokens": num_prompt_tokens,
            "pdserve.route.prefill_pool": route.prefill_pool or "",
            "pdserve.route.decode_pool": route.decode_pool,
            "pdserve.route.local_prefill": route.local_prefill,
            "pdserve.route.priority": route.priority,
            "pdserve.route.reason": route.reason,
        },
    )
    span.end()
