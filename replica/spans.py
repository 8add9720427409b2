"""The span both pools' request timelines are built around.

A server span continues the caller's trace from a W3C carrier; its children are built
afterwards from `time.monotonic()` readings, mapped onto wall-clock nanoseconds by the
span's own start (one `time.time_ns()`), so a timeline records a few floats on the hot
path and spans only once it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

propagator = TraceContextTextMapPropagator()


class RequestSpan:
    """A server span of one call on a replica, and a clock to place its children."""

    def __init__(
        self,
        tracer: trace.Tracer,
        name: str,
        carrier: Mapping[str, str],
        attributes: Mapping[str, str | int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`carrier`: the caller's W3C trace context; `clock` must read
        `time.monotonic`'s clock (engine timestamps such as `first_scheduled_time` do)."""
        self.tracer = tracer
        self.clock = clock
        self.start_ns = time.time_ns()
        self.start = clock()
        self.span: Span = tracer.start_span(
            name,
            context=propagator.extract(dict(carrier)),
            kind=SpanKind.SERVER,
            start_time=self.start_ns,
            attributes=dict(attributes),
        )

    def ns(self, monotonic: float) -> int:
        """Wall-clock nanoseconds of a `clock` reading."""
        return self.start_ns + int((monotonic - self.start) * 1e9)

    def child(self, name: str, begin: float, end: float, **attributes: object) -> Span:
        """A finished child span from `begin` to `end` (`clock` readings); attributes
        that are not str or int are left out."""
        span = self.tracer.start_span(
            name,
            context=trace.set_span_in_context(self.span),
            start_time=self.ns(begin),
            attributes={k: v for k, v in attributes.items() if isinstance(v, str | int)},
        )
        span.end(end_time=self.ns(end))
        return span
