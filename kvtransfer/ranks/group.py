"""Rank 0's view of one request's transfer over every rank of a replica: the ranks' ends
combined. DONE once every rank's transfer is; the first other end of any rank ends the
group; `release` runs once, after every rank has settled (`table.ObserveFn`)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from kvtransfer.base import KVTransferError, ReleaseFn, TransferState, UnknownTransferError

logger = logging.getLogger(__name__)

TTL_S = 120.0  # settled group transfers stay pollable this long


@dataclass(slots=True)
class _Transfer:
    states: list[TransferState | None]  # each rank's terminal state, once it ended
    errors: list[KVTransferError | None]
    settled: list[bool]
    released: bool = False
    settled_at: float = 0.0


class GroupTable:
    """One group transfer per request id: the ranks' ends combined (see the module doc)."""

    def __init__(self, size: int, release: ReleaseFn, release_on_done: bool) -> None:
        self.size, self._release, self._release_on_done = size, release, release_on_done
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._transfers: dict[str, _Transfer] = {}

    def open(self, request_id: str) -> None:
        with self._lock:
            now = time.monotonic()
            for rid in [r for r, t in self._transfers.items() if _expired(t, now)]:
                del self._transfers[rid]
            old = self._transfers.get(request_id)
            if old is not None and not old.released:
                raise ValueError(f"a transfer for request {request_id!r} is still open")
            n = self.size
            self._transfers[request_id] = _Transfer([None] * n, [None] * n, [False] * n)
            self._changed.notify_all()

    def discard(self, request_id: str) -> None:
        """Forget a transfer without releasing anything (it never reached a sender)."""
        with self._lock:
            self._transfers.pop(request_id, None)
            self._changed.notify_all()

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
            if transfer is None:
                return
            if transfer.states[rank] is None:
                transfer.states[rank], transfer.errors[rank] = state, error
            transfer.settled[rank] = transfer.settled[rank] or settled
            if all(transfer.settled) and not transfer.released:
                transfer.released, transfer.settled_at = True, time.monotonic()
                done = all(s is TransferState.DONE for s in transfer.states)
                release = self._release_on_done or not done
            self._changed.notify_all()
        if release:
            try:
                self._release(request_id)
            except Exception:
                logger.exception("release(%r) raised", request_id)

    def settle_unheard(self, rank: int, error: KVTransferError) -> None:
        """Rank `rank` is gone: every transfer it has not settled settles FAILED."""
        with self._lock:
            ids = [rid for rid, t in self._transfers.items() if not t.settled[rank]]
        for rid in ids:
            self.observe(rank, rid, TransferState.FAILED, error, settled=True)

    def state(self, request_id: str) -> TransferState:
        with self._lock:
            return _combined(self._require(request_id))

    def error(self, request_id: str) -> KVTransferError | None:
        with self._lock:
            transfer = self._require(request_id)
            if _combined(transfer) in (TransferState.DONE, TransferState.PENDING):
                return None
            return next((e for e in transfer.errors if e is not None), None)

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

    def _require(self, request_id: str) -> _Transfer:
        if (transfer := self._transfers.get(request_id)) is None:
            raise UnknownTransferError(f"no transfer for request {request_id!r}")
        return transfer


def _combined(transfer: _Transfer) -> TransferState:
    """DONE once every rank is; the first other end of any rank; else still running."""
    ended = [s for s in transfer.states if s is not None]
    failed = next((s for s in ended if s is not TransferState.DONE), None)
    if failed is not None:
        return failed
    if len(ended) == len(transfer.states):
        return TransferState.DONE
    return TransferState.TRANSFERRING if ended else TransferState.PENDING


def _expired(transfer: _Transfer, now: float) -> bool:
    return transfer.released and transfer.settled_at + TTL_S <= now
