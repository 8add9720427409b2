"""A batch job's life in the store, without Ray: the runner against a scripted front door.

The front door is replaced by `Door`, whose answers each test scripts (200 echoes, load
refusals, lines held until released); the store, the result log, the lease and the runner are
the real ones, on a temporary directory.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from app.batch.execute import LineOutcome
from app.batch.jobs import JobStore
from app.batch.lines import InputLine
from app.batch.pacing import Pacer, Window
from app.batch.runner import JobRunner
from app.batch.store import FileStore
from app.config import BatchSettings
from app.errors import BadRequestError

ENDPOINT = "/v1/completions"


def line(custom_id: str, prompt: str = "hi", url: str = ENDPOINT) -> bytes:
    body = {"model": "m", "prompt": prompt, "max_tokens": 2}
    item = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return json.dumps(item).encode() + b"\n"


class Door:
    """The front door's stand-in: answers 200 with the prompt, after `hold` is set for the
    prompts in `held`; `refuse[prompt]` first answers are 429."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.held: set[str] = set()
        self.hold = asyncio.Event()
        self.refuse: Counter[str] = Counter()
        self.started = asyncio.Event()

    async def __call__(self, tenant: str, endpoint: str, body: Mapping[str, Any]) -> LineOutcome:
        prompt = str(body["prompt"])
        self.calls[prompt] += 1
        if self.refuse[prompt]:
            self.refuse[prompt] -= 1
            return LineOutcome(429, {"error": {"message": "later"}})
        if prompt in self.held:
            self.started.set()
            await self.hold.wait()
        return LineOutcome(200, {"text": prompt, "tenant": tenant}, f"req-{prompt}", 3, 2)


class Job:
    """A store on `root`, one uploaded file and a batch over it."""

    def __init__(self, root: Path, content: bytes, tenant: str = "acme") -> None:
        self.files = FileStore(root)
        self.jobs = JobStore(root)
        self.tenant = tenant
        self.settings = BatchSettings(store_dir=str(root), retry_backoff_s=0.001)
        file = self.files.create(tenant, "in.jsonl", "batch", content)
        self.batch = self.jobs.create(tenant, file["id"], ENDPOINT, "24h", {"k": "v"})
        self.id = self.batch["id"]

    def runner(self, door: Door, owner: str = "replica-a") -> JobRunner:
        assert self.jobs.claim(self.id, owner, self.settings.lease_ttl_s)
        pacer = Pacer(self.settings)
        return JobRunner(
            self.id,
            owner,
            self.jobs,
            self.files,
            self.settings,
            door,
            Window(4),
            pacer,
            lambda active_s, num_in, num_out: {"pdserve_tokens": str(num_in + num_out)},
        )

    def get(self) -> dict[str, Any]:
        return self.jobs.get(self.tenant, self.id)

    def output(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        data = self.files.content(self.tenant, file_id)
        return [json.loads(raw) for raw in data.splitlines()]


def test_job_completes_with_output_and_error_files(tmp_path: Path) -> None:
    content = line("a", "p0") + b"not json\n" + line("b", "p1") + b"\n" + line("c", "p2", "/x")
    job = Job(tmp_path, content)
    door = Door()
    asyncio.run(job.runner(door).run())

    batch = job.get()
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    output = job.output(batch["output_file_id"])
    assert [o["custom_id"] for o in output] == ["a", "b"]
    assert all(o["response"]["status_code"] == 200 for o in output)
    assert output[0]["response"]["body"] == {"text": "p0", "tenant": "acme"}
    errors = job.output(batch["error_file_id"])
    assert [e["custom_id"] for e in errors] == [None, "c"]
    assert all(e["response"]["status_code"] == 400 for e in errors)
    assert "url must be the batch's endpoint" in errors[1]["response"]["body"]["error"]["message"]
    assert batch["usage"]["input_tokens"] == 6 and batch["usage"]["output_tokens"] == 4
    assert batch["metadata"] == {"k": "v", "pdserve_tokens": "10"}
    assert job.jobs.active_ids() == []


def test_resumed_job_runs_each_line_once(tmp_path: Path) -> None:
    """A runner killed after recording two lines (and mid-way through a third's record):
    the next runner runs only the others, and the output holds every line once."""
    job = Job(tmp_path, b"".join(line(f"c{i}", f"p{i}") for i in range(6)))
    log = job.jobs.results(job.id)
    log.open()
    for i in (0, 3):
        log.append(
            {
                "index": i,
                "custom_id": f"c{i}",
                "status_code": 200,
                "body": {"text": "old"},
                "request_id": None,
                "num_prompt_tokens": 1,
                "num_output_tokens": 1,
            }
        )
    log.close()
    with open(log.path, "ab") as f:
        f.write(b'{"index": 4, "custom_id": "c4", "status_co')  # torn by the kill

    door = Door()
    asyncio.run(job.runner(door, owner="replica-b").run())

    assert set(door.calls) == {"p1", "p2", "p4", "p5"}
    assert all(n == 1 for n in door.calls.values())
    batch = job.get()
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    output = job.output(batch["output_file_id"])
    assert [o["custom_id"] for o in output] == [f"c{i}" for i in range(6)]
    assert output[3]["response"]["body"] == {"text": "old"}
    assert all(json.loads(raw) for raw in log.path.read_bytes().splitlines())


def test_cancel_stops_new_lines_and_keeps_finished_ones(tmp_path: Path) -> None:
    job = Job(tmp_path, b"".join(line(f"c{i}", f"p{i}") for i in range(12)))
    door = Door()
    door.held = {f"p{i}" for i in range(2, 12)}

    async def scenario() -> None:
        task = asyncio.create_task(job.runner(door).run())
        await door.started.wait()
        while len(job.jobs.results(job.id).read()) < 2:
            await asyncio.sleep(0.01)
        assert job.jobs.cancel(job.tenant, job.id)["status"] == "cancelling"
        await task

    asyncio.run(scenario())
    batch = job.get()
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    assert batch["request_counts"] == {"total": 12, "completed": 2, "failed": 0}
    assert [o["custom_id"] for o in job.output(batch["output_file_id"])] == ["c0", "c1"]
    assert sum(door.calls.values()) <= 2 + 4  # at most a window's worth were started
    assert job.jobs.cancel(job.tenant, job.id)["status"] == "cancelled"


def test_a_finished_job_cannot_be_cancelled(tmp_path: Path) -> None:
    job = Job(tmp_path, line("a"))
    asyncio.run(job.runner(Door()).run())
    with pytest.raises(BadRequestError, match="Cannot cancel a batch with status 'completed'"):
        job.jobs.cancel(job.tenant, job.id)


def test_lines_refused_for_load_are_retried_not_failed(tmp_path: Path) -> None:
    job = Job(tmp_path, line("a", "p0") + line("b", "p1"))
    door = Door()
    door.refuse["p1"] = 3
    asyncio.run(job.runner(door).run())
    batch = job.get()
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert door.calls["p1"] == 4


def test_lease_is_exclusive_until_it_runs_out(tmp_path: Path) -> None:
    job = Job(tmp_path, line("a"))
    assert job.jobs.claim(job.id, "a", 60)
    assert not job.jobs.claim(job.id, "b", 60)
    assert job.jobs.claim(job.id, "a", 0)  # renewed by its owner, now already run out
    assert job.jobs.claim(job.id, "b", 60)
    job.jobs.release(job.id, "a")  # not a's any more: kept
    assert not job.jobs.claim(job.id, "a", 60)
    job.jobs.release(job.id, "b")
    assert job.jobs.claim(job.id, "a", 60)


def test_tenant_sees_only_its_own_files_and_batches(tmp_path: Path) -> None:
    from app.batch.errors import NotFoundError

    job = Job(tmp_path, line("a"), tenant="acme")
    file_id = job.batch["input_file_id"]
    assert job.files.get("acme", file_id)["id"] == file_id
    for call in (
        lambda: job.files.get("globex", file_id),
        lambda: job.files.content("globex", file_id),
        lambda: job.files.delete("globex", file_id),
        lambda: job.jobs.get("globex", job.id),
        lambda: job.jobs.cancel("globex", job.id),
        lambda: job.files.get("acme", "../etc/passwd"),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert job.files.of_tenant("globex") == [] and job.jobs.of_tenant("globex") == []
    assert [b["id"] for b in job.jobs.of_tenant("acme")] == [job.id]
    assert "tenant" not in job.files.get("acme", file_id)
    assert job.get()["status"] == "validating"


def test_missing_input_file_fails_the_job(tmp_path: Path) -> None:
    job = Job(tmp_path, line("a"))
    job.files.delete(job.tenant, job.batch["input_file_id"])
    asyncio.run(job.runner(Door()).run())
    batch = job.get()
    assert batch["status"] == "failed"
    assert batch["errors"]["data"][0]["param"] == "input_file_id"


def test_preempted_lines_run_again_and_count_once(tmp_path: Path) -> None:
    """More important work takes the slots of the lines started last: they stop, run again
    later, and each line still has one result."""
    job = Job(tmp_path, b"".join(line(f"c{i}", f"p{i}") for i in range(6)))
    door = Door()
    door.held = {f"p{i}" for i in range(6)}

    async def scenario() -> int:
        runner = job.runner(door)
        task = asyncio.create_task(runner.run())
        while len(runner.in_flight) < 4:  # the window: 4 lines started, all held
            await asyncio.sleep(0.01)
        stopped = runner.preempt(2)
        door.hold.set()
        await task
        return stopped

    assert asyncio.run(scenario()) == 2
    batch = job.get()
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert [o["custom_id"] for o in job.output(batch["output_file_id"])] == [
        f"c{i}" for i in range(6)
    ]
    assert door.calls["p2"] == door.calls["p3"] == 2  # the two started last ran twice
    assert door.calls["p0"] == door.calls["p1"] == 1


def test_job_past_its_window_expires_keeping_finished_lines(tmp_path: Path) -> None:
    job = Job(tmp_path, b"".join(line(f"c{i}", f"p{i}") for i in range(3)))
    job.jobs.update(job.id, lambda record: record.update(expires_at=0))
    door = Door()
    door.held = {"p1", "p2"}  # never released: the expiry stops them
    asyncio.run(job.runner(door).run())
    batch = job.get()
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert [o["custom_id"] for o in job.output(batch["output_file_id"])] == ["c0"]


def test_a_line_stopped_before_it_starts_gives_its_slots_back(tmp_path: Path) -> None:
    """A pace tick can preempt a line whose task was created in the same loop turn and has
    not run yet; its slots must come back all the same (they did only from the line's own
    `finally`, which a task cancelled before its first step never runs)."""
    job = Job(tmp_path, line("a", "p0") + line("b", "p1"))
    runner = job.runner(Door())

    async def scenario() -> None:
        for index, prompt in enumerate(("p0", "p1")):
            await runner.own_slots.acquire()
            await runner.window.acquire()
            body = {"model": "m", "prompt": prompt, "max_tokens": 2}
            runner._start_line(job.tenant, ENDPOINT, InputLine(index, f"c{index}", body))
        tasks = list(runner.in_flight)
        assert runner.window.num_taken == 2
        assert runner.preempt(2) == 2  # before either task took a step
        await asyncio.gather(*tasks, return_exceptions=True)
        assert runner.window.num_taken == 0
        assert runner.own_slots._value == 1_000_000  # every job slot back
        assert [queued.custom_id for queued in runner.requeued] == ["c0", "c1"]

    asyncio.run(scenario())
