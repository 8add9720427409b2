"""The prefill side: a `Sender` streams each request's layers to its ticket's receiver.

It holds the `TransferTable` and one `Writing`, the backend's data path (shm, tcp, nccl).
`send_layer`/`finish` only enqueue; one worker thread drains the queue in order:

    connection (cached per endpoint, replaced after `idle_timeout_s / 2` unused):
        CHALLENGE -> HELLO (our proof of the secret) -> WELCOME (the receiver's proof,
        checked before any write) | REFUSE (-> AuthenticationError, KVLayoutMismatchError)
        -> `Writing.welcome` (shm: map the segment; nccl: join the communicator)
    first item of a ticket: epoch check, BEGIN -> wait ACCEPT | REJECT
    layer items: `Writing.write` (shm: copy into the mapped cache, every layer already
        queued in one native call; tcp: one payload frame per layer; nccl: pack + send)
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
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.kv_cache import KVCacheSpec
from kvtransfer import auth
from kvtransfer.base import (
    BlockIds,
    KVLayout,
    KVLayoutMismatchError,
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
from kvtransfer.blockcopy import as_id_array
from kvtransfer.table import Reaper, TransferRecord, TransferTable
from kvtransfer.wire import Connection, FrameSocket, Header, Kind

logger = logging.getLogger(__name__)

FINISH_ITEM, ABORT_ITEM = -1, -2


@dataclass(slots=True)
class LayerItem:
    """One unit of the sender's queue, in the order the prefill produced it."""

    ticket: Ticket
    layer: int  # >= 0: a layer; FINISH_ITEM; ABORT_ITEM: tell the receiver we aborted
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    src_ids: np.ndarray | None = None
    ready: object | None = None  # `Writing.ready`'s marker (nccl: a CUDA event)


class Writing(Protocol):
    """A backend's sending data path, held by one `Sender` (which calls every method)."""

    backend: str

    def open(self, endpoint: str, timeout_s: float) -> socket.socket:
        """A connected socket to the receiver's control endpoint."""

    def welcome(self, conn: Connection) -> None:
        """After the receiver's WELCOME was verified: set up the connection's data path."""

    def ready(self, k_cache: torch.Tensor) -> object | None:
        """In `send_layer`, on the caller's thread: mark the layer computed (nccl: event)."""

    def write(
        self, conn: Connection, record: TransferRecord, items: list[LayerItem], checksum: bool
    ) -> None:
        """Worker thread: move consecutive queued layers of one transfer, then send their
        LAYER frames (with a CRC32 each when `checksum`). Writes into the receiver's blocks
        happen under `record.write_lock` and only while the record is not terminal."""

    def disconnected(self, conn: Connection) -> None:
        """The connection is gone: free its state (shm: unmap; nccl: abort the comm)."""


class RejectedError(KVTransferError):
    """The receiver refused or ended the transfer; `state` is the state it reported."""

    def __init__(self, state: TransferState, error: KVTransferError) -> None:
        super().__init__(str(error))
        self.state = state
        self.cause = error


class Sender:
    """Prefill side of every backend; thread-safe.

    `release(request_id)` is called exactly once for every request id given to `connect`,
    `send_layer`, `finish` or `abort`, when its transfer reaches any terminal state: the
    source blocks are then no longer read and may be freed.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        writing: Writing,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
    ) -> None:
        """Called by `create_sender` once per prefill replica; starts the worker thread."""
        self.backend = writing.backend
        self.spec = spec
        self.layout = KVLayout.from_spec(spec, model_id)
        self.options = options
        self._writing = writing
        self._table = TransferTable(
            release, release_on_done=True, tombstone_ttl_s=options.tombstone_ttl_s
        )
        self._records_lock = threading.Lock()
        self._closed = False
        self._close_lock = threading.Lock()
        self._queue: queue.SimpleQueue[LayerItem | None] = queue.SimpleQueue()
        self._connections: dict[str, Connection] = {}
        self._connections_lock = threading.Lock()
        self._reaper = Reaper(f"kv-{self.backend}-send-reaper", options.reap_interval_s, self._reap)
        self._worker = threading.Thread(
            target=self._work, name=f"kv-{self.backend}-send", daemon=True
        )
        self._worker.start()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- called by prefill ------------------------------------------------------------------

    def connect(self, ticket: Ticket, timeout_s: float) -> None:
        """Called by prefill when a ticket arrives, before computing.

        Registers the transfer, performs the handshake and binds it at the receiver now
        (so the first layer is written without a round trip), and raises
        `KVLayoutMismatchError`, `StaleEpochError`, `AuthenticationError` (the receiver
        and we do not share the secret) or `PeerLostError` instead of failing later; the
        transfer then ended FAILED and `release` follows as for any end. After a
        successful connect an `abort` reaches the receiver even before the first layer.
        Frees nothing.
        """
        record = self._record(ticket)
        if record is None:  # refused on the spot (layout) or already ended
            ended = self._table.require(ticket.request_id)
            raise ended.error or KVTransferError(f"transfer is {ended.state.value}")
        try:
            conn = self._connection(ticket.endpoint, min(timeout_s, ticket.seconds_left()))
            self._begin(conn, record, ticket)
        except RejectedError as exc:
            self._terminate(ticket.request_id, exc.state, exc.cause)
            raise exc.cause from None
        except KVTransferError as exc:
            self._terminate(ticket.request_id, TransferState.FAILED, exc)
            raise

    def send_layer(
        self,
        ticket: Ticket,
        layer: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        src_block_ids: BlockIds,
    ) -> None:
        """Called by the prefill model runner right after layer `layer` is computed.

        `k_cache`/`v_cache` are that layer's `[num_blocks, block_size, kv_heads, head_dim]`
        caches and `src_block_ids` the request's blocks there, in the ticket's order.
        Returns at once (the worker thread moves the layer, overlapping the next layer's
        compute); the source blocks must stay untouched until `release`. Raises ValueError
        only for caller bugs (shapes, layer index); transfer problems end it FAILED.
        """
        if self._closed:
            raise RuntimeError("sender is closed")
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.spec.num_layers})")
        expected = (self.spec.num_blocks, *self.spec.block_shape)
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if tuple(t.shape) != expected or t.dtype != self.spec.torch_dtype:
                raise ValueError(
                    f"{name} is {tuple(t.shape)}/{t.dtype}, expected {expected}/"
                    f"{self.spec.torch_dtype}"
                )
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (one layer of a paged cache)")
        if len(src_block_ids) != ticket.num_blocks:
            raise ValueError(
                f"{len(src_block_ids)} source blocks for a ticket of {ticket.num_blocks}"
            )
        if self._record(ticket) is not None:  # else the transfer already ended
            src_ids = as_id_array(src_block_ids)
            ready = self._writing.ready(k_cache)
            self._queue.put(LayerItem(ticket, layer, k_cache, v_cache, src_ids, ready))

    def finish(self, ticket: Ticket) -> None:
        """Called by prefill after the last `send_layer`; non-blocking. The transfer turns
        DONE when the receiver confirms every layer; `release` follows."""
        if self._closed:
            raise RuntimeError("sender is closed")
        if self._record(ticket) is not None:
            self._queue.put(LayerItem(ticket, FINISH_ITEM))

    def poll(self, request_id: str) -> TransferState:
        """Sender's view of the transfer; never blocks, frees nothing."""
        return self._table.require(request_id).state

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        """Block up to `timeout_s` for a terminal state; frees nothing."""
        return self._table.wait(request_id, timeout_s)

    def error(self, request_id: str) -> KVTransferError | None:
        """Why the transfer failed, if it did."""
        return self._table.require(request_id).error

    def abort(self, request_id: str) -> None:
        """Called by prefill on cancellation or error; idempotent, safe at any moment.

        Stops writing, tells the receiver (which then releases its blocks) and releases the
        source blocks.
        """
        error = TransferAbortedError("aborted by prefill")
        self._terminate(request_id, TransferState.ABORTED, error)

    def serving_problem(self) -> str | None:
        """Called by the replica's health check: why no layer can be sent now, or None."""
        if self._closed:
            return "sender closed"
        if not self._reaper.is_alive:
            return "sender reaper thread died"
        if not self._worker.is_alive():
            return "sender thread died: no layer can be sent"
        return None

    def close(self) -> None:
        """Called once at replica shutdown: aborts open transfers (releasing their source
        blocks), stops the threads and closes connections. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for record in self._table.open_records():
            error = TransferAbortedError("sender closed")
            self._terminate(record.request_id, TransferState.ABORTED, error)
        self._reaper.stop()
        self._queue.put(None)
        self._worker.join(timeout=5.0)
        with self._connections_lock:
            connections = list(self._connections.values())
        for conn in connections:
            conn.fs.close()
        for conn in connections:
            if conn.thread is not None and conn.thread is not threading.current_thread():
                conn.thread.join(timeout=5.0)

    # -- records ---------------------------------------------------------------------------

    def _record(self, ticket: Ticket) -> TransferRecord | None:
        """The live record serving `ticket`, created on first use; None once it is terminal."""
        failure: KVTransferError | None = None
        with self._records_lock:
            record = self._table.get(ticket.request_id)
            if record is not None and (record.ticket is None or record.ticket == ticket):
                return None if record.state.is_terminal else record
            if record is not None and not record.state.is_terminal:
                raise ValueError(
                    f"request {ticket.request_id!r} already has an open transfer "
                    "under another ticket"
                )
            record = TransferRecord(ticket.request_id, ticket.block_ids, ticket.expires_at, ticket)
            self._table.add(record)
            diffs = self.layout.differences(ticket.layout)
            if diffs:
                failure = KVLayoutMismatchError(diffs, "sender", "ticket")
        if failure is not None:
            self._table.finish(ticket.request_id, TransferState.FAILED, failure)
            return None
        return record

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        """End a transfer from this side: stop writing, tell the receiver, release."""
        with self._records_lock:
            record = self._table.get(request_id)
            if record is None:
                tomb = TransferRecord(request_id, (), time.monotonic())
                self._table.add_terminal(tomb, state, error)
                return
        with record.write_lock:  # wait for an in-flight layer copy into remote blocks
            ended = self._table.finish(request_id, state, error)
        if not ended:
            return
        conn = record.peer
        if conn is None and state is TransferState.ABORTED and record.ticket is not None:
            self._queue.put(LayerItem(record.ticket, ABORT_ITEM))  # tell an unbound receiver
            return
        if not isinstance(conn, Connection):
            return
        _resolve(conn.pending.get(request_id), RejectedError(state, error))
        if conn.alive:
            with contextlib.suppress(PeerLostError):
                conn.fs.send_json(Kind.ABORT, request_id, error_to_wire(error), layer=state.code)

    def _reap(self) -> None:
        """Reaper thread: expire overdue transfers, forget old tombstones."""
        for request_id in self._table.overdue(time.monotonic()):
            expired = TransferExpiredError("ticket deadline passed")
            self._terminate(request_id, TransferState.EXPIRED, expired)
        self._table.sweep()

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
        timeout_s = min(self.options.connect_timeout_s, ticket.seconds_left())
        if timeout_s <= 0:
            raise TransferExpiredError("ticket deadline passed before sending")
        conn = self._connection(ticket.endpoint, timeout_s)
        self._begin(conn, record, ticket)
        if record.state.is_terminal:
            return
        if record.peer is not conn:
            raise PeerLostError("connection to the receiver was replaced mid-transfer")
        if item.layer >= 0:
            self._writing.write(conn, record, batch, self.options.checksum)
            for done in batch:
                self._table.mark_layer(record, done.layer)
        else:
            num_layers = self.spec.num_layers
            conn.fs.send(Kind.FINISH, ticket.request_id, epoch=ticket.epoch, layer=num_layers)

    def _send_unbound_abort(self, ticket: Ticket) -> None:
        """Tell the receiver about an abort that happened before BEGIN (best effort)."""
        timeout_s = min(self.options.connect_timeout_s, ticket.seconds_left())
        if timeout_s <= 0:
            return  # the receiver expires it on its own
        error = error_to_wire(TransferAbortedError("aborted by prefill before sending"))
        code = TransferState.ABORTED.code
        try:
            conn = self._connection(ticket.endpoint, timeout_s)
            conn.fs.send_json(Kind.ABORT, ticket.request_id, error, epoch=ticket.epoch, layer=code)
        except KVTransferError as exc:
            rid = ticket.request_id
            logger.debug("could not tell %s about aborting %r: %s", ticket.endpoint, rid, exc)

    def _begin(self, conn: Connection, record: TransferRecord, ticket: Ticket) -> None:
        """Bind the transfer to `conn` (BEGIN) once; every caller waits for the ACCEPT."""
        with self._records_lock:
            accepted = record.cache.get("accepted")
            if not isinstance(accepted, Future):
                if ticket.epoch != conn.epoch:
                    raise StaleEpochError(
                        f"ticket for {ticket.request_id!r} carries epoch {ticket.epoch} but the "
                        f"receiver at {ticket.endpoint} is now epoch {conn.epoch} (it "
                        "restarted); ticket refused"
                    )
                accepted = record.cache["accepted"] = Future()
                conn.pending[ticket.request_id] = accepted
                if not self._table.bind(record, conn):
                    return  # ended meanwhile
                conn.fs.send(Kind.BEGIN, ticket.request_id, epoch=ticket.epoch)
        try:
            wait_s = max(0.0, min(self.options.io_timeout_s, ticket.seconds_left()))
            accepted.result(timeout=wait_s)
        except TimeoutError:
            raise PeerLostError("receiver did not answer BEGIN in time") from None
        finally:
            conn.pending.pop(ticket.request_id, None)

    # -- connections -----------------------------------------------------------------------

    def _connection(self, endpoint: str, timeout_s: float) -> Connection:
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

    def _handshake(self, endpoint: str, timeout_s: float) -> Connection:
        try:
            sock = self._writing.open(endpoint, timeout_s)
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {endpoint}: {exc}") from exc
        fs = FrameSocket(sock, self.options.io_timeout_s)
        try:
            fs.limit_reads(timeout_s)
            welcome = auth.sender_handshake(fs, endpoint, self.layout, self.options.secret)
            fs.limit_reads(None)
            conn = Connection(fs, endpoint)
            conn.welcome = welcome
            try:
                remote = welcome["layout"]
                if not isinstance(remote, dict):
                    raise TypeError("layout is not an object")
                layout = KVLayout.from_dict(remote)
                conn.epoch = int(str(welcome["epoch"]))
                conn.num_blocks = int(str(welcome["num_blocks"]))
            except (TypeError, KeyError, ValueError):
                raise ProtocolError(f"malformed WELCOME from {endpoint}") from None
            self.layout.check_matches(layout, "sender", "receiver")
            self._writing.welcome(conn)
            return conn
        except BaseException:
            fs.close()
            raise

    def _read(self, conn: Connection) -> None:
        try:
            while (header := conn.fs.recv_header()) is not None:
                self._dispatch(conn, header)
        except PeerLostError as exc:
            logger.debug("receiver connection %s lost: %s", conn.name, exc)
        except Exception:
            logger.exception("receiver connection %s failed", conn.name)
        finally:
            self._drop(conn)

    def _dispatch(self, conn: Connection, header: Header) -> None:
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

    def _drop(self, conn: Connection) -> None:
        conn.alive = False
        lost = PeerLostError(f"connection to receiver {conn.name} lost")
        # Stop writing before closing: the receiver frees the blocks of a live sender's
        # transfers when it sees the connection close (shm: we write its memory).
        for record in self._table.records_bound_to(conn):
            with record.write_lock:
                self._table.finish(record.request_id, TransferState.FAILED, lost)
        conn.fs.close()
        with self._connections_lock:
            if self._connections.get(conn.name) is conn:
                del self._connections[conn.name]
        for pending in list(conn.pending.values()):
            _resolve(pending, lost)
        self._writing.disconnected(conn)


def _resolve(pending: Future[None] | None, error: KVTransferError | None) -> None:
    if pending is None:
        return
    with contextlib.suppress(InvalidStateError):
        if error is None:
            pending.set_result(None)
        else:
            pending.set_exception(error)
