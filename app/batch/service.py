"""The batch API of one ingress replica: files and batches per tenant, and the jobs it runs.

Every ingress replica serves the API from the same store and looks for jobs to run every
`poll_s`: a job not finished whose lease is free or ran out (its runner died with its
replica) is claimed and run here (`app/batch/runner.py`). The lines of every job this
replica runs share one window of slots, paced against more important traffic
(`app/batch/pacing.py`). A tenant sees, reads and cancels only its own files and batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from app.batch.execute import LineExecutor
from app.batch.jobs import JobStore
from app.batch.lines import check_input
from app.batch.pacing import Load, Pacer, Window
from app.batch.runner import Execute, JobRunner, UnitCost
from app.batch.store import FileStore
from app.config import BatchSettings
from app.config.base import _Strict
from app.errors import BadRequestError

logger = logging.getLogger(__name__)

MAX_LIST_LIMIT = 100


class CreateBatch(_Strict):
    """The body of `POST /v1/batches`."""

    input_file_id: str = Field(min_length=1)
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class BatchService:
    """Files, batches and job running of one ingress replica."""

    def __init__(
        self,
        settings: BatchSettings,
        execute: Execute,
        observe_load: Callable[[], Load],
        unit_cost: UnitCost,
        tenant_limits: Mapping[str, int] | None = None,
    ) -> None:
        """`execute` runs one line for a tenant; `observe_load` says what more important
        work is running or queued; `unit_cost` turns a job's active seconds and tokens into
        its metadata figures; `tenant_limits`: tenant -> its concurrency limit, which bounds
        its jobs' lines in flight (more would only wait in its queue)."""
        self.settings = settings
        root = Path(settings.store_dir).expanduser()
        self.files = FileStore(root)
        self.jobs = JobStore(root)
        self.execute = execute
        self.observe_load = observe_load
        self.unit_cost = unit_cost
        self.tenant_limits = dict(tenant_limits or {})
        self.owner = uuid.uuid4().hex
        self.pacer = Pacer(settings)
        self.window = Window(self.pacer.limit)
        self.running: dict[str, asyncio.Task[None]] = {}
        self.runners: dict[str, JobRunner] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()

    # ---- background ---------------------------------------------------------------------

    def start(self) -> None:
        """Start looking for jobs and pacing them (once; needs a running event loop)."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll_forever()), loop.create_task(self._pace())]

    def ensure_started(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.start()

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self._poll()
            except Exception:  # noqa: BLE001 - a bad store entry must not stop the poller
                logger.exception("batch: looking for jobs failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
            self._wake.clear()

    async def _poll(self) -> None:
        for batch_id in await asyncio.to_thread(self.jobs.active_ids):
            if batch_id in self.running:
                continue
            claimed = await asyncio.to_thread(
                self.jobs.claim, batch_id, self.owner, self.settings.lease_ttl_s
            )
            if claimed:
                task = asyncio.create_task(self._run(batch_id))
                self.running[batch_id] = task

    async def _run(self, batch_id: str) -> None:
        try:
            tenant = (await asyncio.to_thread(self.jobs.record, batch_id))["tenant"]
            runner = JobRunner(
                batch_id,
                self.owner,
                self.jobs,
                self.files,
                self.settings,
                self.execute,
                self.window,
                self.pacer,
                self.unit_cost,
                self.tenant_limits.get(tenant),
            )
            self.runners[batch_id] = runner
            await runner.run()
        except Exception:  # noqa: BLE001 - the lease runs out; a replica tries it again
            logger.exception("batch %s: runner failed", batch_id)
        finally:
            self.running.pop(batch_id, None)
            self.runners.pop(batch_id, None)

    async def _pace(self) -> None:
        while True:
            await asyncio.sleep(self.settings.pace_period_s)
            # Looked at with no job running too: arrivals are counted in the period they
            # came in, so a job submitted after a quiet spell starts with the window open
            # (counted at the job's first look, they would read as just arrived).
            load = self.observe_load()
            limit = self.pacer.next_limit(load)
            self.window.set_limit(limit)
            excess = self.window.num_taken - limit
            if excess > 0 and (load.num_running or load.queued):
                for runner in list(self.runners.values()):  # their newest lines make room
                    excess -= runner.preempt(excess)

    def report(self) -> dict[str, Any]:
        """This replica's pacing (`Pacer.report`), lines in flight and jobs it runs."""
        return {
            **self.pacer.report(),
            "lines_in_flight": self.window.num_taken,
            "jobs_running": len(self.running),
        }

    async def close(self) -> None:
        """Stop the poller, the pacer and every job here (their leases run out)."""
        tasks = [*self._tasks, *self.running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- files --------------------------------------------------------------------------

    async def create_file(
        self, tenant: str, filename: str, purpose: str, content: bytes
    ) -> dict[str, Any]:
        if purpose != "batch":
            raise BadRequestError(
                f"purpose {purpose!r} is not supported here (only 'batch')", param="purpose"
            )
        return await asyncio.to_thread(self.files.create, tenant, filename, purpose, content)

    async def list_files(
        self, tenant: str, purpose: str | None, after: str | None, limit: int | None
    ) -> dict[str, Any]:
        return page(await asyncio.to_thread(self.files.of_tenant, tenant, purpose), after, limit)

    async def get_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.files.get, tenant, file_id)

    async def file_path(self, tenant: str, file_id: str) -> Path:
        return await asyncio.to_thread(self.files.path, tenant, file_id)

    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.files.delete, tenant, file_id)

    # ---- batches ------------------------------------------------------------------------

    async def create_batch(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            request = CreateBatch.model_validate(body)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise BadRequestError(f"{param}: {first['msg']}", param=param) from None
        file = await self.get_file(tenant, request.input_file_id)
        if file["purpose"] != "batch":
            raise BadRequestError(
                f"file {request.input_file_id} has purpose {file['purpose']!r}, not 'batch'",
                param="input_file_id",
            )
        content = await asyncio.to_thread(self.files.content, tenant, request.input_file_id)
        check_input(content, self.settings.max_lines)
        batch = await asyncio.to_thread(
            self.jobs.create,
            tenant,
            request.input_file_id,
            request.endpoint,
            request.completion_window,
            request.metadata,
        )
        self.ensure_started()
        self._wake.set()  # claim it now, not at the next poll
        return batch

    async def get_batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.jobs.get, tenant, batch_id)

    async def list_batches(
        self, tenant: str, after: str | None, limit: int | None
    ) -> dict[str, Any]:
        return page(await asyncio.to_thread(self.jobs.of_tenant, tenant), after, limit)

    async def cancel_batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.jobs.cancel, tenant, batch_id)


def page(items: list[dict[str, Any]], after: str | None, limit: int | None) -> dict[str, Any]:
    """OpenAI's cursor page: the items after the one with id `after`, at most `limit`."""
    if limit is not None and not 1 <= limit <= MAX_LIST_LIMIT:
        raise BadRequestError(f"limit must be within 1..{MAX_LIST_LIMIT}", param="limit")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    limit = limit or 20
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }


def line_executor(frontend: Any, settings: BatchSettings) -> LineExecutor:
    """Lines through `frontend` in the configured batch class, if it is configured."""
    configured = frontend.config.admission.slo_class(settings.slo_class or "") is not None
    return LineExecutor(
        frontend,
        settings.slo_class if configured else None,
        settings.delta_interval_s,
        settings.local_prefill_max_tokens,
        settings.busy_local_prefill_max_tokens,
    )
