"""Batch jobs end to end: the official `openai` client against a running app (Ray Serve).

files.create -> batches.create -> completed -> files.content, with every answer equal to the
same request sent online (greedy); tenants see only their own objects; an upload over the
limit is a 413; and an ingress replica SIGKILLed mid-job: Serve starts another, which takes
the job over from the store once the lease runs out, and every line appears exactly once.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest

from app.serve.apps import INGRESS_DEPLOYMENT
from bench.serve.faults import replica_pids, signal_pid, wait_for_new_replica

if TYPE_CHECKING:  # conftest is pytest's to import; its types are only needed for hints
    from tests.app.conftest import Server

pytestmark = pytest.mark.slow

APP = "pdserve"
SERVED_MODEL = "pdserve-tiny"
ACME = "sk-acme-batch-0001"
GLOBEX = "sk-globex-batch-0001"
ADMIN = "sk-admin-batch-0001"
MAX_FILE_BYTES = 64 * 1024
LEASE_TTL_S = 3.0
JOB_TIMEOUT_S = 240.0
RESTART_TIMEOUT_S = 120.0


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1, "kv_cache_bytes": 32 * 1024**2},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {"backend": "shm"},
        "local_prefill_threshold": 16,
        "admission": {
            "classes": [
                {"name": "interactive", "ttft_s": 1.0, "tpot_s": 0.1, "priority": 0},
                {"name": "batch", "ttft_s": 30.0, "tpot_s": 1.0, "priority": 10},
            ]
        },
        "tenants": [
            {"name": "acme", "api_keys": [ACME], "default_class": "interactive"},
            {"name": "globex", "api_keys": [GLOBEX], "default_class": "interactive"},
        ],
        "admin_api_keys": [ADMIN],
        "batch": {
            "store_dir": str(model_dir.parent / "batch-store"),
            "max_file_bytes": MAX_FILE_BYTES,
            "max_concurrency": 8,
            "lease_ttl_s": LEASE_TTL_S,
            "poll_s": 0.5,
        },
    }


def completion_body(i: int, max_tokens: int = 12) -> dict[str, Any]:
    prompt = f"Request {i}: " + "".join(chr(97 + (i * 7 + k) % 26) for k in range(5 + i % 40))
    return {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def jsonl(url: str, bodies: list[dict[str, Any]]) -> bytes:
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}
        for i, body in enumerate(bodies)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = JOB_TIMEOUT_S) -> Any:
    """Poll the batch until it is finished (errors while an ingress restarts are retried)."""
    deadline = time.monotonic() + timeout_s
    batch = None
    while time.monotonic() < deadline:
        try:
            batch = client.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
            time.sleep(0.5)
            continue
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    pytest.fail(f"batch {batch_id} not finished after {timeout_s}s: {batch}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(raw) for raw in client.files.content(file_id).text.splitlines()]


def test_openai_batch_round_trip_equals_online(server: Server) -> None:
    client = server.openai(ACME)
    bodies = [completion_body(i) for i in range(10)]
    file = client.files.create(file=("in.jsonl", jsonl("/v1/completions", bodies)), purpose="batch")
    assert file.purpose == "batch" and file.bytes > 0
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"job": "round-trip"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "round-trip"}
    done = wait_done(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (10, 10)
    assert done.error_file_id is None
    assert done.metadata is not None and float(done.metadata["pdserve_replica_seconds"]) > 0
    assert done.usage is not None and done.usage.output_tokens > 0

    output = lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(10))
    for line in output:
        assert line["response"]["status_code"] == 200
        i = int(line["custom_id"].removeprefix("req-"))
        online = client.completions.create(**bodies[i])
        assert line["response"]["body"]["choices"][0]["text"] == online.choices[0].text
        usage = line["response"]["body"]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            online.usage.prompt_tokens,
            online.usage.completion_tokens,
        )
    assert client.batches.list().data[0].id == batch.id
    # The ingress's pacing is readable (`pdserve bench batch` waits for `idle` before its
    # idle job); the job is over, so no line is in flight.
    pacing = server.stats()["batch"]
    assert pacing["jobs_running"] == 0 and pacing["lines_in_flight"] == 0
    assert isinstance(pacing["idle"], bool) and pacing["quiet_period_s"] >= 3.0


def test_chat_batch_with_a_bad_line(server: Server) -> None:
    client = server.openai(ACME)
    messages = [{"role": "user", "content": "hello there"}]
    bodies = [
        {"model": SERVED_MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
        {"model": SERVED_MODEL, "messages": messages, "max_tokens": 8, "temperature": -3},
        {"model": "no-such-model", "messages": messages, "max_tokens": 8},
    ]
    content = jsonl("/v1/chat/completions", bodies) + b"{not json}\n"
    file = client.files.create(file=("chat.jsonl", content), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_done(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 3)
    output = lines_of(client, done.output_file_id)
    online = client.chat.completions.create(**bodies[0])
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == (
        online.choices[0].message.content
    )
    errors = lines_of(client, done.error_file_id)
    assert [e["response"]["status_code"] for e in errors] == [400, 404, 400]
    assert [e["custom_id"] for e in errors] == ["req-1", "req-2", None]


def test_tenants_see_only_their_own(server: Server) -> None:
    acme, globex = server.openai(ACME), server.openai(GLOBEX)
    file = acme.files.create(
        file=("in.jsonl", jsonl("/v1/completions", [completion_body(1)])), purpose="batch"
    )
    batch = acme.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    for call in (
        lambda: globex.files.retrieve(file.id),
        lambda: globex.files.content(file.id),
        lambda: globex.batches.retrieve(batch.id),
        lambda: globex.batches.cancel(batch.id),
        lambda: globex.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert all(b.id != batch.id for b in globex.batches.list().data)
    assert all(f.id != file.id for f in globex.files.list().data)
    with pytest.raises(openai.AuthenticationError):
        server.openai("sk-nobody").batches.list()
    wait_done(acme, batch.id)


def test_upload_over_the_limit_is_413(server: Server) -> None:
    client = server.openai(ACME)
    with pytest.raises(openai.APIStatusError) as raised:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert raised.value.status_code == 413
    assert "file limit" in raised.value.message
    with pytest.raises(openai.BadRequestError):  # an endpoint batches do not run
        file = client.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
        )


def test_cli_submit_waits_and_writes_the_output(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.batch.cli import main

    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl("/v1/completions", [completion_body(i) for i in range(4)]))
    out = tmp_path / "out.jsonl"
    # As README writes it: the service's options after the action.
    argv = ["submit", str(source), "--url", server.base_url, "--api-key", ACME, "--wait"]
    assert main([*argv, "--out", str(out), "--poll-s", "0.2", "--json"]) == 0
    captured = capsys.readouterr()
    batch = json.loads(captured.out)
    assert batch["status"] == "completed"
    assert len(out.read_bytes().splitlines()) == 4
    assert "4/4 lines" in captured.err
    assert "tokens/s" in captured.err and "replica-seconds" in captured.err


def test_ingress_killed_mid_job_completes_each_line_once(server: Server) -> None:
    client = server.openai(ACME)
    # Lengths spread over 8..196 tokens: lines finish one after another over the job, so
    # the loop below sees some, not all, done (equal lines run in one batch and finish
    # within one progress write of each other).
    bodies = [completion_body(i, max_tokens=8 + 4 * i) for i in range(48)]
    file = client.files.create(
        file=("kill.jsonl", jsonl("/v1/completions", bodies)), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    (pid,) = replica_pids(APP, INGRESS_DEPLOYMENT)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:  # kill it once some lines, not all, are done
        current = client.batches.retrieve(batch.id)
        counts = current.request_counts
        assert current.status in ("validating", "in_progress"), current
        if counts is not None and 0 < counts.completed < counts.total:
            break
        assert time.monotonic() < deadline, "the job never got under way"
        time.sleep(0.05)
    assert signal_pid(pid, signal.SIGKILL)
    assert wait_for_new_replica(APP, INGRESS_DEPLOYMENT, {pid}, RESTART_TIMEOUT_S) is not None

    done = wait_done(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (48, 0)
    output = lines_of(client, done.output_file_id)
    ids = [o["custom_id"] for o in output]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(48))  # each exactly once
    assert all(o["response"]["status_code"] == 200 for o in output)
    for line in output[::8]:
        i = int(line["custom_id"].removeprefix("req-"))
        online = client.completions.create(**bodies[i])
        assert line["response"]["body"]["choices"][0]["text"] == online.choices[0].text
