"""Tracing without Serve: sampling, the JSON-lines exporter, W3C carriers, the middleware."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from app.config import TracingSettings
from app.errors import BadRequestError, install_error_handlers
from app.observability.tracing import (
    PROPAGATOR,
    TRACE_ID_HEADER,
    TracingMiddleware,
    carrier_for,
    child_span,
    make_tracer_provider,
    trace_id_of,
)


def _jsonl(tmp_path: Path, ratio: float = 1.0) -> TracingSettings:
    return TracingSettings(exporter="jsonl", path=str(tmp_path), sample_ratio=ratio)


def _lines(directory: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in directory.glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]


def test_settings_need_a_destination() -> None:
    with pytest.raises(ValidationError, match="needs tracing.path"):
        TracingSettings(exporter="jsonl")
    with pytest.raises(ValidationError, match="needs tracing.endpoint"):
        TracingSettings(exporter="otlp")
    with pytest.raises(ValidationError):
        TracingSettings(sample_ratio=1.5)


def test_new_traces_are_sampled_at_the_ratio(tmp_path: Path) -> None:
    provider = make_tracer_provider(_jsonl(tmp_path, 0.25), "test")
    tracer = provider.get_tracer("t")
    recorded = 0
    for _ in range(4000):
        span = tracer.start_span("root")
        recorded += span.is_recording()
        span.end()
    assert 800 < recorded < 1200
    provider.shutdown()
    assert len(_lines(tmp_path)) == recorded


def test_remote_parents_decide(tmp_path: Path) -> None:
    never = make_tracer_provider(_jsonl(tmp_path, 0.0), "test").get_tracer("t")
    always = make_tracer_provider(_jsonl(tmp_path, 1.0), "test").get_tracer("t")
    trace_id = secrets.token_hex(16)
    sampled = PROPAGATOR.extract({"traceparent": f"00-{trace_id}-{'1' * 16}-01"})
    unsampled = PROPAGATOR.extract({"traceparent": f"00-{trace_id}-{'1' * 16}-00"})
    assert never.start_span("child", context=sampled).is_recording()
    child = always.start_span("child", context=unsampled)
    assert not child.is_recording()
    assert trace_id_of(child) == trace_id  # the id still travels (x-trace-id)


def test_no_exporter_records_nothing_but_makes_ids() -> None:
    span = make_tracer_provider(TracingSettings(), "test").get_tracer("t").start_span("s")
    assert not span.is_recording() and trace_id_of(span) is not None


def test_carrier_makes_a_remote_parent_and_lines_link(tmp_path: Path) -> None:
    provider = make_tracer_provider(_jsonl(tmp_path), "role:a/b")
    tracer = provider.get_tracer("t")
    parent = tracer.start_span("parent", attributes={"n": 3})
    carrier = carrier_for(parent)
    child = tracer.start_span("child", context=PROPAGATOR.extract(carrier))
    child.add_event("e", {"k": 1})
    child.end()
    parent.end()
    provider.shutdown()
    (path,) = tmp_path.glob("*.jsonl")
    assert path.name.startswith("role_a_b-")  # no separators from the role in the name
    lines = {line["name"]: line for line in _lines(tmp_path)}
    assert lines["child"]["parent_span_id"] == lines["parent"]["span_id"]
    assert lines["child"]["trace_id"] == lines["parent"]["trace_id"] == trace_id_of(parent)
    assert lines["parent"]["parent_span_id"] is None
    assert lines["parent"]["attributes"] == {"n": 3}
    assert lines["child"]["events"][0]["attributes"] == {"k": 1}
    assert lines["child"]["resource"]["pdserve.role"] == "role:a/b"


def test_otlp_without_the_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from app.observability import tracing

    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    settings = TracingSettings(exporter="otlp", endpoint="http://127.0.0.1:4318/v1/traces")
    with pytest.raises(RuntimeError, match=r"pdserve\[otlp\]"):
        tracing.check_exporter(settings)
    with pytest.raises(RuntimeError, match=r"pdserve\[otlp\]"):
        tracing.make_exporter(settings, "ingress")


async def _ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def _stream(request: Request) -> StreamingResponse:
    async def body():  # noqa: ANN202
        yield "a"
        yield "b"

    return StreamingResponse(body())


async def _bad(request: Request) -> JSONResponse:
    raise BadRequestError("nope")


async def _crash(request: Request) -> JSONResponse:
    raise RuntimeError("boom")


@pytest.fixture
def app_and_dir(tmp_path: Path):  # noqa: ANN201
    provider = make_tracer_provider(_jsonl(tmp_path), "ingress")
    routes = [
        Route("/ok", _ok),
        Route("/stream", _stream),
        Route("/bad", _bad),
        Route("/crash", _crash),
    ]
    app = Starlette(routes=routes)
    install_error_handlers(app)  # type: ignore[arg-type]
    app.add_middleware(TracingMiddleware, tracer_provider=provider)
    yield app, provider, tmp_path


def test_middleware_returns_the_trace_id_everywhere(app_and_dir) -> None:  # noqa: ANN001
    app, provider, directory = app_and_dir
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
            return [
                await client.get("/ok", headers=headers),
                await client.get("/stream"),
                await client.get("/bad"),
                await client.get("/crash"),
            ]

    ok, stream, bad, crash = asyncio.run(send())
    assert ok.headers[TRACE_ID_HEADER] == trace_id
    assert stream.text == "ab" and len(stream.headers[TRACE_ID_HEADER]) == 32
    assert bad.status_code == 400 and len(bad.headers[TRACE_ID_HEADER]) == 32
    assert crash.status_code == 500 and crash.json()["error"]["type"] == "server_error"
    assert len(crash.headers[TRACE_ID_HEADER]) == 32
    provider.force_flush()
    spans = {line["trace_id"]: line for line in _lines(directory)}
    assert spans[trace_id]["parent_span_id"] == parent_id
    assert spans[trace_id]["kind"] == "SERVER"
    assert spans[trace_id]["attributes"]["http.response.status_code"] == 200
    assert spans[crash.headers[TRACE_ID_HEADER]]["status"] == "ERROR"


def test_child_spans_only_under_a_current_span(tmp_path: Path) -> None:
    from opentelemetry import trace

    provider = make_tracer_provider(_jsonl(tmp_path), "ingress")
    tracer = provider.get_tracer("t")
    with child_span(tracer, "orphan") as orphan:
        assert not orphan.get_span_context().is_valid  # no stray one-span trace
    with tracer.start_as_current_span("request") as request, child_span(tracer, "auth") as auth:
        assert auth.get_span_context().trace_id == request.get_span_context().trace_id
    assert not trace.get_current_span().get_span_context().is_valid
    provider.shutdown()
    assert sorted(line["name"] for line in _lines(tmp_path)) == ["auth", "request"]
