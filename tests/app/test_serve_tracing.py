"""Tracing, the request log and the stats' TTFT breakdown and unit cost, end to end.

One app (1 prefill + 1 decode replica, every prompt prefilled remotely over shm) writes its
spans with the JSON-lines exporter and its request log into a directory beside the model.
The oracles: the span files of three different processes (ingress, decode, prefill) hold
one request's spans under the client's trace id with the parent links the design names;
the response's `x-trace-id` equals that trace id; no prompt text reaches any file; the log
line's token counts equal the client's usage; the stats break TTFT down and price usage.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.app.conftest import wait_until

if TYPE_CHECKING:
    from tests.app.conftest import Server

pytestmark = pytest.mark.slow

SERVED_MODEL = "pdserve-tiny"
# Distinctive text that must never appear in a span or (metadata-only) log line.
PROMPT = "Zebra marmalade whispers to the lighthouse keeper about quartz"
SPANS_TIMEOUT_S = 30.0
PREFILL_USD_PER_HOUR = 2.0
DECODE_USD_PER_HOUR = 3.0


def _dirs(model_dir: Path) -> tuple[Path, Path]:
    base = model_dir.parent / "observability"
    return base / "spans", base / "requests"


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    spans, requests = _dirs(model_dir)
    return {
        "model": {"model": str(model_dir), "num_threads": 1},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": 0,
        "observability": {
            "tracing": {"exporter": "jsonl", "path": str(spans), "export_delay_ms": 200},
            "request_log": {"enabled": True, "path": str(requests)},
            "cost": {
                "pools": {
                    "prefill": {"usd_per_hour": PREFILL_USD_PER_HOUR},
                    "decode": {"usd_per_hour": DECODE_USD_PER_HOUR},
                }
            },
        },
    }


def _spans(directory: Path) -> list[dict[str, Any]]:
    spans = []
    for path in directory.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                spans.append(json.loads(line))
    return spans


def _trace(directory: Path, trace_id: str) -> list[dict[str, Any]]:
    return [s for s in _spans(directory) if s["trace_id"] == trace_id]


def _roles(spans: list[dict[str, Any]]) -> set[str]:
    return {s["resource"]["pdserve.role"] for s in spans}


def _wait_for_trace(directory: Path, trace_id: str, names: set[str]) -> list[dict[str, Any]]:
    """The trace's spans once every span named in `names` was exported."""
    found: list[dict[str, Any]] = []

    def complete() -> bool:
        nonlocal found
        found = _trace(directory, trace_id) if directory.exists() else []
        return names <= {s["name"] for s in found}

    wait_until(complete, SPANS_TIMEOUT_S, f"spans {sorted(names)} of trace {trace_id}")
    return found


def _traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-{'01' if sampled else '00'}", trace_id, parent_id


ROOT = "POST /v1/completions"
ALL_SPANS = {
    ROOT,
    "auth",
    "tokenize",
    "route",
    "decode.generate",
    "decode.reserve",
    "decode.prefill_call",
    "decode.first_step",
    "prefill",
    "prefill.queue",
    "prefill.compute",
    "kv.transfer",
}


def test_one_trace_across_ingress_decode_and_prefill_processes(
    server: Server, model_dir: Path
) -> None:
    spans_dir, requests_dir = _dirs(model_dir)
    traceparent, trace_id, client_span_id = _traceparent()
    response = server.http.post(
        "/v1/completions",
        json={"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0},
        headers={"traceparent": traceparent},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-trace-id"] == trace_id
    usage = response.json()["usage"]

    spans = _wait_for_trace(spans_dir, trace_id, ALL_SPANS)
    by_id = {s["span_id"]: s for s in spans}
    by_name = {s["name"]: s for s in spans}
    for name in ALL_SPANS - {ROOT}:  # FastAPI may add spans of its own; ours are unique
        assert [s["name"] for s in spans].count(name) == 1, name

    # Three processes, none of them this test's.
    pids: dict[str, set[int]] = {}
    for s in spans:
        pids.setdefault(s["resource"]["pdserve.role"], set()).add(s["resource"]["process.pid"])
    assert set(pids) == {"ingress", "decode:decode", "prefill:prefill"}
    assert all(len(p) == 1 for p in pids.values()), pids
    flat = [next(iter(p)) for p in pids.values()]
    assert len(set(flat)) == 3 and os.getpid() not in flat

    # Every parent link resolves inside the trace, except the root's: the client's span.
    (root,) = [s for s in spans if s["parent_span_id"] not in by_id]
    assert root["parent_span_id"] == client_span_id and root["kind"] == "SERVER"
    assert root["resource"]["pdserve.role"] == "ingress"

    def role(span: dict[str, Any]) -> str:
        return str(span["resource"]["pdserve.role"])

    def parent(name: str) -> dict[str, Any]:
        return by_id[by_name[name]["parent_span_id"]]

    def ancestors(name: str) -> list[str]:
        chain, span = [], by_name[name]
        while span["parent_span_id"] in by_id:
            span = by_id[span["parent_span_id"]]
            chain.append(span["span_id"])
        return chain

    for name in ("auth", "tokenize", "route"):
        assert root["span_id"] in ancestors(name) and role(by_name[name]) == "ingress", name
    # decode's span hangs below the ingress's request span; prefill's below decode's call.
    assert role(parent("decode.generate")) == "ingress"
    assert root["span_id"] in ancestors("decode.generate")
    for child in ("decode.reserve", "decode.prefill_call", "decode.first_step"):
        assert parent(child) is by_name["decode.generate"], child
    assert parent("prefill") is by_name["decode.prefill_call"]
    for child in ("prefill.queue", "prefill.compute", "kv.transfer"):
        assert parent(child) is by_name["prefill"], child

    route = by_name["route"]["attributes"]
    assert route["pdserve.route.prefill_pool"] == "prefill"
    assert route["pdserve.route.local_prefill"] is False
    transfer = by_name["kv.transfer"]["attributes"]
    assert transfer["pdserve.transfer.state"] == "done"
    assert transfer["pdserve.transfer.bytes"] > 0
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    layer_events = [e for e in by_name["prefill"]["events"] if e["name"] == "layer_sent"]
    assert [e["attributes"]["layer"] for e in layer_events] == list(range(num_layers))
    end = [e for e in by_name["decode.generate"]["events"] if e["name"] == "stream_end"]
    assert end and end[0]["attributes"]["pdserve.num_output_tokens"] == usage["completion_tokens"]
    assert by_name["decode.generate"]["attributes"]["pdserve.remote_prefill"] is True

    # No prompt text in any span file.
    for path in spans_dir.glob("*.jsonl"):
        assert PROMPT[:20] not in path.read_text(), path

    # The request log's line for this trace: counts as the client saw them, no text.
    lines: list[dict[str, Any]] = []

    def logged() -> bool:
        nonlocal lines
        lines = [
            json.loads(line)
            for path in requests_dir.glob("*.jsonl")
            for line in path.read_text().splitlines()
            if trace_id in line
        ]
        return bool(lines)

    wait_until(logged, SPANS_TIMEOUT_S, "the request log line")
    (line,) = lines
    assert line["status"] == 200
    assert line["num_prompt_tokens"] == usage["prompt_tokens"]
    assert line["num_output_tokens"] == usage["completion_tokens"]
    assert line["route"]["prefill_pool"] == "prefill"
    assert line["ttft_breakdown"]["remote"] is True
    assert "content" not in line
    for path in requests_dir.glob("*.jsonl"):
        assert PROMPT[:20] not in path.read_text(), path


def test_streams_errors_and_unsampled_parents(server: Server, model_dir: Path) -> None:
    spans_dir, _ = _dirs(model_dir)
    body = {"model": SERVED_MODEL, "prompt": "stream me", "max_tokens": 3, "stream": True}
    unsampled, unsampled_id, _ = _traceparent(sampled=False)
    with server.http.stream(
        "POST", "/v1/completions", json=body, headers={"traceparent": unsampled}
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-trace-id"] == unsampled_id
        assert any(line.startswith("data:") for line in response.iter_lines())

    error = server.http.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"})
    assert error.status_code == 404
    assert len(error.headers["x-trace-id"]) == 32

    # A sampled request after the unsampled one: once its spans are out in every process,
    # the unsampled request's would be too, had any been recorded.
    sampled, sampled_id, _ = _traceparent()
    ok = server.http.post(
        "/v1/completions", json={**body, "stream": False}, headers={"traceparent": sampled}
    )
    assert ok.status_code == 200 and ok.headers["x-trace-id"] == sampled_id
    _wait_for_trace(spans_dir, sampled_id, {"POST /v1/completions", "decode.generate", "prefill"})
    assert _trace(spans_dir, unsampled_id) == []


def test_stats_break_ttft_down_and_price_usage(server: Server) -> None:
    started = time.time()  # the tests above sent requests too: `since` leaves them out
    for _ in range(2):
        response = server.http.post(
            "/v1/completions", json={"model": SERVED_MODEL, "prompt": "price me", "max_tokens": 4}
        )
        assert response.status_code == 200
    stats = server.http.get("/v1/pdserve/stats", params={"since": str(started)}).json()
    breakdown = stats["ttft_breakdown"]
    assert breakdown["num_requests"] == 2 and breakdown["num_remote_prefill"] == 2
    for phase in ("queue_ms", "prefill_ms", "transfer_ms", "handover_ms", "first_step_ms"):
        assert breakdown[phase]["p50"] is not None and breakdown[phase]["p50"] >= 0, phase
    assert breakdown["prefill_ms"]["p50"] > 0
    cost = stats["cost"]
    assert cost["usd_per_hour"] == {"prefill": PREFILL_USD_PER_HOUR, "decode": DECODE_USD_PER_HOUR}
    assert cost["num_requests"] >= 2
    hours = cost["replica_hours"]
    expected = PREFILL_USD_PER_HOUR * hours["prefill"] + DECODE_USD_PER_HOUR * hours["decode"]
    assert cost["usd_total"] == pytest.approx(expected)
    tokens = cost["num_prompt_tokens"] + cost["num_generated_tokens"]
    assert cost["usd_per_1m_tokens"] == pytest.approx(expected / tokens * 1e6)
    bad = server.http.get("/v1/pdserve/stats", params={"since": "yesterday"})
    assert bad.status_code == 400
