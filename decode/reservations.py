"""The decode replica's KV reservations: who holds which blocks for a remote prefill.

A reservation lives in the table from just before `reserve_for_kv` until its blocks are
freed or handed to the decoding request (KV landed). Once a ticket is open, the blocks come
back only through the receiver's `release` (`on_release`: the transfer is terminal on both
ends and its writer fenced); before the ticket, no writer exists and they are freed at once.
Leases: a reservation whose owner (the `generate` call) is gone expires at its ticket's
deadline plus the fence allowance; `check_leases` (between engine steps) then aborts the
transfer through the receiver, and frees directly only what no writer can touch.

Methods run on the engine thread unless their docstring says otherwise.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from dataclasses import dataclass

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.engine import Engine
from kvtransfer import TransferState, UnknownTransferError
from kvtransfer.ranks import AnyReceiver

logger = logging.getLogger(__name__)

LEASE_CHECK_INTERVAL_S = 0.5


@dataclass(slots=True, eq=False)
class Reservation:
    """Blocks the engine holds (WAITING_FOR_KV) for one remote-prefill attempt.

    Lives in `ReservationTable.entries` from just before `reserve_for_kv` until the
    blocks are freed (`release`, or directly while no writer can touch them) or handed to
    the decoding request (KV landed).
    """

    transfer_id: str  # also the engine request id holding the blocks
    ticket_open: bool = False
    expires_at: float = float("inf")  # monotonic: ticket deadline + fence allowance
    owned: bool = True  # the generate call that made it still runs


class ReservationTable:
    """Every live reservation of one decode replica, by transfer id."""

    def __init__(self, engine: Engine, loop: AsyncEngine, receiver: AnyReceiver | None) -> None:
        self.engine = engine
        self.loop = loop
        self.receiver = receiver
        self.entries: dict[str, Reservation] = {}
        self._next_check = 0.0

    def add(self, reservation: Reservation) -> None:
        """Any thread (before the reserve runs): start tracking `reservation`."""
        self.entries[reservation.transfer_id] = reservation

    def forget(self, reservation: Reservation) -> None:
        """Any thread: stop tracking `reservation` (its blocks are free or decoding)."""
        if self.entries.get(reservation.transfer_id) is reservation:
            del self.entries[reservation.transfer_id]

    def free(self, reservation: Reservation) -> None:
        """Free a reservation's blocks now; only once no writer can touch them."""
        if self.entries.get(reservation.transfer_id) is not reservation:
            return  # already freed
        del self.entries[reservation.transfer_id]
        self.engine.kv_failed(reservation.transfer_id)

    def drop_unticketed(self, reservation: Reservation, reserve: concurrent.futures.Future) -> None:
        """The owner gave up before the ticket opened: drop what `reserve` may have held."""
        if reserve.cancelled() or reserve.exception() is not None or reserve.result() is None:
            self.forget(reservation)  # nothing was reserved
            return
        self.free(reservation)

    def on_release(self, transfer_id: str) -> None:
        """Receiver thread: a transfer ended without KV and its writer is fenced; free its
        blocks if they are still reserved."""

        def free() -> None:
            reservation = self.entries.get(transfer_id)
            if reservation is not None:
                self.free(reservation)

        with contextlib.suppress(EngineDeadError):
            self.loop.call(free)

    def check_leases(self) -> None:
        """Between engine steps: expire the reservations whose owner is gone."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + LEASE_CHECK_INTERVAL_S
        try:
            for reservation in list(self.entries.values()):
                if not reservation.owned and reservation.expires_at <= now:
                    self.expire(reservation)
        except Exception:  # never the engine loop's problem
            logger.exception("checking KV reservation leases failed")

    def expire(self, reservation: Reservation) -> None:
        assert self.receiver is not None
        if not reservation.ticket_open:
            self.free(reservation)
            return
        try:
            state: TransferState | None = self.receiver.poll(reservation.transfer_id)
        except UnknownTransferError:
            state = None  # long settled: its release already ran
        if state is None or state is TransferState.DONE:
            self.free(reservation)  # the KV landed and nobody decodes it: no writer
        elif not state.is_terminal:
            logger.warning("lease of %s expired, its owner gone: aborting", reservation.transfer_id)
            self.receiver.abort(reservation.transfer_id)  # blocks come back via release
        # else: ended and still fenced (its writer may still run): release frees it
