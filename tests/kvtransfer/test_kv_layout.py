"""The interface's value types: layout descriptor, ticket, states, errors on the wire."""

from __future__ import annotations

import dataclasses
import pickle
import time
from types import SimpleNamespace

import pytest

from engine.kv_cache import KVCacheSpec
from kvtransfer import base
from kvtransfer.base import (
    ChecksumMismatchError,
    KVLayout,
    KVLayoutMismatchError,
    StaleEpochError,
    Ticket,
    TransferState,
    error_from_wire,
    error_to_wire,
    new_epoch,
)

SPEC = KVCacheSpec(
    num_layers=30, num_blocks=100, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32"
)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic clock tickets read, stopped: `clock[0]` is now until a test moves it."""
    now = [1000.0]
    fake = SimpleNamespace(monotonic=lambda: now[0], time_ns=time.time_ns)
    monkeypatch.setattr(base, "time", fake)
    return now


def test_layout_comes_from_the_spec_without_num_blocks() -> None:
    layout = KVLayout.from_spec(SPEC, "smollm-135m")
    other = KVLayout.from_spec(dataclasses.replace(SPEC, num_blocks=7), "smollm-135m")
    assert layout == other
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (30, 3, 64)
    assert KVLayout.from_dict(layout.to_dict()) == layout


def test_mismatch_error_lists_every_differing_field() -> None:
    ours = KVLayout.from_spec(SPEC, "a")
    theirs = KVLayout.from_spec(dataclasses.replace(SPEC, dtype="bfloat16", block_size=32), "b")
    with pytest.raises(KVLayoutMismatchError) as info:
        ours.check_matches(theirs, "receiver", "sender")
    assert set(info.value.differences) == {"model_id", "dtype", "block_size"}
    message = str(info.value)
    for text in ("model_id", "dtype", "'bfloat16'", "block_size", "receiver", "sender"):
        assert text in message
    ours.check_matches(KVLayout.from_spec(SPEC, "a"))  # equal: no error


def test_ticket_is_small_frozen_and_picklable(clock: list[float]) -> None:
    layout = KVLayout.from_spec(SPEC, "m")
    ticket = Ticket("r1", "tcp://10.0.0.1:5000", (4, 9, 2), layout, new_epoch(), 30.0)
    assert pickle.loads(pickle.dumps(ticket)) == ticket
    assert len(pickle.dumps(ticket)) < 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        ticket.epoch = 1  # type: ignore[misc]
    assert ticket.num_blocks == 3 and ticket.seconds_left() == pytest.approx(30.0)


def test_ticket_carries_the_blocks_decode_holds_already(clock: list[float]) -> None:
    """A suffix-only ticket: the first 5 blocks of the prompt stay where they are."""
    layout = KVLayout.from_spec(SPEC, "m")
    ticket = Ticket("r1", "tcp://10.0.0.1:5000", (4, 9), layout, 1, 30.0, num_cached_blocks=5)
    copy = pickle.loads(pickle.dumps(ticket))
    assert copy == ticket and copy.num_cached_blocks == 5 and copy.num_blocks == 2
    assert Ticket("r1", "e", (4,), layout, 1, 30.0).num_cached_blocks == 0
    with pytest.raises(ValueError, match="num_cached_blocks"):
        Ticket("r1", "e", (4,), layout, 1, 30.0, num_cached_blocks=-1)


def test_ticket_deadline_travels_as_the_time_left(clock: list[float]) -> None:
    """No wall-clock instant crosses hosts: a copy counts down from what was left."""
    layout = KVLayout.from_spec(SPEC, "m")
    ticket = Ticket("r1", "tcp://10.0.0.1:5000", (4,), layout, 1, 0.5)
    clock[0] += 0.2
    copy = pickle.loads(pickle.dumps(ticket))
    assert copy.deadline_s == pytest.approx(0.3) == ticket.seconds_left()
    assert copy.expires_at == pytest.approx(ticket.expires_at)  # same host: same instant
    clock[0] += 0.3
    assert copy.seconds_left() == pytest.approx(0.0) == ticket.seconds_left()


def test_states_terminal_and_wire_codes() -> None:
    terminal = {s for s in TransferState if s.is_terminal}
    assert terminal == {
        TransferState.DONE,
        TransferState.FAILED,
        TransferState.ABORTED,
        TransferState.EXPIRED,
    }
    for state in TransferState:
        assert TransferState.from_code(state.code) is state


def test_errors_survive_the_wire() -> None:
    mismatch = KVLayoutMismatchError({"dtype": ("float32", "bfloat16")}, "receiver", "sender")
    back = error_from_wire(error_to_wire(mismatch), "receiver")
    assert isinstance(back, KVLayoutMismatchError)
    assert back.differences == {"dtype": ("float32", "bfloat16")} and "receiver" in str(back)
    stale = error_from_wire(error_to_wire(StaleEpochError("old ticket")), "receiver")
    assert isinstance(stale, StaleEpochError) and "old ticket" in str(stale)
    assert isinstance(
        error_from_wire(error_to_wire(ChecksumMismatchError("x")), "r"), ChecksumMismatchError
    )


def test_epochs_differ_and_fit_64_bits() -> None:
    epochs = {new_epoch() for _ in range(200)}
    assert len(epochs) == 200
    assert all(0 < e < 2**64 for e in epochs)
