"""The transfer state machine shared by every backend, on both sides.

A `TransferTable` holds one `TransferRecord` per request id and guarantees:
- each transfer reaches exactly one terminal state (the first `finish` wins);
- `release(request_id)` is called exactly once per terminal transfer (except DONE when
  `release_on_done` is false, i.e. on the receiver), never while a table lock is held,
  only after any local writer of the request's blocks finished its current layer
  (`write_lock`), and only after a *fence* is lifted: when another process may still be
  writing the blocks (`shm`), release waits for its acknowledgement or its death. After
  `fence_timeout_s` without either, the owner's fence-timeout handler decides: cut the
  writer off and release (a writer that is our own thread), or keep the blocks
  *quarantined* until the writer is proven stopped (another process, e.g. one that is
  SIGSTOPped: cutting its connection does not stop its copy);
- terminal records linger `tombstone_ttl_s` so late polls and late frames are answered.

A `Reaper` thread calls its owner's `_reap` (the `Receiver`'s or `Sender`'s) periodically:
expire overdue transfers, time out fences, forget old tombstones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer.base import (
    KVTransferError,
    ReleaseFn,
    Ticket,
    TransferState,
    UnknownTransferError,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class TransferRecord:
    request_id: str
    block_ids: tuple[int, ...]
    deadline: float  # monotonic (time.monotonic())
    ticket: Ticket | None = None  # sender side: the ticket being served
    state: TransferState = TransferState.PENDING
    error: KVTransferError | None = None
    layers_mask: int = 0  # bit l set once layer l has landed (receiver) / been sent (sender)
    peer: object | None = None  # the connection this transfer is bound to, if any
    fenced: bool = False  # release waits until the remote writer confirms it stopped
    fence_deadline: float = 0.0  # monotonic
    quarantined: bool = False  # fenced past fence_deadline: held until the writer is gone
    released: bool = False  # release() called (or not due: DONE on the receiver)
    ended_at: float = 0.0  # monotonic time of the terminal transition
    # Held by a local thread while it writes (or reads) this request's blocks.
    write_lock: threading.RLock = field(default_factory=threading.RLock)
    cache: dict[str, object] = field(default_factory=dict)  # data path scratch (copy plans)

    @property
    def num_layers_done(self) -> int:
        return self.layers_mask.bit_count()


class TransferTable:
    """Thread-safe map request id -> record, with the terminal/release rules above."""

    def __init__(
        self,
        release: ReleaseFn,
        *,
        release_on_done: bool,
        fence_timeout_s: float = 5.0,
        tombstone_ttl_s: float = 120.0,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self._release = release
        self._fence = fence  # e.g. wait for a GPU stream still writing the blocks
        self._release_on_done = release_on_done
        self._fence_timeout_s = fence_timeout_s
        self._tombstone_ttl_s = tombstone_ttl_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._records: dict[str, TransferRecord] = {}

    # -- lookups ---------------------------------------------------------------------------

    def get(self, request_id: str) -> TransferRecord | None:
        with self._lock:
            return self._records.get(request_id)

    def require(self, request_id: str) -> TransferRecord:
        record = self.get(request_id)
        if record is None:
            raise UnknownTransferError(f"no transfer for request {request_id!r}")
        return record

    def open_records(self) -> list[TransferRecord]:
        with self._lock:
            return [r for r in self._records.values() if not r.state.is_terminal]

    def records_bound_to(self, peer: object) -> list[TransferRecord]:
        """Non-terminal or fenced records whose transfer runs over `peer`."""
        with self._lock:
            return [
                r
                for r in self._records.values()
                if r.peer is peer and (r.fenced or not r.state.is_terminal)
            ]

    # -- transitions -----------------------------------------------------------------------

    def add(self, record: TransferRecord) -> TransferRecord:
        """Insert a new PENDING record; a terminal record of the same id is replaced."""
        with self._lock:
            old = self._records.get(record.request_id)
            if old is not None and (not old.state.is_terminal or old.fenced):
                raise ValueError(f"a transfer for request {record.request_id!r} is still open")
            self._records[record.request_id] = record
            self._changed.notify_all()
        return record

    def add_terminal(
        self, record: TransferRecord, state: TransferState, error: KVTransferError | None
    ) -> None:
        """Insert a record that is born terminal (e.g. an abort before any send) and settle it."""
        record.state, record.error, record.ended_at = state, error, time.monotonic()
        with self._lock:
            self._records[record.request_id] = record
            self._changed.notify_all()
        self._settle(record)

    def bind(self, record: TransferRecord, peer: object) -> bool:
        """PENDING -> TRANSFERRING over `peer`; False if already bound or terminal."""
        with self._lock:
            if record.state is not TransferState.PENDING or record.peer is not None:
                return False
            record.state, record.peer = TransferState.TRANSFERRING, peer
            self._changed.notify_all()
            return True

    def mark_layer(self, record: TransferRecord, layer: int) -> bool:
        with self._lock:
            if record.state.is_terminal:
                return False
            record.layers_mask |= 1 << layer
            if record.state is TransferState.PENDING:
                record.state = TransferState.TRANSFERRING
            self._changed.notify_all()
            return True

    def finish(
        self,
        request_id: str,
        state: TransferState,
        error: KVTransferError | None = None,
        *,
        fence_if_bound: bool = False,
    ) -> bool:
        """Move a transfer to terminal `state`; True if this call did it (first one wins).

        With `fence_if_bound`, a transfer bound to a peer keeps its blocks until `unfence`.
        """
        assert state.is_terminal
        with self._lock:
            record = self._records.get(request_id)
            if record is None or record.state.is_terminal:
                return False
            record.state, record.error = state, error
            record.ended_at = time.monotonic()
            if fence_if_bound and record.peer is not None:
                record.fenced = True
                record.fence_deadline = record.ended_at + self._fence_timeout_s
            self._changed.notify_all()
        self._settle(record)
        return True

    def unfence(self, request_id: str, peer: object | None = None) -> None:
        """The remote writer stopped (acknowledged, aborted itself, or died): release now."""
        with self._lock:
            record = self._records.get(request_id)
            if record is None or not record.fenced:
                return
            if peer is not None and record.peer is not peer:
                return
            record.fenced = record.quarantined = False
            self._changed.notify_all()
        self._settle(record)

    def _settle(self, record: TransferRecord) -> None:
        with self._lock:
            if record.released or record.fenced or not record.state.is_terminal:
                return
            record.released = True
            if record.state is TransferState.DONE and not self._release_on_done:
                return
        with record.write_lock:  # a local writer finishes its layer before the blocks go
            pass
        try:
            if self._fence is not None:
                self._fence()
            self._release(record.request_id)
        except Exception:
            logger.exception("release(%r) raised", record.request_id)

    # -- waiting ---------------------------------------------------------------------------

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        """Block until the transfer is terminal or `timeout_s` passes; returns its state."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                record = self._records.get(request_id)
                if record is None:
                    raise UnknownTransferError(f"no transfer for request {request_id!r}")
                left = deadline - time.monotonic()
                if record.state.is_terminal or left <= 0:
                    return record.state
                self._changed.wait(left)

    def wait_unfenced(self, timeout_s: float) -> bool:
        """Block until no record is fenced (every remote writer confirmed) or time runs out."""
        with self._lock:
            return self._changed.wait_for(
                lambda: not any(r.fenced for r in self._records.values()), timeout_s
            )

    def fenced_records(self) -> list[TransferRecord]:
        with self._lock:
            return [r for r in self._records.values() if r.fenced]

    def quarantined_records(self) -> list[TransferRecord]:
        """Fenced records whose fence timed out with the writer possibly still running."""
        with self._lock:
            return [r for r in self._records.values() if r.quarantined]

    def counts(self) -> dict[str, int]:
        """`num_open` transfers, `num_fenced` (ended, waiting for the writer to confirm it
        stopped) and of those `num_quarantined` (fence timed out, writer may still run)."""
        with self._lock:
            records = list(self._records.values())
        return {
            "num_open": sum(not r.state.is_terminal for r in records),
            "num_fenced": sum(r.fenced for r in records),
            "num_quarantined": sum(r.quarantined for r in records),
        }

    # -- housekeeping (reaper) -------------------------------------------------------------

    def overdue(self, now: float) -> list[str]:
        """Ids of non-terminal transfers whose deadline (monotonic) has passed."""
        with self._lock:
            return [
                r.request_id
                for r in self._records.values()
                if not r.state.is_terminal and r.deadline <= now
            ]

    def sweep(self, on_fence_timeout: Callable[[TransferRecord], bool] | None = None) -> None:
        """Time out fences, and forget settled tombstones past their TTL.

        For each fence past its deadline, `on_fence_timeout(record)` says whether the blocks
        may go now (the receiver cut the writer off there): True releases them, False keeps
        them quarantined until `unfence` (the writer acknowledged or is proven gone).
        Without a handler a timed-out fence is lifted.
        """
        now = time.monotonic()
        with self._lock:
            stuck = [
                r
                for r in self._records.values()
                if r.fenced and not r.quarantined and r.fence_deadline <= now
            ]
            stale = [
                rid
                for rid, r in self._records.items()
                if r.released and r.ended_at + self._tombstone_ttl_s <= now
            ]
            for rid in stale:
                del self._records[rid]
        for r in stuck:
            try:
                release_now = on_fence_timeout is None or on_fence_timeout(r)
            except Exception:
                logger.exception("fence timeout handler failed for %r", r.request_id)
                release_now = False  # keep the blocks: a stray write is worse than a leak
            if release_now:
                logger.warning(
                    "transfer %r: writer did not confirm it stopped within %.1fs; cut off",
                    r.request_id,
                    self._fence_timeout_s,
                )
                self.unfence(r.request_id)
                continue
            with self._lock:
                if not r.fenced:  # acknowledged meanwhile
                    continue
                r.quarantined = True
            logger.warning(
                "transfer %r: writer did not confirm it stopped within %.1fs and may still "
                "run; its %d blocks stay quarantined until it acknowledges or is gone",
                r.request_id,
                self._fence_timeout_s,
                len(r.block_ids),
            )


class Reaper:
    """A daemon thread that calls `tick()` every `interval_s` until `stop()`."""

    def __init__(self, name: str, interval_s: float, tick: Callable[[], None]) -> None:
        self._interval_s = interval_s
        self._tick = tick
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            try:
                self._tick()
            except Exception:
                logger.exception("reaper tick failed")

    @property
    def is_alive(self) -> bool:
        """Whether the thread still runs (it stops only through `stop`)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Called by the owner's close(); waits for the thread to exit."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
