"""What a `Sender` and a `Receiver` share, held by each (composition, not a base class):
the transfer table and its reaper thread, the open connections and their reader threads,
refusal counts, expiry, and closing."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from kvtransfer.base import (
    KVTransferError,
    PeerLostError,
    PeerTimeoutError,
    ProtocolError,
    TransferAbortedError,
    TransferExpiredError,
    TransferOptions,
    TransferState,
)
from kvtransfer.table import TransferTable
from kvtransfer.wire import Connection, Header

logger = logging.getLogger(__name__)
ConnFn = Callable[[Connection], None]


class Endpoint:
    """Held by one `Sender` or `Receiver` (`role`), which passes its `terminate` (end a
    transfer from its side) and the `housekeeping` its reaper does after expiring overdue
    transfers (default: `table.sweep()`). Thread-safe."""

    def __init__(
        self,
        role: str,
        backend: str,
        options: TransferOptions,
        table: TransferTable,
        terminate: Callable[[str, TransferState, KVTransferError], None],
        housekeeping: Callable[[], None] | None = None,
    ) -> None:
        self.role, self.table, self.closed = role, table, False
        self.lock = threading.Lock()  # guards `connections` and `refusals`
        self.connections: set[Connection] = set()
        self.refusals: Counter[str] = Counter()  # why peers were cut off, by reason
        self._close_lock = threading.Lock()
        self._terminate, self._housekeeping = terminate, housekeeping or table.sweep
        self._prefix, self._stopped = f"kv-{backend}-{role}", threading.Event()
        self._reaper = self.every("reaper", options.reap_interval_s, self._reap)

    def start(self, what: str, target: Callable[..., None], *args: object) -> threading.Thread:
        """Start a daemon thread named for this endpoint."""
        thread = threading.Thread(target=target, args=args, name=f"{self._prefix}-{what}")
        thread.daemon = True
        thread.start()
        return thread

    def every(self, what: str, interval_s: float, tick: Callable[[], None]) -> threading.Thread:
        """Start a daemon thread that runs `tick` every `interval_s` until `end_close` (a
        failed tick is logged; the next one still runs). `end_close` joins the reaper; the
        owner passes its other such threads to it."""

        def loop() -> None:
            while not self._stopped.wait(interval_s):
                try:
                    tick()
                except Exception:
                    logger.exception("%s %s tick failed", self.role, what)

        return self.start(what, loop)

    def _reap(self) -> None:
        """Reaper thread: end overdue transfers EXPIRED, then the owner's housekeeping."""
        for request_id in self.table.overdue(time.monotonic()):
            expired = TransferExpiredError("ticket deadline passed")
            self._terminate(request_id, TransferState.EXPIRED, expired)
        self._housekeeping()

    def count(self, reason: str) -> None:
        with self.lock:
            self.refusals[reason] += 1

    def serve(self, conn: Connection, body: ConnFn, drop: ConnFn) -> None:
        """A connection's thread: run `body` (read its frames); whatever ended it, mark it
        dead, let the owner `drop` its transfers, then close and forget it. A peer breaking
        the protocol fails the transfers bound to it."""
        try:
            body(conn)
        except ProtocolError as exc:
            self.count("protocol_error")
            logger.warning("closing %s connection %s: %s", self.role, conn.name, exc)
            for record in self.table.bound_to(conn):
                self._terminate(record.request_id, TransferState.FAILED, exc)
        except PeerTimeoutError as exc:
            self.count("handshake_timeout")
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
                with self.lock:
                    self.connections.discard(conn)

    @staticmethod
    def read(conn: Connection, dispatch: Callable[[Connection, Header], None]) -> None:
        """Dispatch frames in order until EOF, noting whether the peer closed first."""
        while (header := conn.fs.recv_header()) is not None:
            conn.last_used = time.monotonic()
            dispatch(conn, header)
        conn.state["peer_closed"] = not conn.fs.closed

    def problem(self, threads: dict[str, threading.Thread]) -> str | None:
        """For `serving_problem`: closed, or which essential thread died."""
        if self.closed:
            return f"{self.role} closed"
        for what, thread in {"reaper": self._reaper, **threads}.items():
            if not thread.is_alive():
                return f"{self.role} {what} thread died"
        return None

    def begin_close(self) -> bool:
        """First call only (else False): refuse new work and abort every open transfer."""
        with self._close_lock:
            if self.closed:
                return False
            self.closed = True
        for record in self.table.records(lambda r: not r.state.is_terminal):
            error = TransferAbortedError(f"{self.role} closed")
            self._terminate(record.request_id, TransferState.ABORTED, error)
        return True

    def end_close(self, *threads: threading.Thread) -> None:
        """Stop the reaper, join `threads` (told to stop already), close every connection
        and join its thread."""
        self._stopped.set()
        for thread in (self._reaper, *threads):
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        with self.lock:
            connections = list(self.connections)
        for conn in connections:
            conn.fs.close()
        for conn in connections:
            if conn.thread not in (None, threading.current_thread()):
                conn.thread.join(timeout=5.0)  # type: ignore[union-attr]
