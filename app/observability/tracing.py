"""OpenTelemetry tracing: each process's tracer provider, the JSON-lines exporter, and the
HTTP middleware that opens a request's trace and returns its id.

One trace per request. The ingress middleware opens the server span (continuing an incoming
W3C `traceparent`), the frontend adds `auth`, `tokenize` and `route` under it, and the trace
context crosses every Serve call explicitly, as a W3C carrier in the request objects
(`GenerationSpec.trace_context`, `PrefillRequest.trace_context`). The pools use only the
OpenTelemetry API; the SDK is set up here, once per process, from `TracingSettings`
(`configure_tracing`, which the app hands each replica as its `telemetry` callable).

Span attributes carry ids, counts, pool names and timings, never prompt or completion text.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from app.config import TracingSettings
from app.errors import error_json_response

logger = logging.getLogger(__name__)

TRACE_ID_HEADER = "x-trace-id"
PROPAGATOR = TraceContextTextMapPropagator()
OTLP_MISSING = (
    "tracing.exporter 'otlp' needs the OTLP exporter, which is not installed: "
    "pip install 'pdserve[otlp]' (opentelemetry-exporter-otlp)"
)

_configure_lock = threading.Lock()
_configured_provider: TracerProvider | None = None

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# ---- providers ---------------------------------------------------------------------------


def sampler_for(settings: TracingSettings) -> Sampler:
    """Follow a remote parent's decision; sample new traces by trace id at `sample_ratio`.
    With no exporter nothing is recorded (span contexts, hence trace ids, still exist)."""
    if settings.exporter == "none":
        return ALWAYS_OFF
    return ParentBased(TraceIdRatioBased(settings.sample_ratio))


def make_exporter(settings: TracingSettings, role: str) -> SpanExporter | None:
    """The exporter `settings` name for a process of `role` (None: no export).

    Raises RuntimeError with an install hint when OTLP is chosen but not installed.
    """
    if settings.exporter == "jsonl":
        assert settings.path is not None  # checked by TracingSettings
        return JsonLinesSpanExporter(Path(settings.path), role)
    if settings.exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise RuntimeError(OTLP_MISSING) from e
        return OTLPSpanExporter(endpoint=settings.endpoint)
    return None


def check_exporter(settings: TracingSettings) -> None:
    """Fail early (in `build_app`) when the chosen exporter cannot be created here."""
    if settings.exporter == "otlp":
        try:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        except ImportError as e:
            raise RuntimeError(OTLP_MISSING) from e


def make_tracer_provider(settings: TracingSettings, role: str) -> TracerProvider:
    """A provider for one process of `role` (ingress, decode:<pool>, prefill:<pool>)."""
    resource = Resource.create(
        {
            "service.name": settings.service_name,
            "pdserve.role": role,
            "process.pid": os.getpid(),
        }
    )
    provider = TracerProvider(resource=resource, sampler=sampler_for(settings))
    exporter = make_exporter(settings, role)
    if exporter is not None:
        provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=settings.export_delay_ms)
        )
    return provider


def configure_tracing(settings: TracingSettings, role: str) -> TracerProvider:
    """Install this process's global tracer provider; later calls return the first one.

    Every replica calls it once at construction (several replicas may share a process in
    tests, and OpenTelemetry allows one global provider per process).
    """
    global _configured_provider
    with _configure_lock:
        if _configured_provider is None:
            provider = make_tracer_provider(settings, role)
            trace.set_tracer_provider(provider)
            _configured_provider = provider
        return _configured_provider


def flush_tracing(timeout_ms: int = 5000) -> bool:
    """Export every finished span of this process now (True when all went out)."""
    provider = _configured_provider
    return provider.force_flush(timeout_ms) if provider is not None else True


# ---- context across calls ------------------------------------------------------------------


def carrier_for(span: Span) -> dict[str, str]:
    """The W3C trace context (`traceparent`, `tracestate`) making `span` a remote parent."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def child_span(tracer: trace.Tracer, name: str) -> AbstractContextManager[Span]:
    """A current span named `name` under the current one; with no current span (a handle
    call, outside any HTTP request) a no-op, rather than a stray one-span trace."""
    if not trace.get_current_span().get_span_context().is_valid:
        return trace.use_span(trace.INVALID_SPAN)
    return tracer.start_as_current_span(name)


def trace_id_of(span: Span) -> str | None:
    """`span`'s trace id as 32 hex digits, or None for the invalid span."""
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


# ---- the JSON-lines exporter ---------------------------------------------------------------


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as a flat JSON object (ids in lowercase hex)."""
    context = span.get_span_context()
    assert context is not None
    parent = span.parent
    return {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [
            {
                "name": event.name,
                "time_unix_nano": event.timestamp,
                "attributes": dict(event.attributes or {}),
            }
            for event in span.events
        ],
        "resource": dict(span.resource.attributes),
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span to `<directory>/<role>-<pid>.jsonl`.

    One file per process, so replicas never interleave partial lines; each export writes
    whole lines and flushes.
    """

    def __init__(self, directory: Path, role: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        safe_role = re.sub(r"[^A-Za-z0-9_.-]", "_", role)
        self.path = directory / f"{safe_role}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export already flushed

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


# ---- the HTTP side -------------------------------------------------------------------------


class TracingMiddleware:
    """ASGI middleware: a server span around each HTTP request, continuing an incoming
    `traceparent`, and the trace id in every response's `x-trace-id` header (streams and
    errors included; an error that escapes the app is answered here, with the id).

    Recent FastAPI versions open that server span themselves (native OpenTelemetry, from
    the global provider and propagator) before any middleware runs; then it is used as is.
    """

    def __init__(self, app: ASGIApp, tracer_provider: trace.TracerProvider | None = None) -> None:
        """`tracer_provider`: where spans go (default: the process's global provider)."""
        self.app = app
        self.tracer_provider = tracer_provider

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        current = trace.get_current_span()
        if current.get_span_context().is_valid:
            await self._serve(current, scope, receive, send)
            return
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in scope.get("headers", [])
            if key in (b"traceparent", b"tracestate")
        }
        tracer = trace.get_tracer("pdserve.ingress", tracer_provider=self.tracer_provider)
        name = f"{scope.get('method', 'GET')} {scope.get('path', '')}"
        with tracer.start_as_current_span(
            name,
            context=PROPAGATOR.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": str(scope.get("method", "")),
                "url.path": str(scope.get("path", "")),
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            await self._serve(span, scope, receive, send)

    async def _serve(self, span: Span, scope: Scope, receive: Receive, send: Send) -> None:
        trace_id = trace_id_of(span)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                if trace_id is not None:
                    headers = [*message.get("headers", [])]
                    headers.append((TRACE_ID_HEADER.encode(), trace_id.encode()))
                    message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await error_json_response(exc)(scope, receive, send_with_id)
