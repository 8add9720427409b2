"""`pdserve bench overload`: its report from records (attainment, goodput, shed reasons,
Retry-After, hung), the admission-off config, the class plans and arrivals, the client's
classification of real HTTP answers (a local server that refuses, and one that never answers),
and one short run of the command in Serve."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cli import main
from app.config import ConfigError, load_config
from bench.overload.load import client_session, send
from bench.overload.plan import (
    OFF_MAX_QUEUED_REQUESTS,
    ClassPlan,
    admission_off,
    arrivals,
    class_plans,
    class_rates,
    without_quotas,
)
from bench.overload.report import (
    ClassSLO,
    Record,
    classify,
    human_table,
    joint_attainment,
    mode_report,
    plot,
    shed_reason,
)
from bench.serve.deploy import app_args

INTERACTIVE, BATCH = ClassSLO(1.0, 0.1), ClassSLO(30.0, 1.0)
SLOS = {"interactive": INTERACTIVE, "batch": BATCH}


def _ok(index: int, slo_class: str, ttft_s: float, tpot_s: float | None) -> Record:
    return Record(index, slo_class, 0.0, 1.0, "ok", 200, ttft_s=ttft_s, tpot_s=tpot_s)


def _shed(index: int, slo_class: str, status: int, code: str, retry: str | None) -> Record:
    return Record(index, slo_class, 0.0, 0.1, "shed", status, code, retry)


def _records() -> list[Record]:
    return [
        _ok(0, "interactive", 0.5, 0.05),  # meets
        _ok(1, "interactive", 0.5, None),  # one token: judged by TTFT alone, meets
        _ok(2, "interactive", 1.5, 0.05),  # TTFT missed
        _ok(3, "interactive", 0.5, 0.2),  # TPOT missed
        _shed(4, "interactive", 503, "overloaded", "2"),
        _ok(5, "batch", 20.0, 0.5),  # meets
        _shed(6, "batch", 429, "tenant_queue_full", "1"),
        _shed(7, "batch", 429, "tenant_queue_full", "1"),
        _shed(8, "batch", 503, "overloaded", None),
        Record(9, "batch", 0.0, 60.0, "hung", None, error="no end within 60 s"),
        Record(10, "batch", 0.0, 31.0, "error", 504, "deadline_exceeded"),
    ]


def test_meets_checks_ttft_and_tpot_of_completed_requests_only() -> None:
    assert _ok(0, "interactive", 1.0, 0.1).meets(INTERACTIVE)  # at the limit
    assert not _ok(0, "interactive", 1.01, 0.1).meets(INTERACTIVE)
    assert not _ok(0, "interactive", 0.1, 0.11).meets(INTERACTIVE)
    late_error = Record(0, "interactive", 0.0, 1.0, "error", 200, ttft_s=0.1, tpot_s=0.01)
    assert not late_error.meets(INTERACTIVE)  # tokens then an error event: a miss


def test_classify_and_shed_reason() -> None:
    assert classify(429, streamed_tokens=False) == "shed"
    assert classify(503, streamed_tokens=False) == "shed"
    assert classify(504, streamed_tokens=False) == "error"
    assert classify(500, streamed_tokens=False) == "error"
    assert classify(503, streamed_tokens=True) == "error"
    assert shed_reason(_shed(0, "batch", 429, "tenant_rate_limit", "1")) == "429 tenant_rate_limit"
    assert shed_reason(_shed(0, "batch", 503, "", None)) == "503 no_code"
    assert shed_reason(_ok(0, "batch", 1.0, 0.1)) is None


def test_mode_report_shape_and_counts() -> None:
    report = mode_report(_records(), SLOS, duration_s=10.0)
    interactive, batch = report["interactive"], report["batch"]
    assert interactive["attainment"] == pytest.approx(2 / 5)
    assert interactive["goodput"] == pytest.approx(0.2)
    assert (interactive["sent"], interactive["ok"], interactive["shed"]) == (5, 4, 1)
    assert batch["attainment"] == pytest.approx(1 / 6)
    assert batch["goodput"] == pytest.approx(0.1)
    assert (batch["shed"], batch["hung"], batch["error"]) == (3, 1, 1)
    assert report["shed"] == {"429 tenant_queue_full": 2, "503 overloaded": 2}
    assert report["shed_by_class"]["interactive"] == {"503 overloaded": 1}
    assert report["retry_after"] == {"with_header": 3, "without_header": 1}
    assert report["errors"] == {"504 deadline_exceeded": 1}
    assert report["hung"] == 1
    assert report["sent"] == 11
    json.dumps(report)  # JSON-ready as is
    assert joint_attainment(_records(), SLOS) == pytest.approx(3 / 11)


def test_mode_report_of_a_class_without_requests() -> None:
    report = mode_report([_ok(0, "interactive", 0.1, 0.01)], SLOS, duration_s=5.0)
    assert report["interactive"]["attainment"] == 1.0
    assert math.isnan(report["batch"]["attainment"])
    assert report["batch"]["goodput"] == 0.0
    assert report["shed"] == {} and report["hung"] == 0


def test_table_and_plot(tmp_path: Path) -> None:
    on = mode_report(_records(), SLOS, 10.0)
    off = mode_report([_ok(0, "interactive", 5.0, 0.5), _ok(1, "batch", 40.0, 2.0)], SLOS, 10.0)
    document = {
        "config": "cpu-tenants",
        "admission_on": on,
        "admission_off": off,
        "offered_rate": 6.0,
        "calibration": {"goodput": 2.0},
    }
    table = human_table(document, ["interactive", "batch"])
    assert "admission_on        interactive" in table and "hung 1" in table and "hung 0" in table
    path = plot(document, ["interactive", "batch"], tmp_path / "overload.png")
    assert Path(path).stat().st_size > 0


# ------------------------------------------------------------------------------ the configs


@pytest.fixture(scope="module")
def tenants_args() -> dict:
    return app_args("cpu-tenants")


def test_admission_off_disables_every_admission_feature(tenants_args: dict) -> None:
    before = json.dumps(tenants_args, sort_keys=True)
    off_args, changes = admission_off(tenants_args)
    assert json.dumps(tenants_args, sort_keys=True) == before  # the input is not changed
    off = load_config(off_args)
    on = load_config(tenants_args)
    assert on.overload.shedding.enabled and not off.overload.shedding.enabled
    assert {c.priority for c in off.admission.classes} == {0}
    assert [c.name for c in off.admission.classes] == [c.name for c in on.admission.classes]
    for tenant, original in zip(off.tenants, on.tenants, strict=True):
        assert tenant.max_concurrent_requests is None
        assert tenant.quota == type(tenant.quota)()  # no limit at all
        assert tenant.api_keys == original.api_keys
        assert tenant.allowed_pools == original.allowed_pools
    assert {p.max_queued_requests for p in off.pools} == {OFF_MAX_QUEUED_REQUESTS}
    assert "overload.shedding.enabled: false" in changes
    assert any("globex" in c and "quota" in c for c in changes)


def test_without_quotas_keeps_shedding_and_priorities(tenants_args: dict) -> None:
    args, changes = without_quotas(tenants_args)
    config, on = load_config(args), load_config(tenants_args)
    assert all(t.max_concurrent_requests is None for t in config.tenants)
    assert all(t.quota == type(t.quota)() for t in config.tenants)
    assert config.overload == on.overload and config.admission == on.admission
    assert [p.max_queued_requests for p in config.pools] == [
        p.max_queued_requests for p in on.pools
    ]
    assert len(changes) == 2  # acme and globex


def _options(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "classes": ["interactive", "batch"],
        "interactive_prompt_tokens": 100,
        "interactive_max_tokens": 10,
        "batch_prompt_tokens": 900,
        "batch_max_tokens": 200,
        "prompt_tokens": 50,
        "max_tokens": 5,
    }
    return argparse.Namespace(**(values | overrides))


def test_class_plans_pick_each_class_tenant(tenants_args: dict) -> None:
    interactive, batch = class_plans(tenants_args, _options())
    assert (interactive.tenant, interactive.prompt_tokens, interactive.max_tokens) == (
        "acme",
        100,
        10,
    )
    assert interactive.slo == INTERACTIVE
    assert (batch.tenant, batch.prompt_tokens, batch.max_tokens) == ("globex", 900, 200)
    assert batch.api_key == "sk-globex-0123456789abcdef"
    with pytest.raises(ConfigError, match="premium"):
        class_plans(tenants_args, _options(classes=["premium"]))


def test_rates_and_arrivals() -> None:
    plans = [
        ClassPlan("interactive", "acme", "k1", 20, 4, INTERACTIVE),
        ClassPlan("batch", "globex", "k2", 40, 8, BATCH),
    ]
    rates = class_rates(plans, 10.0, 0.2)
    assert rates == pytest.approx({"interactive": 2.0, "batch": 8.0})
    first = arrivals(plans, rates, 30.0, seed=3)
    assert first == arrivals(plans, rates, 30.0, seed=3)  # deterministic
    assert [a.at_s for a in first] == sorted(a.at_s for a in first)
    assert all(0 <= a.at_s < 30.0 for a in first)
    by_class = {name: [a for a in first if a.slo_class == name] for name in rates}
    assert len(by_class["batch"]) > len(by_class["interactive"]) > 0
    # Byte-level tokenizer: one character per token, plus BOS.
    assert {len(a.prompt) for a in by_class["interactive"]} == {19}
    assert {len(a.prompt) for a in by_class["batch"]} == {39}


# ------------------------------------------------- the client against real HTTP answers


@pytest.fixture()
def http_server() -> Iterator[tuple[str, list[bytes]]]:
    """A local HTTP/1.1 server: `/refuse` answers 429 with Retry-After and an OpenAI error
    body, anything else is read and never answered. Yields its URL and the requests seen."""
    seen: list[bytes] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()
    connections: list[socket.socket] = []

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            connections.append(conn)
            request = conn.recv(65536)
            seen.append(request)
            if request.startswith(b"POST /refuse"):
                body = json.dumps(
                    {"error": {"message": "over quota", "code": "tenant_queue_full"}}
                ).encode()
                head = "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\n"
                head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                conn.sendall(head.encode() + body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    stop.set()
    thread.join(timeout=5)
    for conn in connections:
        conn.close()
    listener.close()


async def _send_to(url: str, path: str, hung_after_s: float) -> Record:
    plan = ClassPlan("batch", "globex", "sk-test", 20, 4, BATCH)
    record = Record(0, "batch", 0.0)
    async with client_session() as session:
        await send(session, url + path, "m", plan, "hello", record, 5.0, hung_after_s, t0=0.0)
    return record


def test_send_records_a_refusal_with_its_retry_after(
    http_server: tuple[str, list[bytes]],
) -> None:
    url, seen = http_server
    record = asyncio.run(_send_to(url, "/refuse", hung_after_s=10.0))
    assert (record.outcome, record.status, record.code) == ("shed", 429, "tenant_queue_full")
    assert record.retry_after == "3"
    assert shed_reason(record) == "429 tenant_queue_full"
    request = seen[0].decode().lower()
    assert "authorization: bearer sk-test" in request
    assert "x-pdserve-timeout: 5" in request


def test_send_marks_a_request_without_an_answer_hung(
    http_server: tuple[str, list[bytes]],
) -> None:
    url, _ = http_server
    record = asyncio.run(_send_to(url, "/silent", hung_after_s=1.0))
    assert record.outcome == "hung"
    assert record.status is None and record.end_s is not None
    assert mode_report([record], SLOS, 1.0)["hung"] == 1


# ------------------------------------------------------------------------ the command, in Serve


@pytest.mark.slow
def test_bench_overload_admission_on_smoke(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One mode, a given goodput, 8 s of load: the JSON's shape and its invariants."""
    out = tmp_path / "overload.json"
    argv = ["bench", "overload", "--config", "cpu-tenants", "--model", str(tiny_model_dir)]
    argv += ["--modes", "on", "--goodput", "2", "--duration", "8", "--no-progress"]
    argv += ["--batch-max-tokens", "64", "--json", str(out)]
    assert main(argv) == 0

    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    document = json.loads(out.read_text())
    on = document["admission_on"]
    assert printed["admission_on"] == on
    assert document["offered_rate"] == pytest.approx(6.0)
    assert document["calibration"]["goodput"] == 2.0
    records = document["records"]["admission_on"]
    assert on["sent"] == len(records) > 10
    for name in ("interactive", "batch"):
        entry = on[name]
        assert 0 <= entry["attainment"] <= 1 and entry["goodput"] >= 0
        assert entry["sent"] == sum(entry[k] for k in ("ok", "shed", "error", "hung"))
    # Every request ended within its deadline; a refused one says why and when to retry.
    assert on["hung"] == 0
    assert all(reason.split()[0] in ("429", "503") for reason in on["shed"])
    assert on["retry_after"]["without_header"] == 0
    assert on["interactive"]["ok"] == on["interactive"]["sent"], on["errors"]
    assert Path(document["plot"]).is_file()
    assert "load_average_before" in document["machine"]["admission_on"]
