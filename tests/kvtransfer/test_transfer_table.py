"""The state machine: one terminal state, release exactly once, fences, deadlines."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer import table as table_module
from kvtransfer.base import TransferAbortedError, TransferState, UnknownTransferError
from kvtransfer.table import TransferRecord, TransferTable

TERMINAL = [TransferState.DONE, TransferState.FAILED, TransferState.ABORTED, TransferState.EXPIRED]


def table(released: list[str], *, on_done: bool, **kw: float) -> TransferTable:
    return TransferTable(released.append, release_on_done=on_done, **kw)


def record(rid: str = "r", deadline: float = 1e12) -> TransferRecord:
    return TransferRecord(rid, (1, 2), deadline)


@given(st.lists(st.sampled_from(TERMINAL), min_size=1, max_size=6), st.booleans())
@settings(max_examples=60, deadline=None)
def test_first_terminal_state_wins_and_release_happens_once(
    states: list[TransferState], on_done: bool
) -> None:
    released: list[str] = []
    t = table(released, on_done=on_done)
    t.add(record())
    results = [t.finish("r", s) for s in states]
    assert results == [True] + [False] * (len(states) - 1)
    assert t.require("r").state is states[0]
    expect_release = states[0] is not TransferState.DONE or on_done
    assert released == (["r"] if expect_release else [])


def test_concurrent_finishers_release_once() -> None:
    released: list[str] = []
    t = table(released, on_done=False)
    for i in range(50):
        t.add(record(f"r{i}"))
    barrier = threading.Barrier(4)

    def finisher(state: TransferState) -> None:
        barrier.wait()
        for i in range(50):
            t.finish(f"r{i}", state)

    threads = [threading.Thread(target=finisher, args=(s,)) for s in TERMINAL]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    not_done = [f"r{i}" for i in range(50) if t.require(f"r{i}").state is not TransferState.DONE]
    assert sorted(released) == sorted(not_done)


def test_fence_defers_release_until_unfenced() -> None:
    released: list[str] = []
    t = table(released, on_done=False)
    rec = t.add(record())
    peer = object()
    assert t.bind(rec, peer) and rec.state is TransferState.TRANSFERRING
    t.finish("r", TransferState.ABORTED, TransferAbortedError("x"), fence_if_bound=True)
    assert rec.state is TransferState.ABORTED and released == []
    t.unfence("r", object())  # another peer's ack does not count
    assert released == []
    t.unfence("r", peer)
    t.unfence("r", peer)
    assert released == ["r"]


def test_unbound_transfer_is_not_fenced() -> None:
    released: list[str] = []
    t = table(released, on_done=False)
    t.add(record())
    t.finish("r", TransferState.ABORTED, fence_if_bound=True)
    assert released == ["r"]


def test_fence_times_out_in_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]  # the table's monotonic clock, moved by hand
    monkeypatch.setattr(table_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    released: list[str] = []
    t = table(released, on_done=False, fence_timeout_s=0.05)
    rec = t.add(record())
    t.bind(rec, object())
    t.finish("r", TransferState.EXPIRED, fence_if_bound=True)
    t.sweep()
    now[0] += 0.04
    t.sweep()
    assert released == []
    now[0] += 0.02
    t.sweep()
    assert released == ["r"]


def test_release_waits_for_the_local_writer() -> None:
    events: list[str] = []
    t = TransferTable(lambda rid: events.append("released"), release_on_done=False)
    rec = t.add(record())
    entered = threading.Event()

    def writer() -> None:
        with rec.write_lock:
            entered.set()
            time.sleep(0.1)  # finish() below is called meanwhile (or later: then trivially)
            events.append("writer done")

    th = threading.Thread(target=writer)
    th.start()
    assert entered.wait(10.0)
    t.finish("r", TransferState.ABORTED)
    th.join()
    assert events == ["writer done", "released"]


def test_overdue_wait_and_tombstones() -> None:
    released: list[str] = []
    t = table(released, on_done=False, ttl_s=0.05)
    t.add(record("late", deadline=time.monotonic() - 1))
    t.add(record("fine"))
    assert t.overdue(time.monotonic()) == ["late"]
    assert t.wait("fine", 0.02) is TransferState.PENDING  # times out, never blocks forever
    threading.Timer(0.02, lambda: t.finish("fine", TransferState.DONE)).start()
    assert t.wait("fine", 5.0) is TransferState.DONE
    t.finish("late", TransferState.EXPIRED)
    time.sleep(0.08)
    t.sweep()
    with pytest.raises(UnknownTransferError):
        t.require("late")
    with pytest.raises(UnknownTransferError):
        t.wait("nope", 0.01)


def test_reopening_an_open_request_is_refused_but_a_finished_one_is_replaced() -> None:
    t = table([], on_done=False)
    t.add(record())
    with pytest.raises(ValueError):
        t.add(record())
    t.finish("r", TransferState.FAILED)
    fresh = t.add(record())
    assert t.require("r") is fresh and fresh.state is TransferState.PENDING


def test_mark_layer_counts_and_stops_after_terminal() -> None:
    t = table([], on_done=False)
    rec = t.add(record())
    assert t.mark_layer(rec, 0) and t.mark_layer(rec, 3) and t.mark_layer(rec, 3)
    assert rec.num_layers_done == 2 and rec.state is TransferState.TRANSFERRING
    t.finish("r", TransferState.ABORTED)
    assert not t.mark_layer(rec, 1)


def test_fence_timeout_cuts_the_writer_before_release_and_the_fence_runs_last() -> None:
    events: list[str] = []
    t = TransferTable(
        lambda rid: events.append(f"release {rid}"),
        release_on_done=False,
        fence_timeout_s=0.0,
        fence=lambda record: events.append("fence"),
    )
    rec = t.add(record())
    t.bind(rec, object())
    t.finish("r", TransferState.ABORTED, fence_if_bound=True)
    assert events == []

    def cut(r: TransferRecord) -> bool:
        events.append(f"cut {r.request_id}")
        return True

    t.sweep(cut)
    assert events == ["cut r", "fence", "release r"]


def test_fence_timeout_quarantines_until_unfenced_when_the_writer_may_still_run() -> None:
    released: list[str] = []
    t = TransferTable(released.append, release_on_done=False, fence_timeout_s=0.0)
    peer = object()
    rec = t.add(record())
    t.bind(rec, peer)
    t.finish("r", TransferState.ABORTED, fence_if_bound=True)
    t.sweep(lambda r: False)
    t.sweep(lambda r: False)
    assert released == [] and rec.quarantined and rec.fenced
    assert t.records(lambda r: r.quarantined) == [rec]
    assert t.counts() == {"num_open": 0, "num_fenced": 1, "num_quarantined": 1}
    with pytest.raises(ValueError):
        t.add(record())  # the id stays taken while its blocks are quarantined
    t.unfence("r", object())  # another connection's word does not count
    assert released == []
    t.unfence("r", peer)
    assert released == ["r"] and not rec.quarantined
    assert t.counts() == {"num_open": 0, "num_fenced": 0, "num_quarantined": 0}
