"""The transfer state machine both ends hold: one `TransferRecord` per request id.

A `TransferTable` guarantees: each transfer reaches exactly one terminal state (the first
`finish` wins); `release(request_id)` runs exactly once per ended transfer (not for DONE on
the receiver), outside the table lock, after any local writer finished its layer
(`write_lock`) and after the *fence* lifts: while another party may still write the
blocks, release waits for its acknowledgement or its death; past `fence_timeout_s` the
owner decides to cut it off and release, or to keep the blocks *quarantined* until it is
proven stopped. Ended records linger `ttl_s` to answer late polls and frames.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer.base import KVTransferError, ReleaseFn, Ticket, TransferState, UnknownTransferError

logger = logging.getLogger(__name__)

# (request id, its terminal state, its error, settled): called once when a transfer ends
# (settled False) and once when its blocks are free of every writer and `release` ran or
# was not due (settled True). Ranks of a tensor-parallel replica report to rank 0 this way
# (`kvtransfer.ranks`).
ObserveFn = Callable[[str, TransferState, KVTransferError | None, bool], None]


@dataclass(slots=True, eq=False)
class TransferRecord:
    request_id: str
    block_ids: tuple[int, ...]
    deadline: float  # monotonic
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

    @property
    def is_live(self) -> bool:
        """Not terminal, or terminal with its blocks still fenced."""
        return self.fenced or not self.state.is_terminal


class TransferTable:
    """Thread-safe map request id -> record, with the terminal/release rules above;
    `fence(record)` runs before every release (e.g. wait for a GPU stream writing its
    blocks)."""

    def __init__(
        self,
        release: ReleaseFn,
        *,
        release_on_done: bool,
        fence_timeout_s: float = 5.0,
        ttl_s: float = 120.0,
        fence: Callable[[TransferRecord], object] | None = None,
        observe: ObserveFn | None = None,
    ) -> None:
        self._release, self._release_on_done, self._fence = release, release_on_done, fence
        self._observe = observe
        self._fence_timeout_s, self._ttl_s = fence_timeout_s, ttl_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._records: dict[str, TransferRecord] = {}

    def get(self, request_id: str) -> TransferRecord | None:
        with self._lock:
            return self._records.get(request_id)

    def require(self, request_id: str) -> TransferRecord:
        if (record := self.get(request_id)) is None:
            raise UnknownTransferError(f"no transfer for request {request_id!r}")
        return record

    def records(self, keep: Callable[[TransferRecord], bool]) -> list[TransferRecord]:
        with self._lock:
            return [r for r in self._records.values() if keep(r)]

    def bound_to(self, peer: object) -> list[TransferRecord]:
        """Live records whose transfer runs over `peer` (a connection)."""
        return self.records(lambda r: r.peer is peer and r.is_live)

    def add(self, record: TransferRecord) -> TransferRecord:
        """Insert a new record; a terminal, unfenced one of the same id is replaced."""
        with self._lock:
            old = self._records.get(record.request_id)
            if old is not None and old.is_live:
                raise ValueError(f"a transfer for request {record.request_id!r} is still open")
            self._records[record.request_id] = record
            self._changed.notify_all()
        return record

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
        With `fence_if_bound`, a transfer bound to a peer keeps its blocks until `unfence`."""
        assert state.is_terminal
        with self._lock:
            record = self._records.get(request_id)
            if record is None or record.state.is_terminal:
                return False
            record.state, record.error, record.ended_at = state, error, time.monotonic()
            if fence_if_bound and record.peer is not None:
                record.fenced = True
                record.fence_deadline = record.ended_at + self._fence_timeout_s
            self._changed.notify_all()
        self._notify(record, settled=False)
        self._settle(record)
        return True

    def unfence(self, request_id: str, peer: object | None = None) -> None:
        """The remote writer (`peer`'s, if given) stopped: acknowledged, aborted itself or
        died. Releases the blocks now."""
        with self._lock:
            record = self._records.get(request_id)
            if record is None or not record.fenced or peer not in (None, record.peer):
                return
            record.fenced = record.quarantined = False
            self._changed.notify_all()
        self._settle(record)

    def _settle(self, record: TransferRecord) -> None:
        with self._lock:
            if record.released or record.is_live:
                return
            record.released = True
            due = record.state is not TransferState.DONE or self._release_on_done
        if due:
            with record.write_lock:  # a local writer finishes its layer before the blocks go
                pass
            try:
                if self._fence is not None:
                    self._fence(record)
                self._release(record.request_id)
            except Exception:
                logger.exception("release(%r) raised", record.request_id)
        self._notify(record, settled=True)

    def _notify(self, record: TransferRecord, settled: bool) -> None:
        if self._observe is None:
            return
        try:
            self._observe(record.request_id, record.state, record.error, settled)
        except Exception:
            logger.exception("observing %r raised", record.request_id)

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        """Block until the transfer is terminal or `timeout_s` passes; returns its state."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if (record := self._records.get(request_id)) is None:
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

    def counts(self) -> dict[str, int]:
        """`num_open` transfers, `num_fenced` (ended, waiting for the writer to confirm it
        stopped) and of those `num_quarantined` (fence timed out, writer may still run)."""
        records = self.records(lambda r: True)
        return {
            "num_open": sum(not r.state.is_terminal for r in records),
            "num_fenced": sum(r.fenced for r in records),
            "num_quarantined": sum(r.quarantined for r in records),
        }

    def overdue(self, now: float) -> list[str]:
        """Ids of non-terminal transfers whose deadline (monotonic) has passed."""
        late = self.records(lambda r: not r.state.is_terminal and r.deadline <= now)
        return [r.request_id for r in late]

    def sweep(self, on_fence_timeout: Callable[[TransferRecord], bool] | None = None) -> None:
        """Forget settled records past their TTL, and time out fences: `on_fence_timeout
        (record)` says whether the blocks may go now (True: released; False: quarantined
        until `unfence`); without a handler a timed-out fence is lifted."""
        now = time.monotonic()
        with self._lock:
            records = self._records.values()
            stuck = [
                r for r in records if r.fenced and not r.quarantined and r.fence_deadline <= now
            ]
            for r in [r for r in records if r.released and r.ended_at + self._ttl_s <= now]:
                del self._records[r.request_id]
        for r in stuck:
            try:
                release_now = on_fence_timeout is None or on_fence_timeout(r)
            except Exception:
                logger.exception("fence timeout handler failed for %r", r.request_id)
                release_now = False  # keep the blocks: a stray write is worse than a leak
            with self._lock:
                if not r.fenced:  # acknowledged meanwhile
                    continue
                r.quarantined = not release_now
            verdict = "cut off" if release_now else "blocks quarantined until it is gone"
            logger.warning(
                "transfer %r: writer did not confirm it stopped within %.1fs: %s",
                r.request_id,
                self._fence_timeout_s,
                verdict,
            )
            if release_now:
                self.unfence(r.request_id)
