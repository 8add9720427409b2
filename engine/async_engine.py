"""The engine loop in its own thread; asyncio callers only queue work and stream results.

Everything that touches the scheduler runs on the engine thread: callers submit closures
(`call`) that the loop runs between steps, so the scheduler and block pool need no locks.
Deltas travel back to each caller's event loop with `call_soon_threadsafe`.

A request that fails in the engine ends its own stream with `RequestFailedError`; the loop
goes on. Only a failure outside any request's step stops the loop (every stream then gets
`EngineDeadError`, and `is_alive` turns False). After each iteration the loop publishes a
heartbeat and a snapshot of the engine's occupancy, which other threads read without
waiting on the engine (`occupancy`, `seconds_since_progress`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from types import MappingProxyType
from typing import TypeVar

from engine.engine import Engine, LayerHookFactory
from engine.outputs import RequestFailedError, RequestOutput
from engine.request import Request

logger = logging.getLogger(__name__)
T = TypeVar("T")
SWITCH_INTERVAL_S = 0.0005


def merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one: the tokens, text and logprobs of both,
    and the later one's state (every delta carries the request's counts as of its step)."""
    return dataclasses.replace(
        then,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        new_text=first.new_text + then.new_text,
        new_logprobs=first.new_logprobs + then.new_logprobs,
    )


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can make progress."""


class AsyncEngine:
    """Drives `engine.step()` on a background thread and streams deltas to asyncio."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.layer_hook_for: LayerHookFactory | None = None
        self.between_steps: list[Callable[[], None]] = []  # e.g. polling KV transfers
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        # Written by the engine thread only, each as one reference swap: readers need no lock.
        self._occupancy: Mapping[str, int] = MappingProxyType(engine.occupancy())
        self._progress_at = time.monotonic()
        # A step holds the GIL for most of its Python-level dispatch; a short switch interval
        # lets the replica's event loop (which streams tokens out) run between torch ops.
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side (any thread / event loop) ----------------------------------------

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread between steps; its result comes back in a future."""
        if self._stopped:
            raise EngineDeadError("engine loop is stopped")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

        self._commands.put(run)
        self._wakeup.set()
        return future

    async def call_async(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Register a delta queue for `request_id` on the calling event loop."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        return stream

    def close_stream(self, request_id: str) -> None:
        """Unregister `request_id`'s delta queue: for a caller that opened it and gives up
        before `stream` (whose own exit unregisters it). Idempotent."""
        self._streams.pop(request_id, None)

    async def stream(self, request_id: str, stream: asyncio.Queue) -> AsyncGenerator[RequestOutput]:
        """Yield the request's deltas until it finishes; abort it if the caller goes away.

        Raises `RequestFailedError` when the request failed in the engine (its blocks are
        already freed), `EngineDeadError` when the whole loop stopped.

        Deltas already queued when the caller comes for the next one (it was busy: a
        loaded host, a slow consumer downstream) are merged into one (`merged`); nothing
        waits for more. Each delta a replica yields is one object on Serve's stream to the
        ingress, and relaying them costs the ingress and Serve's proxy more CPU per request
        than the engines use (BENCHMARKS.md, multi-turn); under load, merging lets that
        cost fall as the steps slow instead of staying one relay per token.
        """
        finished = False
        waiting: RequestOutput | BaseException | None = None  # taken from the queue, not merged
        try:
            while True:
                item = waiting if waiting is not None else await stream.get()
                waiting = None
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(item.error)
                # Deltas that arrived while the caller was busy go out as one.
                while not item.finished and not stream.empty():
                    waiting = stream.get_nowait()
                    if isinstance(waiting, BaseException) or waiting.error is not None:
                        break
                    item, waiting = merged(item, waiting), None
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._stopped:
                self.abort(request_id)

    async def generate(self, request: Request) -> AsyncGenerator[RequestOutput]:
        """Add a request built by `engine.make_request` and stream its deltas. A caller
        cancelled while the add is on its way leaves nothing behind: the add may have run
        (a cancelled wait does not stop a command the engine thread took), so an abort
        follows it (commands run in order; aborting an unknown id does nothing)."""
        request_id = request.request_id
        stream = self.open_stream(request_id)
        try:
            await self.call_async(lambda: self.engine.add_request(request))
        except BaseException:
            self.close_stream(request_id)
            if not self._stopped:
                self.abort(request_id)
            raise
        async with contextlib.aclosing(self.stream(request_id, stream)) as deltas:
            async for delta in deltas:
                yield delta

    def abort(self, request_id: str) -> concurrent.futures.Future[None]:
        """Abort a request in any state (frees its blocks); its stream gets a final delta."""
        return self.call(lambda: self.abort_now(request_id))

    def abort_now(self, request_id: str) -> None:
        """`abort`, for code already running on the engine thread."""
        delta = self.engine.abort_request(request_id)
        if delta is not None:
            self.publish(delta)

    def publish(self, delta: RequestOutput) -> None:
        """Engine thread: hand a delta to its stream (dropped if the caller is gone)."""
        entry = self._streams.get(delta.request_id)
        if entry is not None:
            loop, stream = entry
            try:
                loop.call_soon_threadsafe(stream.put_nowait, delta)
            except RuntimeError:  # the caller's event loop is closed: nobody to tell
                self._streams.pop(delta.request_id, None)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def occupancy(self) -> Mapping[str, int]:
        """`Engine.occupancy()` as of the loop's latest iteration (read-only; never waits)."""
        return self._occupancy

    @property
    def seconds_since_progress(self) -> float:
        """How long ago the loop last finished an iteration. An idle loop iterates every
        `idle_wait_s`, so a large value means a step or a command is stuck."""
        return time.monotonic() - self._progress_at

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_commands()
                for hook in self.between_steps:
                    hook()
                if not self.engine.has_unfinished:
                    self._progressed()
                    self._wakeup.wait(self.idle_wait_s)
                    self._wakeup.clear()
                    continue
                for delta in self.engine.step(self.layer_hook_for):
                    self.publish(delta)
                self._progressed()
                if self.engine.idle_pass:  # requests wait for KV or room: not a busy loop
                    self._wakeup.wait(self.idle_wait_s)
                    self._wakeup.clear()
                    continue
                # Hand the GIL over once per step: the serving thread must stream the deltas
                # out; otherwise it only gets the GIL at forced switches while steps run.
                time.sleep(0)
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear about it
            logger.exception("engine loop died")
            self._stopped = True
            error = EngineDeadError(f"engine loop died: {exc!r}")
            for loop, stream in list(self._streams.values()):
                with contextlib.suppress(RuntimeError):  # that caller's event loop is closed
                    loop.call_soon_threadsafe(stream.put_nowait, error)
        self._drain_commands()

    def _progressed(self) -> None:
        self._occupancy = MappingProxyType(self.engine.occupancy())
        self._progress_at = time.monotonic()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()
