"""Sender side of the socket-based backends (`shm`, `tcp`, `nccl`).

`send_layer`/`finish` only enqueue. One worker thread drains the queue in order:

    connection (cached per endpoint, replaced after `idle_timeout_s / 2` unused):
        CHALLENGE -> HELLO (our proof of the secret) -> WELCOME (the receiver's proof,
        checked before any write) | REFUSE (-> AuthenticationError, KVLayoutMismatchError)
    first item of a ticket: epoch check, BEGIN -> wait ACCEPT | REJECT
    layer items: backend `_write_layers` (shm: copy into the mapped cache, all layers
        already queued in one native call; tcp: one payload frame per layer)
    finish item: FINISH; the transfer turns DONE when the receiver's RESULT arrives

`connect(ticket)` (called by prefill when the ticket arrives) does the handshake and
BEGIN on the caller's thread instead, so the first layer starts without a round trip.

One reader thread per connection handles ACCEPT/REJECT/RESULT and the receiver's ABORT:
it stops our writes (under the record's write_lock), answers ABORT_ACK, and releases.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError

import torch

from engine.kv_cache import KVCacheSpec
from kvtransfer import auth
from kvtransfer.base import (
    KVLayout,
    KVTransferError,
    PeerLostError,
    ProtocolError,
    ReleaseFn,
    StaleEpochError,
    Ticket,
    TransferAbortedError,
    TransferExpiredError,
    TransferOptions,
    TransferState,
    error_from_wire,
    error_to_wire,
)
from kvtransfer.connections import ABORT_ITEM, FINISH_ITEM, LayerItem, ReceiverConnection
from kvtransfer.core import RejectedError, TableSender
from kvtransfer.table import TransferRecord
from kvtransfer.wire import FrameSocket, Header, Kind

logger = logging.getLogger(__name__)


class StreamSender(TableSender):
    """Queue, worker, connections; subclasses implement `_open_socket` and `_write_layer`."""

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
    ) -> None:
        super().__init__(spec, model_id=model_id, release=release, options=options)
        self.checksum = options.checksum
        self.corrupt_layers = options.corrupt_layers
        self._io_timeout_s = options.io_timeout_s
        self._connect_timeout_s = options.connect_timeout_s
        self._queue: queue.SimpleQueue[LayerItem | None] = queue.SimpleQueue()
        self._connections: dict[str, ReceiverConnection] = {}
        self._connections_lock = threading.Lock()
        self._worker = threading.Thread(
            target=self._work, name=f"kv-{self.backend}-send", daemon=True
        )
        self._worker.start()

    def serving_problem(self) -> str | None:
        problem = super().serving_problem()
        if problem is None and not self._worker.is_alive():
            return "sender thread died: no layer can be sent"
        return problem

    # -- backend hooks ---------------------------------------------------------------------

    def _open_socket(self, endpoint: str, timeout_s: float) -> socket.socket:
        """A connected socket to the receiver's control endpoint."""
        raise NotImplementedError

    def _on_welcome(self, conn: ReceiverConnection) -> None:
        """After the handshake (shm: map the segment; nccl: join the communicator)."""

    def _write_layer(
        self, conn: ReceiverConnection, record: TransferRecord, item: LayerItem
    ) -> None:
        """Move one layer and send its LAYER frame."""
        raise NotImplementedError

    def _write_layers(
        self, conn: ReceiverConnection, record: TransferRecord, items: list[LayerItem]
    ) -> None:
        """Move consecutive queued layers of one transfer (shm copies them in one call)."""
        for item in items:
            self._write_layer(conn, record, item)

    def _item_ready(self, k_cache: torch.Tensor) -> object | None:
        """Called on the caller's thread in send_layer (nccl: record a CUDA event)."""
        return None

    def _on_disconnected(self, conn: ReceiverConnection) -> None:
        """Connection gone (shm: unmap; nccl: abort the communicator)."""

    # -- interface -------------------------------------------------------------------------

    def _bind_now(self, record: TransferRecord, ticket: Ticket, timeout_s: float) -> None:
        """Called by `connect`: handshake (or reuse the connection), BEGIN, wait for ACCEPT."""
        conn = self._connection(ticket.endpoint, min(timeout_s, ticket.seconds_left()))
        self._begin(conn, record, ticket)

    def _send_layer(self, record: TransferRecord, item: LayerItem) -> None:
        """Called by `send_layer` on the caller's thread: queue the layer for the worker."""
        assert item.k_cache is not None
        item.ready = self._item_ready(item.k_cache)
        self._queue.put(item)

    def finish(self, ticket: Ticket) -> None:
        if self._closed:
            raise RuntimeError("sender is closed")
        if self._record(ticket) is not None:
            self._queue.put(LayerItem(ticket, FINISH_ITEM))

    # -- worker ----------------------------------------------------------------------------

    def _work(self) -> None:
        backlog: deque[LayerItem | None] = deque()
        while (item := backlog.popleft() if backlog else self._queue.get()) is not None:
            if item.layer == ABORT_ITEM:
                self._send_unbound_abort(item.ticket)
                continue
            batch = [item]
            while item.layer >= 0:  # coalesce the layers of this ticket already queued
                try:
                    following = backlog.popleft() if backlog else self._queue.get_nowait()
                except queue.Empty:
                    break
                if following is None or following.layer < 0 or following.ticket != item.ticket:
                    backlog.appendleft(following)
                    break
                batch.append(following)
            record = self._table.get(item.ticket.request_id)
            if record is None or record.ticket != item.ticket or record.state.is_terminal:
                continue
            try:
                self._serve(record, batch)
            except RejectedError as exc:
                self._terminate(record.request_id, exc.state, exc.cause)
            except KVTransferError as exc:
                state = TransferState.FAILED
                if item.ticket.seconds_left() <= 0:
                    state, exc = TransferState.EXPIRED, TransferExpiredError(str(exc))
                self._terminate(record.request_id, state, exc)
            except Exception as exc:
                logger.exception("sending %r failed", record.request_id)
                self._terminate(record.request_id, TransferState.FAILED, KVTransferError(repr(exc)))

    def _serve(self, record: TransferRecord, batch: list[LayerItem]) -> None:
        item = batch[0]
        ticket = item.ticket
        timeout_s = min(self._connect_timeout_s, ticket.seconds_left())
        if timeout_s <= 0:
            raise TransferExpiredError("ticket deadline passed before sending")
        conn = self._connection(ticket.endpoint, timeout_s)
        self._begin(conn, record, ticket)
        if record.state.is_terminal:
            return
        if record.peer is not conn:
            raise PeerLostError("connection to the receiver was replaced mid-transfer")
        if item.layer >= 0:
            self._write_layers(conn, record, batch)
            for done in batch:
                self._table.mark_layer(record, done.layer)
        else:
            conn.fs.send(
                Kind.FINISH, ticket.request_id, epoch=ticket.epoch, layer=self.spec.num_layers
            )

    def _send_unbound_abort(self, ticket: Ticket) -> None:
        """Tell the receiver about an abort that happened before BEGIN (best effort)."""
        timeout_s = min(self._connect_timeout_s, ticket.seconds_left())
        if timeout_s <= 0:
            return  # the receiver expires it on its own
        error = TransferAbortedError("aborted by prefill before sending")
        try:
            conn = self._connection(ticket.endpoint, timeout_s)
            conn.fs.send_json(
                Kind.ABORT,
                ticket.request_id,
                error_to_wire(error),
                epoch=ticket.epoch,
                layer=TransferState.ABORTED.code,
            )
        except KVTransferError as exc:
            logger.debug(
                "could not tell %s about aborting %r: %s", ticket.endpoint, ticket.request_id, exc
            )

    def _begin(self, conn: ReceiverConnection, record: TransferRecord, ticket: Ticket) -> None:
        """Bind the transfer to `conn` (BEGIN) once; every caller waits for the ACCEPT."""
        with self._records_lock:
            accepted = record.cache.get("accepted")
            if not isinstance(accepted, Future):
                _check_epoch(ticket, conn)
                accepted = record.cache["accepted"] = Future()
                conn.pending[ticket.request_id] = accepted
                if not self._table.bind(record, conn):
                    return  # ended meanwhile
                conn.fs.send(Kind.BEGIN, ticket.request_id, epoch=ticket.epoch)
        try:
            accepted.result(timeout=max(0.0, min(self._io_timeout_s, ticket.seconds_left())))
        except TimeoutError:
            raise PeerLostError("receiver did not answer BEGIN in time") from None
        finally:
            conn.pending.pop(ticket.request_id, None)

    # -- connections -----------------------------------------------------------------------

    def _connection(self, endpoint: str, timeout_s: float) -> ReceiverConnection:
        with self._connections_lock:
            conn = self._connections.get(endpoint)
            now = time.monotonic()
            if conn is not None and conn.alive:
                # The receiver closes connections idle for `idle_timeout_s`; replace ours at
                # half that, so a BEGIN never races its close.
                stale = now - conn.last_used > self.options.idle_timeout_s / 2
                if not stale or self._table.records_bound_to(conn):
                    conn.last_used = now
                    return conn
                conn.alive = False
                conn.fs.close()  # its reader thread drops it
            conn = self._handshake(endpoint, timeout_s)
            self._connections[endpoint] = conn
        conn.thread = threading.Thread(
            target=self._read, args=(conn,), name=f"kv-{self.backend}-send-read", daemon=True
        )
        conn.thread.start()
        return conn

    def _handshake(self, endpoint: str, timeout_s: float) -> ReceiverConnection:
        try:
            sock = self._open_socket(endpoint, timeout_s)
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {endpoint}: {exc}") from exc
        fs = FrameSocket(sock, self._io_timeout_s)
        try:
            fs.limit_reads(timeout_s)
            welcome = auth.sender_handshake(fs, endpoint, self.layout, self.options.secret)
            fs.limit_reads(None)
            remote = welcome.get("layout")
            if not isinstance(remote, dict):
                raise ProtocolError("malformed WELCOME")
            try:
                layout = KVLayout.from_dict(remote)
                conn = ReceiverConnection(fs, endpoint, welcome)
            except (TypeError, KeyError, ValueError):
                raise ProtocolError(f"malformed WELCOME from {endpoint}") from None
            self.layout.check_matches(layout, "sender", "receiver")
            self._on_welcome(conn)
            return conn
        except BaseException:
            fs.close()
            raise

    def _read(self, conn: ReceiverConnection) -> None:
        try:
            while (header := conn.fs.recv_header()) is not None:
                self._dispatch(conn, header)
        except PeerLostError as exc:
            logger.debug("receiver connection %s lost: %s", conn.endpoint, exc)
        except Exception:
            logger.exception("receiver connection %s failed", conn.endpoint)
        finally:
            self._drop(conn)

    def _dispatch(self, conn: ReceiverConnection, header: Header) -> None:
        rid = header.request_id
        body = conn.fs.recv_json(header) if header.nbytes else {}
        pending = conn.pending.get(rid)
        if header.kind is Kind.ACCEPT:
            _resolve(pending, None)
        elif header.kind is Kind.REJECT:
            state = TransferState.from_code(header.layer)
            _resolve(pending, RejectedError(state, error_from_wire(body, "receiver")))
        elif header.kind is Kind.ABORT:
            state = TransferState.from_code(header.layer)
            error = error_from_wire(body, "receiver")
            _resolve(pending, RejectedError(state, error))
            record = self._table.get(rid)
            if record is not None and record.peer is conn:
                with record.write_lock:  # our current copy into its blocks completes first
                    self._table.finish(rid, state, error)
            conn.fs.send(Kind.ABORT_ACK, rid)
        elif header.kind is Kind.RESULT:
            state = TransferState.from_code(header.layer)
            record = self._table.get(rid)
            if record is not None and record.peer is conn:
                self._table.finish(rid, state, error_from_wire(body, "receiver") if body else None)
        else:
            logger.warning("unexpected %s frame from receiver; ignored", header.kind.name)

    def _drop(self, conn: ReceiverConnection) -> None:
        conn.alive = False
        lost = PeerLostError(f"connection to receiver {conn.endpoint} lost")
        # Stop writing before closing: the receiver frees the blocks of a live sender's
        # transfers when it sees the connection close (shm: we write its memory).
        for record in self._table.records_bound_to(conn):
            with record.write_lock:
                self._table.finish(record.request_id, TransferState.FAILED, lost)
        conn.fs.close()
        with self._connections_lock:
            if self._connections.get(conn.endpoint) is conn:
                del self._connections[conn.endpoint]
        for pending in list(conn.pending.values()):
            _resolve(pending, lost)
        self._on_disconnected(conn)

    # -- ending transfers from this side ---------------------------------------------------

    def _notify_peer(
        self, record: TransferRecord, state: TransferState, error: KVTransferError
    ) -> None:
        conn = record.peer
        if conn is None and state is TransferState.ABORTED and record.ticket is not None:
            self._queue.put(LayerItem(record.ticket, ABORT_ITEM))
            return
        if not isinstance(conn, ReceiverConnection):
            return
        _resolve(conn.pending.get(record.request_id), RejectedError(state, error))
        if conn.alive:
            with contextlib.suppress(PeerLostError):
                conn.fs.send_json(
                    Kind.ABORT, record.request_id, error_to_wire(error), layer=state.code
                )

    def _shutdown(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5.0)
        with self._connections_lock:
            connections = list(self._connections.values())
        for conn in connections:
            conn.fs.close()
        for conn in connections:
            if conn.thread is not None and conn.thread is not threading.current_thread():
                conn.thread.join(timeout=5.0)


def _check_epoch(ticket: Ticket, conn: ReceiverConnection) -> None:
    if ticket.epoch != conn.epoch:
        raise StaleEpochError(
            f"ticket for {ticket.request_id!r} carries epoch {ticket.epoch} but the receiver at "
            f"{ticket.endpoint} is now epoch {conn.epoch} (it restarted); ticket refused"
        )


def _resolve(pending: Future[None] | None, error: KVTransferError | None) -> None:
    if pending is None:
        return
    try:
        if error is None:
            pending.set_result(None)
        else:
            pending.set_exception(error)
    except InvalidStateError:
        pass
