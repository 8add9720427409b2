"""Decode admission (`replica/slot_gate.py`): slots handed out most important first."""

from __future__ import annotations

import asyncio

import pytest

from replica.slot_gate import SlotGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_waiters_get_slots_by_priority_then_arrival() -> None:
    async def scenario() -> list[str]:
        gate = SlotGate(1)
        order: list[str] = []
        await gate.acquire(10, 5.0)  # a batch stream holds the only slot

        async def wait(name: str, priority: int) -> None:
            await gate.acquire(priority, 5.0)
            order.append(name)
            gate.release()

        tasks = []
        for name, priority in [("batch-1", 10), ("batch-2", 10), ("interactive", 0)]:
            tasks.append(asyncio.create_task(wait(name, priority)))
            await asyncio.sleep(0)
        assert gate.snapshot()["num_waiting_by_priority"] == {10: 2, 0: 1}
        gate.release()
        await asyncio.gather(*tasks)
        assert gate.num_active == 0
        return order

    assert asyncio.run(scenario()) == ["interactive", "batch-1", "batch-2"]


def test_a_waiter_that_times_out_or_is_cancelled_holds_no_slot() -> None:
    async def scenario() -> None:
        gate = SlotGate(1)
        async with gate.slot(0, 1.0):
            with pytest.raises(TimeoutError):
                await gate.acquire(0, 0.01)
            cancelled = asyncio.create_task(gate.acquire(0, 5.0))
            await asyncio.sleep(0)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert gate.snapshot()["num_waiting_by_priority"] == {}
        assert gate.num_active == 0
        async with gate.slot(5, 0.01):  # free again at once
            assert gate.num_active == 1

    asyncio.run(scenario())


def test_snapshot_reports_slots_and_recent_releases() -> None:
    async def scenario() -> None:
        clock = Clock()
        gate = SlotGate(4, window_s=10.0, clock=clock)
        for _ in range(3):
            await gate.acquire(0, 1.0)
        gate.release()
        gate.release()
        assert gate.snapshot() == {
            "num_active": 1,
            "max_active": 4,
            "num_waiting_by_priority": {},
            "releases_per_s": pytest.approx(0.2),
        }
        clock.now += 11.0  # the releases left the window
        assert gate.snapshot()["releases_per_s"] == 0.0

    asyncio.run(scenario())


def test_at_least_one_slot() -> None:
    with pytest.raises(ValueError, match="max_active must be >= 1"):
        SlotGate(0)


def test_a_waiter_cancelled_as_its_slot_arrives_passes_it_on() -> None:
    """The slot is handed over and the waiter cancelled in the same loop turn (its client
    went away): the waiter must end cancelled, not stream on, and the slot must be free."""

    async def scenario() -> None:
        gate = SlotGate(1)
        await gate.acquire(0, 5.0)
        waiter = asyncio.create_task(gate.acquire(0, 5.0))
        await asyncio.sleep(0)  # it waits
        gate.release()  # hands the slot to the waiter
        waiter.cancel()  # before the waiter ran again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.num_active == 0

    asyncio.run(scenario())
