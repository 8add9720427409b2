"""Running one batch job in the ingress replica that holds its lease.

    claim the lease ──▶ parse the input (malformed lines: error results) ──▶ in_progress
      ──▶ each line without a result: a window slot ──▶ the front door ──▶ its result appended
          (refused for load: wait, try again)             (`request_counts` follow)
      ──▶ finalizing: output and error files from the results ──▶ completed
    preempted (more important work needs the slots): the lines started last are stopped
    and queued again;
    cancelling (seen at the next tend): stop every line in flight ──▶ cancelled, finished
    lines kept; the lease lost (this replica stalled past its ttl): stop, write nothing more.

A runner killed at any point leaves the job `in_progress` with its lease running out; the
next runner to claim it (any ingress replica, or this one restarted) starts from the results
already recorded, so every line is run to a result once and appears once in the output.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from app.batch.errors import NotFoundError
from app.batch.execute import LineOutcome
from app.batch.jobs import JobStore, ResultLog
from app.batch.lines import InputLine, is_success, output_files, parse_input, result
from app.batch.pacing import Pacer, Window
from app.batch.store import FileStore
from app.config import BatchSettings

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
TEND_PERIOD_S = 0.5  # request_counts written, cancel noticed, at most this late

Execute = Callable[[str, str, Mapping[str, Any]], Awaitable[LineOutcome]]
UnitCost = Callable[[float, int, int], dict[str, str]]  # (active s, tokens in, out) -> metadata


class JobRunner:
    """Runs the job `batch_id` to its end while `owner` holds its lease."""

    def __init__(
        self,
        batch_id: str,
        owner: str,
        jobs: JobStore,
        files: FileStore,
        settings: BatchSettings,
        execute: Execute,
        window: Window,
        pacer: Pacer,
        unit_cost: UnitCost,
        max_lines_in_flight: int | None = None,
    ) -> None:
        """`max_lines_in_flight`: this job's own bound (its tenant's concurrency limit), on
        top of the shared `window`."""
        self.batch_id = batch_id
        self.owner = owner
        self.jobs = jobs
        self.files = files
        self.settings = settings
        self.execute = execute
        self.window = window
        self.pacer = pacer
        self.unit_cost = unit_cost
        self.log: ResultLog = jobs.results(batch_id)
        self.records: dict[int, dict[str, Any]] = {}
        self.in_flight: dict[asyncio.Task[None], InputLine] = {}  # in start order
        self.requeued: collections.deque[InputLine] = collections.deque()  # preempted
        self.stopping: str | None = None  # "cancelled" | "lost" | "expired"
        self.total = 0
        self.own_slots = asyncio.Semaphore(max_lines_in_flight or 1_000_000)
        self._last_tend = time.monotonic()

    async def run(self) -> None:
        """Run the job to a terminal state (or until the lease is lost)."""
        record = await asyncio.to_thread(self.jobs.record, self.batch_id)
        tenant = record["tenant"]
        try:
            data = await asyncio.to_thread(self.files.content, tenant, record["input_file_id"])
        except NotFoundError as exc:
            await asyncio.to_thread(self.jobs.update, self.batch_id, partial(_failed, str(exc)))
            await asyncio.to_thread(self.jobs.release, self.batch_id, self.owner)
            return
        lines, malformed = parse_input(data, record["endpoint"])
        await asyncio.to_thread(self.log.open)
        try:
            self.records = await asyncio.to_thread(self.log.read)
            for error in malformed:
                if error["index"] not in self.records:
                    await self._record(error)
            total = len(lines) + len(malformed)
            await self._start(total)
            tender = asyncio.create_task(self._tend_forever())
            try:
                await self._run_lines(tenant, record["endpoint"], lines)
            finally:
                tender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tender
            if self.stopping == "lost":
                logger.warning("batch %s: lease lost; another replica takes it over", self.batch_id)
                return
            await self._finish(tenant, self.stopping or "completed")
        finally:
            self.log.close()
        await asyncio.to_thread(self.jobs.release, self.batch_id, self.owner)

    async def _start(self, total: int) -> None:
        def change(record: dict[str, Any]) -> None:
            if record["status"] == "validating":
                record["status"] = "in_progress"
                record["in_progress_at"] = int(time.time())
            record["request_counts"] = self._counts(total)
            if record["status"] == "cancelling":
                self.stopping = "cancelled"

        self.total = total
        await asyncio.to_thread(self.jobs.update, self.batch_id, change)

    async def _run_lines(self, tenant: str, endpoint: str, lines: list[InputLine]) -> None:
        pending = collections.deque(line for line in lines if line.index not in self.records)
        while not self.stopping:
            if not pending and not self.requeued:
                if not self.in_flight:
                    break
                await asyncio.wait(list(self.in_flight), return_when=asyncio.FIRST_COMPLETED)
                continue
            await self.own_slots.acquire()
            await self.window.acquire()
            if self.stopping:
                self.window.release()
                self.own_slots.release()
                break
            line = self.requeued.popleft() if self.requeued else pending.popleft()
            self._start_line(tenant, endpoint, line)
        while self.in_flight:
            await asyncio.gather(*self.in_flight, return_exceptions=True)

    def _start_line(self, tenant: str, endpoint: str, line: InputLine) -> None:
        """Run `line` in a task of its own (its window and job slots already taken)."""
        task = asyncio.create_task(self._run_line(tenant, endpoint, line))
        self.in_flight[task] = line
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A line's task ended, however: its slots go back here, not in `_run_line`, whose
        `finally` never runs for a task cancelled (preempted, stopped) before it started."""
        self.in_flight.pop(task, None)
        self.window.release()
        self.own_slots.release()

    def preempt(self, num_lines: int) -> int:
        """Stop up to `num_lines` of the lines started last (more important work needs
        their slots); they run again later. Returns how many were stopped."""
        if num_lines <= 0 or self.stopping:
            return 0
        victims = list(self.in_flight.items())[-num_lines:]
        for task, line in reversed(victims):
            self.in_flight.pop(task, None)
            self.requeued.appendleft(line)
            task.cancel()
        return len(victims)

    async def _run_line(self, tenant: str, endpoint: str, line: InputLine) -> None:
        try:
            backoff = self.settings.retry_backoff_s
            while True:
                outcome = await self.execute(tenant, endpoint, line.body)
                if not outcome.retry or self.stopping:
                    break
                self.window.set_limit(self.pacer.refused())
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
            if self.stopping:
                return
            await self._record(
                result(
                    line.index,
                    line.custom_id,
                    outcome.status_code,
                    outcome.body,
                    outcome.request_id,
                    outcome.num_prompt_tokens,
                    outcome.num_output_tokens,
                )
            )
        except Exception:  # noqa: BLE001 - a bug in one line must not stop the job
            logger.exception("batch %s: line %d failed", self.batch_id, line.index)

    async def _record(self, record: dict[str, Any]) -> None:
        """Append a finished line's result, then count it (never twice)."""
        if record["index"] in self.records:
            return
        self.records[record["index"]] = record
        self.log.append(record)

    def _counts(self, total: int) -> dict[str, int]:
        completed = sum(1 for r in self.records.values() if is_success(r))
        return {"total": total, "completed": completed, "failed": len(self.records) - completed}

    async def _tend_forever(self) -> None:
        """Write progress, notice a cancel or an expiry, renew the lease."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(TEND_PERIOD_S)
            now = time.monotonic()
            if now - renewed >= self.settings.lease_ttl_s / 3:
                held = await asyncio.to_thread(
                    self.jobs.claim, self.batch_id, self.owner, self.settings.lease_ttl_s
                )
                renewed = now
                if not held:
                    self._stop("lost")
                    return
            progress = partial(self._progress, self._counts(self.total))  # counted on the loop
            record = await asyncio.to_thread(self.jobs.update, self.batch_id, progress)
            if record["status"] == "cancelling":
                self._stop("cancelled")
            elif time.time() > record["expires_at"]:
                self._stop("expired")

    def _progress(self, counts: dict[str, int], record: dict[str, Any]) -> None:
        now = time.monotonic()
        record["request_counts"] = counts
        record["pdserve"]["active_s"] += now - self._last_tend
        self._last_tend = now

    def _stop(self, why: str) -> None:
        """No new lines; those in flight are cancelled (their choices with them)."""
        if self.stopping is None:
            self.stopping = why
            for task in self.in_flight:
                task.cancel()

    async def _finish(self, tenant: str, status: str) -> None:
        """Write the output and error files, then the terminal status."""
        if status == "completed":
            await asyncio.to_thread(self.jobs.update, self.batch_id, _finalizing)
        records = list(self.records.values())
        output, errors, _, num_failed = output_files(self.batch_id, records)
        base = self.batch_id.removeprefix("batch_")
        output_id = (
            await asyncio.to_thread(
                self.files.create,
                tenant,
                f"{self.batch_id}_output.jsonl",
                "batch_output",
                output,
                f"file-{base}-output",
            )
        )["id"]
        error_id = None
        if num_failed:
            error_id = (
                await asyncio.to_thread(
                    self.files.create,
                    tenant,
                    f"{self.batch_id}_error.jsonl",
                    "batch_output",
                    errors,
                    f"file-{base}-errors",
                )
            )["id"]
        counts = self._counts(self.total)
        ok = [r for r in records if is_success(r)]
        num_in = sum(int(r["num_prompt_tokens"]) for r in ok)
        num_out = sum(int(r["num_output_tokens"]) for r in ok)

        def change(record: dict[str, Any]) -> None:
            self._progress(counts, record)
            record["status"] = status
            record[f"{status}_at"] = int(time.time())
            record["output_file_id"] = output_id
            record["error_file_id"] = error_id
            record["usage"] = {
                "input_tokens": num_in,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": num_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": num_in + num_out,
            }
            record["metadata"].update(
                self.unit_cost(record["pdserve"]["active_s"], num_in, num_out)
            )

        await asyncio.to_thread(self.jobs.update, self.batch_id, change)


def _failed(message: str, record: dict[str, Any]) -> None:
    record["status"] = "failed"
    record["failed_at"] = int(time.time())
    record["errors"] = {
        "object": "list",
        "data": [{"code": "invalid_input", "message": message, "param": "input_file_id"}],
    }


def _finalizing(record: dict[str, Any]) -> None:
    record["status"] = "finalizing"
    record["finalizing_at"] = int(time.time())
