"""The prefill side: a `Sender` streams each request's layers to its ticket's receiver.

An `Endpoint` holding one `Writing` (the backend's data path). `send_layer`/`finish`
only enqueue; one worker thread drains the queue in order, coalescing the layers of a
ticket already queued into one `Writing.write`. Per receiver one cached connection, kept
open by a PING every `idle_timeout_s / 4` it is unused (a new one costs a handshake and, on
shm, mapping the receiver's cache), replaced all the same if unused for `idle_timeout_s / 2`
(the receiver closes it at `idle_timeout_s`): CHALLENGE -> HELLO -> WELCOME (both proofs
of the secret, `auth`) -> `Writing.welcome`; per ticket BEGIN -> ACCEPT | REJECT before
any write, LAYER frames, FINISH -> RESULT (DONE). `connect(ticket)` does the handshake and
BEGIN early, on the caller's thread. One reader thread per connection handles the
receiver's answers and its ABORT: it stops our writes (under the record's write_lock),
answers ABORT_ACK, and releases.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError

import torch

from engine.kv_cache import KVCacheSpec
from kvtransfer import auth
from kvtransfer.base import (
    BlockIds,
    KVLayout,
    KVLayoutMismatchError,
    KVTransferError,
    PeerLostError,
    PeerTimeoutError,
    ProtocolError,
    ReleaseFn,
    StaleEpochError,
    Ticket,
    TransferAbortedError,
    TransferExpiredError,
    TransferOptions,
    TransferState,
    error_from_wire,
)
from kvtransfer.datapath import ABORT_ITEM, FINISH_ITEM, LayerItem, Writing
from kvtransfer.endpoint import Endpoint
from kvtransfer.rowcopy import as_id_array
from kvtransfer.table import ObserveFn, TransferRecord
from kvtransfer.wire import Connection, FrameSocket, Header, Kind

logger = logging.getLogger(__name__)

# Backends whose sender reaches every rank's KV of its replica (one CPU buffer), so it can
# re-shard into a receiver of another TP size (`kvtransfer.reshard`).
RESHARDING_BACKENDS = ("shm", "tcp")


class RejectedError(KVTransferError):
    """The receiver refused or ended the transfer; `state` is the state it reported."""

    def __init__(self, state: TransferState, error: KVTransferError) -> None:
        super().__init__(str(error))
        self.state, self.cause = state, error


class Sender(Endpoint):
    """Prefill side of every backend. `release(request_id)` runs exactly once for every
    request id given to `connect`, `send_layer`, `finish` or `abort`, when its transfer
    ends (in any state): the source blocks are then unread and may be freed."""

    role = "sender"

    def __init__(
        self,
        spec: KVCacheSpec,
        writing: Writing,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
        observe: ObserveFn | None = None,
    ) -> None:
        """Called by `create_sender` once per prefill replica; starts the worker thread.
        `observe`: told each transfer's end and settling (`table.ObserveFn`)."""
        self.spec, self.layout = spec, KVLayout.from_spec(spec, model_id)
        self._writing, self._records_lock = writing, threading.Lock()
        self._connecting: dict[str, threading.Lock] = {}  # one handshake per endpoint
        self._queue: queue.SimpleQueue[LayerItem | None] = queue.SimpleQueue()
        super().__init__(writing.backend, options, release, release_on_done=True, observe=observe)
        self._worker = self._start("worker", self._work)
        self._pinger = self._every("keepalive", options.idle_timeout_s / 4, self._keep_alive)

    def connect(self, ticket: Ticket, timeout_s: float) -> None:
        """Called by prefill when a ticket arrives, before computing: registers the
        transfer, handshakes and binds it at the receiver now (the first layer then goes
        without a round trip). A refusal (`KVLayoutMismatchError`, `StaleEpochError`,
        `AuthenticationError`, `PeerLostError`) is raised here and ends the transfer."""
        if (record := self._record(ticket)) is None:  # refused (layout) or already ended
            ended = self._table.require(ticket.request_id)
            raise ended.error or KVTransferError(f"transfer is {ended.state.value}")
        try:
            conn = self._connection(ticket.endpoint, min(timeout_s, ticket.seconds_left()))
            self._begin(conn, record, ticket)
        except KVTransferError as exc:
            raise self._fail(ticket, exc) from None

    def warm(self, endpoint: str, timeout_s: float) -> None:
        """Connect to the receiver at `endpoint` now, without a ticket, and wait until the
        connection's data path is set up in full (shm: the receiver's cache populated in our
        page tables), so that no transfer meets a cold one. Called by `PrefillServer.warm`
        for a decode replica (`decode/warm_up.py`) and by `pdserve bench transfer`. Raises
        PeerLostError / PeerTimeoutError / AuthenticationError when it cannot."""
        if self.closed:
            raise PeerLostError("sender is closed")
        deadline = time.monotonic() + timeout_s
        conn = self._connection(endpoint, timeout_s)
        self._writing.settle(conn, max(0.0, deadline - time.monotonic()))

    def send_layer(
        self,
        ticket: Ticket,
        layer: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        src_block_ids: BlockIds,
    ) -> None:
        """Called by the prefill model runner right after layer `layer` is computed, with
        that layer's caches and the request's blocks in the ticket's order. Returns at once
        (the worker moves the layer during the next layer's compute); the blocks must stay
        untouched until `release`. ValueError: a caller bug; transfer problems end it.

        `layer` numbers the receiver's items (`ticket.layout.num_items`) and the caches
        have its geometry: this cache's own items when both TP sizes agree, else the
        items `kvtransfer.reshard` builds (any number of rows, `src_block_ids` into them)."""
        if self.closed:
            raise RuntimeError("sender is closed")
        if self._record(ticket) is None:  # the transfer ended (or its layout is refused)
            return
        dst = ticket.layout
        if not 0 <= layer < dst.num_items:
            raise ValueError(f"layer {layer} out of range [0, {dst.num_items})")
        shape, dtype = dst.cache_spec(ticket.num_blocks).block_shape, self.spec.torch_dtype
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if tuple(t.shape[1:]) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name} is {tuple(t.shape)}/{t.dtype}, not [*, {shape}]/{dtype}")
        if len(src_block_ids) != ticket.num_blocks:
            raise ValueError(f"{len(src_block_ids)} source blocks, ticket {ticket.num_blocks}")
        ids = as_id_array(src_block_ids)
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < len(k_cache):
            raise ValueError(f"source blocks outside the caches' {len(k_cache)} rows")
        ready = self._writing.ready(k_cache)
        self._queue.put(LayerItem(ticket, layer, k_cache, v_cache, ids, ready))

    def finish(self, ticket: Ticket) -> None:
        """Called by prefill after the last `send_layer`; non-blocking. The transfer turns
        DONE when the receiver confirms every layer; `release` follows."""
        if self.closed:
            raise RuntimeError("sender is closed")
        if self._record(ticket) is not None:
            self._queue.put(LayerItem(ticket, FINISH_ITEM))

    def abort(self, request_id: str) -> None:
        """Called by prefill on cancellation or error; idempotent, safe at any moment.
        Stops writing, tells the receiver (which releases its blocks), releases ours."""
        error = TransferAbortedError("aborted by prefill")
        self._terminate(request_id, TransferState.ABORTED, error)

    def serving_problem(self) -> str | None:
        """Called by the replica's health check: why no layer can be sent now, or None."""
        return self._problem(worker=self._worker, keepalive=self._pinger)

    def close(self) -> None:
        """Called once at replica shutdown: aborts open transfers (releasing their source
        blocks), stops the threads and closes connections. Idempotent."""
        if self._begin_close():
            self._queue.put(None)
            self._end_close(self._worker, self._pinger)

    def _record(self, ticket: Ticket) -> TransferRecord | None:
        """The live record serving `ticket`, created on first use; None once it is terminal."""
        with self._records_lock:
            record = self._table.get(ticket.request_id)
            if record is not None and record.ticket in (None, ticket):
                return None if record.state.is_terminal else record
            if record is not None and not record.state.is_terminal:
                raise ValueError(f"{ticket.request_id!r} has an open transfer, another ticket")
            record = TransferRecord(ticket.request_id, ticket.block_ids, ticket.expires_at, ticket)
            self._table.add(record)
        if diffs := self.layout.differences(ticket.layout) | self._unbridged(ticket.layout):
            failure = KVLayoutMismatchError(diffs, "sender", "ticket")
            self._table.finish(ticket.request_id, TransferState.FAILED, failure)
            return None
        return record

    def _unbridged(self, other: KVLayout) -> dict[str, tuple[object, object]]:
        """`other`'s TP size as a difference when this sender cannot re-shard into it: on a
        backend whose ranks' shards it cannot reach (per-rank endpoints: not built), or a
        size that is no split of the model's KV heads."""
        ours, theirs = self.layout.tensor_parallel_size, other.tensor_parallel_size
        if ours == theirs or (
            self.backend in RESHARDING_BACKENDS and 1 <= theirs <= other.num_kv_heads
        ):
            return {}
        return {"tensor_parallel_size": (ours, theirs)}

    def _fail(self, ticket: Ticket, exc: KVTransferError) -> KVTransferError:
        """Sending `ticket` failed with `exc`: end the transfer; the error to report."""
        state = TransferState.FAILED
        if isinstance(exc, RejectedError):
            state, exc = exc.state, exc.cause
        elif ticket.seconds_left() <= 0:
            state, exc = TransferState.EXPIRED, TransferExpiredError(str(exc))
        self._terminate(ticket.request_id, state, exc)
        return exc

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        """End a transfer from this side: stop writing, tell the receiver, release."""
        with self._records_lock:
            if (record := self._table.get(request_id)) is None:  # never seen: a tombstone
                self._table.add(TransferRecord(request_id, (), math.inf))
                self._table.finish(request_id, state, error)
                return
        with record.write_lock:  # wait for an in-flight layer copy into remote blocks
            if not self._table.finish(request_id, state, error):
                return
        conn = record.peer
        if conn is None and state is TransferState.ABORTED and record.ticket is not None:
            self._queue.put(LayerItem(record.ticket, ABORT_ITEM))  # tell an unbound receiver
        elif isinstance(conn, Connection):
            _resolve(conn.pending.get(request_id), RejectedError(state, error))
            if conn.alive:  # with the epoch: an ABORT that overtakes our BEGIN still counts
                epoch = 0 if record.ticket is None else record.ticket.epoch
                conn.send_abort(request_id, state, error, epoch)

    def _work(self) -> None:
        backlog: deque[LayerItem | None] = deque()
        while (item := backlog.popleft() if backlog else self._queue.get()) is not None:
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
            try:
                self._send(batch)
            except KVTransferError as exc:
                self._fail(item.ticket, exc)
            except Exception as exc:
                logger.exception("sending %r failed", item.ticket.request_id)
                self._fail(item.ticket, KVTransferError(repr(exc)))

    def _send(self, batch: list[LayerItem]) -> None:
        item, ticket = batch[0], batch[0].ticket
        timeout_s = min(self.options.connect_timeout_s, ticket.seconds_left())
        if item.layer == ABORT_ITEM:  # aborted before BEGIN: tell the receiver, best effort
            if timeout_s > 0:  # else the receiver expires it on its own
                error = TransferAbortedError("aborted by prefill before sending")
                with contextlib.suppress(KVTransferError):
                    conn = self._connection(ticket.endpoint, timeout_s)
                    conn.send_abort(ticket.request_id, TransferState.ABORTED, error, ticket.epoch)
            return
        record = self._table.get(ticket.request_id)
        if record is None or record.ticket != ticket or record.state.is_terminal:
            return
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
            num_layers = ticket.layout.num_items
            conn.fs.send(Kind.FINISH, ticket.request_id, epoch=ticket.epoch, layer=num_layers)

    def _begin(self, conn: Connection, record: TransferRecord, ticket: Ticket) -> None:
        """Bind the transfer to `conn` (BEGIN) once; every caller waits for the ACCEPT."""
        send_begin = False
        with self._records_lock:
            accepted = record.cache.get("accepted")
            if not isinstance(accepted, Future):
                if ticket.epoch != conn.epoch:
                    raise StaleEpochError(
                        f"ticket epoch {ticket.epoch} but the receiver "
                        f"restarted (epoch {conn.epoch}); ticket refused"
                    )
                assert conn.layout is not None  # the data path sizes rows from it
                if diffs := ticket.layout.differences(conn.layout, bridged=()):
                    raise KVLayoutMismatchError(diffs, "ticket", "receiver")
                if not self._table.bind(record, conn):
                    return  # ended meanwhile
                accepted = record.cache["accepted"] = conn.pending[ticket.request_id] = Future()
                send_begin = True
        # Outside the records lock: a receiver slow to read stalls only this transfer. An
        # ABORT that overtakes this BEGIN is one the receiver handles (nothing to bind).
        if send_begin:
            conn.fs.send(Kind.BEGIN, ticket.request_id, epoch=ticket.epoch)
        try:
            accepted.result(timeout=max(0.0, min(self.options.io_timeout_s, ticket.seconds_left())))
        except TimeoutError:
            raise PeerLostError("receiver did not answer BEGIN in time") from None
        finally:
            conn.pending.pop(ticket.request_id, None)

    def _connection(self, endpoint: str, timeout_s: float) -> Connection:
        """The live connection to `endpoint`, or a new one. The handshake runs under that
        endpoint's own lock, not the endpoint-wide one: a slow receiver delays only the
        transfers bound for it."""
        with self._lock:
            conn = self._reusable(endpoint)
            connecting = self._connecting.setdefault(endpoint, threading.Lock())
        if conn is not None:
            return conn
        if not connecting.acquire(timeout=max(0.0, timeout_s)):
            raise PeerTimeoutError(f"another handshake with {endpoint} did not finish in time")
        try:
            with self._lock:
                conn = self._reusable(endpoint)
            if conn is not None:  # someone else connected while we waited
                return conn
            conn = self._handshake(endpoint, timeout_s)
            with self._lock:
                self.connections.add(conn)
        finally:
            connecting.release()
        conn.thread = self._start("read", self._run_connection, conn, self._read_frames, self._drop)
        return conn

    def _keep_alive(self) -> None:
        """Keepalive thread: a PING on every connection unused for `idle_timeout_s / 4`, so
        the receiver keeps it open for the next transfer. A peer that cannot take 32 bytes
        in `io_timeout_s` is lost: the failed send makes its reader thread drop it."""
        now = time.monotonic()
        with self._lock:
            idle = [
                conn
                for conn in self.connections
                if conn.alive and now - conn.last_used >= self.options.idle_timeout_s / 4
            ]
        for conn in idle:
            try:
                conn.fs.send(Kind.PING)
            except KVTransferError:  # the send stopped the connection: its reader drops it
                conn.alive = False
                continue
            conn.last_used = time.monotonic()

    def _reusable(self, endpoint: str) -> Connection | None:
        """A live, recently used connection to `endpoint` (caller holds `_lock`); stale
        idle ones are closed on the way."""
        now = time.monotonic()
        for conn in self.connections:
            if conn.name != endpoint or not conn.alive:
                continue
            # The receiver closes connections idle for `idle_timeout_s`; replace ours at
            # half that, so a BEGIN never races its close.
            stale = now - conn.last_used > self.options.idle_timeout_s / 2
            if not stale or self._table.bound_to(conn):
                conn.last_used = now
                return conn
            conn.alive = False
            conn.fs.close()  # its reader thread drops it
        return None

    def _handshake(self, endpoint: str, timeout_s: float) -> Connection:
        try:
            sock = self._writing.open(endpoint, timeout_s)
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {endpoint}: {exc}") from exc
        conn = Connection(FrameSocket(sock, self.options.io_timeout_s), endpoint)
        try:
            conn.fs.limit_reads(timeout_s)
            secret = self.options.secret
            conn.welcome = auth.sender_handshake(conn.fs, endpoint, self.layout, secret)
            conn.fs.limit_reads(None)
            try:
                layout = conn.layout = KVLayout.from_dict(conn.welcome["layout"])
                conn.epoch = int(str(conn.welcome["epoch"]))
                conn.num_blocks = int(str(conn.welcome["num_blocks"]))
            except (TypeError, KeyError, ValueError):
                raise ProtocolError(f"malformed WELCOME from {endpoint}") from None
            if diffs := self.layout.differences(layout) | self._unbridged(layout):
                raise KVLayoutMismatchError(diffs, "sender", "receiver")
            self._writing.welcome(conn)
            return conn
        except BaseException:
            conn.fs.close()
            with contextlib.suppress(Exception):  # the first error is the one to report
                self._writing.disconnected(conn)  # what `welcome` set up (nccl: the comm)
            raise

    def _dispatch(self, conn: Connection, header: Header) -> None:
        rid, kind = header.request_id, header.kind
        body = conn.fs.recv_json(header) if header.nbytes else {}
        if kind is Kind.ACCEPT:
            return _resolve(conn.pending.get(rid), None)
        if kind not in (Kind.REJECT, Kind.ABORT, Kind.RESULT):
            return logger.warning("unexpected %s frame from receiver; ignored", kind.name)
        state = TransferState.from_code(header.layer)
        error = error_from_wire(body, "receiver") if body or kind is not Kind.RESULT else None
        if error is not None and kind is not Kind.RESULT:
            _resolve(conn.pending.get(rid), RejectedError(state, error))
        record = self._table.get(rid)
        if kind is not Kind.REJECT and record is not None and record.peer is conn:
            with record.write_lock:  # our current copy into its blocks completes first
                self._table.finish(rid, state, error)
        if kind is Kind.ABORT:
            conn.fs.send(Kind.ABORT_ACK, rid)

    def _read_frames(self, conn: Connection) -> None:
        self._read(conn, self._dispatch)

    def _drop(self, conn: Connection) -> None:
        """Before `Endpoint._run_connection` closes it: stop writing, as the receiver frees a live
        sender's blocks when it sees the connection close (shm: we write its memory)."""
        lost = PeerLostError(f"connection to receiver {conn.name} lost")
        for record in self._table.bound_to(conn):
            with record.write_lock:
                self._table.finish(record.request_id, TransferState.FAILED, lost)
        for pending in list(conn.pending.values()):
            _resolve(pending, lost)
        self._writing.disconnected(conn)


def _resolve(pending: Future[None] | None, error: KVTransferError | None) -> None:
    with contextlib.suppress(InvalidStateError):
        if pending is not None and error is None:
            pending.set_result(None)
        elif pending is not None:
            pending.set_exception(error)
