"""`Endpoint`, the base of `Sender` and `Receiver`: the transfer table and its reaper
thread, the open connections and their reader threads, refusal counts, expiry, closing,
and the queries either side answers about a transfer. Thread-safe."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Self

from kvtransfer.base import (
    KVTransferError,
    PeerLostError,
    PeerTimeoutError,
    ProtocolError,
    ReleaseFn,
    TransferAbortedError,
    TransferExpiredError,
    TransferOptions,
    TransferState,
)
from kvtransfer.table import ObserveFn, TransferRecord, TransferTable
from kvtransfer.wire import Connection, Header

logger = logging.getLogger(__name__)
ConnFn = Callable[[Connection], None]


class Endpoint:
    """A subclass sets its own state, then calls this `__init__` (which starts the
    reaper), then starts its threads; it defines `_terminate` (end a transfer from its
    side) and may extend `_housekeeping` (run by the reaper after expiring transfers)."""

    role = "endpoint"

    def __init__(
        self,
        backend: str,
        options: TransferOptions,
        release: ReleaseFn,
        *,
        release_on_done: bool,
        fence: Callable[[TransferRecord], object] | None = None,
        observe: ObserveFn | None = None,
    ) -> None:
        self.backend, self.options, self.closed = backend, options, False
        self._table = TransferTable(
            release,
            release_on_done=release_on_done,
            fence_timeout_s=options.fence_timeout_s,
            ttl_s=options.tombstone_ttl_s,
            fence=fence,
            observe=observe,
        )
        self._lock = threading.Lock()  # guards `connections` and `refusals`
        self.connections: set[Connection] = set()
        self.refusals: Counter[str] = Counter()  # why peers were cut off, by reason
        self._close_lock, self._stopped = threading.Lock(), threading.Event()
        self._reaper = self._every("reaper", options.reap_interval_s, self._reap)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def poll(self, request_id: str) -> TransferState:
        """The transfer's state (decode polls it when a prefill call returns, and for a
        reservation whose lease expired); never blocks, frees nothing."""
        return self._table.require(request_id).state

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        """Block up to `timeout_s` for a terminal state (prefill, after `finish`); frees
        nothing."""
        return self._table.wait(request_id, timeout_s)

    def error(self, request_id: str) -> KVTransferError | None:
        """Why a transfer ended FAILED/ABORTED/EXPIRED (None otherwise)."""
        return self._table.require(request_id).error

    def close(self) -> None:
        raise NotImplementedError

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        raise NotImplementedError

    def _housekeeping(self) -> None:
        self._table.sweep()

    def _start(self, what: str, target: Callable[..., None], *args: object) -> threading.Thread:
        """Start a daemon thread named for this endpoint."""
        name = f"kv-{self.backend}-{self.role}-{what}"
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    def _every(self, what: str, interval_s: float, tick: Callable[[], None]) -> threading.Thread:
        """A daemon thread running `tick` every `interval_s` until `_end_close` (a failed
        tick is logged; the next one still runs)."""

        def loop() -> None:
            while not self._stopped.wait(interval_s):
                try:
                    tick()
                except Exception:
                    logger.exception("%s %s tick failed", self.role, what)

        return self._start(what, loop)

    def _reap(self) -> None:
        for request_id in self._table.overdue(time.monotonic()):
            expired = TransferExpiredError("ticket deadline passed")
            self._terminate(request_id, TransferState.EXPIRED, expired)
        self._housekeeping()

    def _count(self, reason: str) -> None:
        with self._lock:
            self.refusals[reason] += 1

    def _run_connection(self, conn: Connection, body: ConnFn, drop: ConnFn) -> None:
        """A connection's thread: run `body` (read its frames); whatever ended it, mark it
        dead, let the owner `drop` its transfers, then close and forget it. A peer breaking
        the protocol fails the transfers bound to it."""
        conn.thread = threading.current_thread()  # before any frame: fences look for it
        try:
            body(conn)
        except ProtocolError as exc:
            self._count("protocol_error")
            logger.warning("closing %s connection %s: %s", self.role, conn.name, exc)
            for record in self._table.bound_to(conn):
                self._terminate(record.request_id, TransferState.FAILED, exc)
        except PeerTimeoutError as exc:
            self._count("handshake_timeout")
            logger.debug("%s connection %s: %s", self.role, conn.name, exc)
        except PeerLostError as exc:
            logger.debug("%s connection %s lost: %s", self.role, conn.name, exc)
        except Exception:
            logger.exception("%s connection %s failed", self.role, conn.name)
        finally:
            conn.alive = False
            try:
                drop(conn)
            finally:  # even when the data path's `disconnected` raises
                conn.fs.close()
                with self._lock:
                    self.connections.discard(conn)

    @staticmethod
    def _read(conn: Connection, dispatch: Callable[[Connection, Header], None]) -> None:
        """Dispatch frames in order until EOF, noting whether the peer closed first."""
        while (header := conn.fs.recv_header()) is not None:
            conn.last_used = time.monotonic()
            dispatch(conn, header)
        conn.state["peer_closed"] = not conn.fs.closed

    def _problem(self, **threads: threading.Thread) -> str | None:
        """For `serving_problem`: closed, or which essential thread died."""
        if self.closed:
            return f"{self.role} closed"
        for what, thread in {"reaper": self._reaper, **threads}.items():
            if not thread.is_alive():
                return f"{self.role} {what} thread died"
        return None

    def _begin_close(self) -> bool:
        """First call only (else False): refuse new work and abort every open transfer."""
        with self._close_lock:
            if self.closed:
                return False
            self.closed = True
        for record in self._table.records(lambda r: not r.state.is_terminal):
            error = TransferAbortedError(f"{self.role} closed")
            self._terminate(record.request_id, TransferState.ABORTED, error)
        return True

    def _end_close(self, *threads: threading.Thread) -> None:
        """Stop the reaper, join `threads` (told to stop already), close every connection
        and join its thread."""
        self._stopped.set()
        for thread in (self._reaper, *threads):
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        with self._lock:
            connections = list(self.connections)
        for conn in connections:
            conn.fs.close()
        for conn in connections:
            if conn.thread not in (None, threading.current_thread()):
                conn.thread.join(timeout=5.0)  # type: ignore[union-attr]
