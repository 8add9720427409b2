"""Rank 0's view of one request's transfer over every rank of a replica: the ranks' ends
combined. DONE once every rank's transfer is; the first other end of any rank ends the
group; `release` runs once, after every rank has settled (`table.ObserveFn`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvtransfer.base import (
    KVTransferError,
    PeerLostError,
    ReleaseFn,
    TransferState,
    UnknownTransferError,
)

logger = logging.getLogger(__name__)

TTL_S = 120.0  # ended group transfers stay pollable, and their ids refused, this long


@dataclass(slots=True)
class _Transfer:
    states: list[TransferState | None]  # each rank's terminal state, once it ended
    settled: list[bool]
    expires_at: float  # monotonic: the ticket's deadline
    failure: tuple[TransferState, KVTransferError | None] | None = None  # the first non-DONE
    released: bool = False  # every rank settled (release ran, or was not due)
    settled_at: float = 0.0


class GroupTable:
    """One group transfer per request id: the ranks' ends combined (see the module doc).
    An id is never reused within `TTL_S` of its end (`open` refuses it), so a late event of
    an earlier transfer cannot touch a new one."""

    def __init__(self, size: int, release: ReleaseFn, release_on_done: bool) -> None:
        self.size, self._release, self._release_on_done = size, release, release_on_done
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._transfers: dict[str, _Transfer] = {}

    def open(self, request_id: str, deadline_s: float, gone: Iterable[int] = ()) -> None:
        """A new group transfer of `deadline_s`; ranks in `gone` (their process has exited)
        are settled FAILED at once. ValueError if the id is known (open, or ended within
        `TTL_S`)."""
        with self._lock:
            now = time.monotonic()
            for rid in [r for r, t in self._transfers.items() if _expired(t, now)]:
                del self._transfers[rid]
            if request_id in self._transfers:
                raise ValueError(f"transfer id {request_id!r} is in use or ended recently")
            n = self.size
            self._transfers[request_id] = _Transfer([None] * n, [False] * n, now + deadline_s)
            self._changed.notify_all()
        for rank in gone:
            lost = PeerLostError(f"tensor-parallel rank {rank} is gone")
            self.observe(rank, request_id, TransferState.FAILED, lost, settled=True)

    def end_unsent(self, request_id: str, error: KVTransferError, release: bool = False) -> None:
        """End a transfer no rank can be writing or reading (its ticket never left, or it
        was refused before any rank connected): every rank settled, `release` run if asked;
        the id stays refused for `TTL_S`."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is None or transfer.released:
                return
            transfer.failure = transfer.failure or (TransferState.ABORTED, error)
            transfer.states = [s or TransferState.ABORTED for s in transfer.states]
            transfer.settled = [True] * self.size
            transfer.released, transfer.settled_at = True, time.monotonic()
            self._changed.notify_all()
        if release:
            self._run_release(request_id)

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._transfers

    def observe(
        self,
        rank: int,
        request_id: str,
        state: TransferState,
        error: KVTransferError | None,
        settled: bool,
    ) -> None:
        """Rank `rank`'s transfer ended (`settled` False) or settled (True)."""
        release = False
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is None or transfer.released:
                return
            if transfer.states[rank] is None:
                transfer.states[rank] = state
                if state is not TransferState.DONE and transfer.failure is None:
                    transfer.failure = (state, error)
            transfer.settled[rank] = transfer.settled[rank] or settled
            if all(transfer.settled):
                transfer.released, transfer.settled_at = True, time.monotonic()
                release = self._release_on_done or transfer.failure is not None
            self._changed.notify_all()
        if release:
            self._run_release(request_id)

    def settle_rank(self, rank: int, error: KVTransferError) -> None:
        """Rank `rank`'s process has exited: every transfer it has not settled settles
        FAILED (a dead process writes and reads nothing)."""
        with self._lock:
            ids = [rid for rid, t in self._transfers.items() if not t.settled[rank]]
        for rid in ids:
            self.observe(rank, rid, TransferState.FAILED, error, settled=True)

    def state(self, request_id: str) -> TransferState:
        with self._lock:
            return _combined(self._require(request_id))

    def error(self, request_id: str) -> KVTransferError | None:
        """The first rank's error that ended the group (None if it has not failed)."""
        with self._lock:
            failure = self._require(request_id).failure
            return None if failure is None else failure[1]

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                state = _combined(self._require(request_id))
                left = deadline - time.monotonic()
                if state.is_terminal or left <= 0:
                    return state
                self._changed.wait(left)

    def counts(self) -> dict[str, int]:
        with self._lock:
            transfers = list(self._transfers.values())
        return {
            "num_open": sum(not _combined(t).is_terminal for t in transfers),
            "num_fenced": sum(_combined(t).is_terminal and not t.released for t in transfers),
        }

    def unsettled(self) -> list[str]:
        with self._lock:
            return [rid for rid, t in self._transfers.items() if not t.released]

    def silent_ranks(self, margin_s: float) -> set[int]:
        """Ranks that have not even ended a transfer `margin_s` past its deadline (a live
        rank ends it by its deadline: this one is stuck or unreachable). One that ended it
        and keeps its blocks quarantined (its remote writer hung) is not silent."""
        cutoff = time.monotonic() - margin_s
        with self._lock:
            old = [t for t in self._transfers.values() if not t.released and t.expires_at < cutoff]
        return {rank for t in old for rank, state in enumerate(t.states) if state is None}

    def _run_release(self, request_id: str) -> None:
        try:
            self._release(request_id)
        except Exception:
            logger.exception("release(%r) raised", request_id)

    def _require(self, request_id: str) -> _Transfer:
        if (transfer := self._transfers.get(request_id)) is None:
            raise UnknownTransferError(f"no transfer for request {request_id!r}")
        return transfer


def _combined(transfer: _Transfer) -> TransferState:
    """The first non-DONE end of any rank; DONE once every rank is; else still running."""
    if transfer.failure is not None:
        return transfer.failure[0]
    ended = sum(s is not None for s in transfer.states)
    if ended == len(transfer.states):
        return TransferState.DONE
    return TransferState.TRANSFERRING if ended else TransferState.PENDING


def _expired(transfer: _Transfer, now: float) -> bool:
    return transfer.released and transfer.settled_at + TTL_S <= now
