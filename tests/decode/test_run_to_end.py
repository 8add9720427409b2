"""`_run_to_end`: work whose effect the caller must undo when it is cancelled meanwhile (a
group KV ticket opened on every rank) is waited for, never abandoned half done."""

from __future__ import annotations

import asyncio

import pytest

from decode.remote_prefill import _run_to_end


async def _work(started: asyncio.Event, release: asyncio.Event, fail: bool = False) -> str:
    started.set()
    await release.wait()
    if fail:
        raise ValueError("the work failed")
    return "ticket"


def test_the_result_and_not_cancelled() -> None:
    async def run() -> tuple[str, bool]:
        release = asyncio.Event()
        release.set()
        return await _run_to_end(_work(asyncio.Event(), release))

    assert asyncio.run(run()) == ("ticket", False)


def test_cancelled_meanwhile_still_returns_the_result_and_says_so() -> None:
    async def run() -> tuple[str, bool]:
        started, release = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(_run_to_end(_work(started, release)))
        await started.wait()
        task.cancel()  # the caller gives up while the work runs
        await asyncio.sleep(0)
        assert not task.done()  # it waits for the work all the same
        release.set()
        return await task

    assert asyncio.run(run()) == ("ticket", True)


def test_a_failure_is_raised_and_a_cancelled_failure_is_a_cancellation() -> None:
    async def run(cancel: bool) -> None:
        started, release = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(_run_to_end(_work(started, release, fail=True)))
        await started.wait()
        if cancel:
            task.cancel()
            await asyncio.sleep(0)
        release.set()
        await task

    with pytest.raises(ValueError, match="the work failed"):
        asyncio.run(run(cancel=False))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(run(cancel=True))
