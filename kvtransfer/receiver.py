"""The decode side: a `Receiver` owns the destination cache and takes transfers into it
through one `Landing` (the backend's data path). One thread accepts connections (at most
`max_connections`; idle ones with no transfer bound are closed); one per connection reads
its frames in order:

    accept ──▶ CHALLENGE; HELLO ──proof of the secret (`auth`), version, layout──▶ WELCOME
    BEGIN(rid, epoch) ──epoch, ticket open?──▶ ACCEPT (rid bound to this connection) | REJECT
    LAYER(rid, l) ──`Landing.land`──▶ layer l marked
    FINISH(rid, L) ──all L layers, `Landing.fence`──▶ DONE + RESULT   (else FAILED)
    ABORT(rid) ──▶ ended, blocks released;  ABORT_ACK(rid) ──▶ fence lifted, released

A transfer ended here (abort, expiry, bad checksum) is sent ABORT, and its blocks stay
*fenced* until the sender's ABORT_ACK is read (frames come in order: a layer being landed
is then complete) or the connection dies. Past `fence_timeout_s` without either, a
connection whose bytes this process lands (tcp, nccl) is cut and the blocks go once the
layer in flight is done; blocks another process writes (`Landing.remote_writer`: shm,
cuda_ipc) stay *quarantined* until its ABORT_ACK or its death (`Landing.writer_running`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Sequence

from engine.kv_cache import KVCache, KVCacheSpec
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
    TransferOptions,
    TransferState,
    UnknownTransferError,
    error_from_wire,
    error_to_wire,
    new_epoch,
)
from kvtransfer.datapath import Landing
from kvtransfer.endpoint import Endpoint
from kvtransfer.table import ObserveFn, TransferRecord
from kvtransfer.wire import MAX_CONTROL_BYTES, Connection, FrameSocket, Header, Kind

logger = logging.getLogger(__name__)


class Receiver(Endpoint):
    """Decode side of every backend. `release(request_id)` runs exactly once per ticket
    that ends FAILED, ABORTED or EXPIRED (maybe on an internal thread: it must not block
    long); DONE blocks stay with the decode request."""

    role = "receiver"

    def __init__(
        self,
        spec: KVCacheSpec,
        landing: Landing,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
        observe: ObserveFn | None = None,
    ) -> None:
        """Called by `create_receiver` once per decode replica; starts the threads.
        `observe`: told each transfer's end and settling (`table.ObserveFn`)."""
        if landing.kv_cache.spec != spec:
            raise ValueError(f"kv_cache spec {landing.kv_cache.spec} != receiver spec {spec}")
        self.spec, self.epoch = spec, new_epoch()
        self.layout, self._landing = KVLayout.from_spec(spec, model_id), landing
        self.kv_cache: KVCache = landing.kv_cache  # the destination (shm: shared memory)
        self.endpoint: str = landing.endpoint  # the address senders connect to, in tickets
        self._next_idle_check = 0.0
        super().__init__(
            landing.backend,
            options,
            release,
            release_on_done=False,
            fence=landing.fence,
            observe=observe,
        )
        landing.listener.settimeout(0.2)
        self._accept_thread = self._start("accept", self._accept_loop)

    def open_ticket(
        self,
        request_id: str,
        block_ids: Sequence[int],
        deadline_s: float,
        num_cached_blocks: int = 0,
    ) -> Ticket:
        """Called by decode after it reserved `block_ids` for a request: the destinations
        of the prompt's blocks after its first `num_cached_blocks`, whose KV decode holds
        already (`Ticket`). The transfer starts PENDING and expires `deadline_s` seconds
        from now. Frees nothing; from now on the blocks come back through `release` unless
        the transfer ends DONE."""
        if self.closed:
            raise RuntimeError("receiver is closed")
        ids, n = tuple(int(b) for b in block_ids), self.spec.num_blocks
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= n:
            raise ValueError(f"block ids must be distinct, in [0, {n}), not none")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        ticket = Ticket(
            request_id, self.endpoint, ids, self.layout, self.epoch, deadline_s, num_cached_blocks
        )
        self._table.add(TransferRecord(request_id, ids, ticket.expires_at))
        return ticket

    def abort(self, request_id: str) -> None:
        """Called by decode on client disconnect, preemption or prefill failure; idempotent.
        Ends the transfer ABORTED and tells the sender; the destination blocks are released
        once no sender can write them any more."""
        error = TransferAbortedError("aborted by decode")
        self._terminate(request_id, TransferState.ABORTED, error)

    def transfer_counts(self) -> dict[str, int]:
        """`num_open`, `num_fenced` and `num_quarantined` transfers (replica stats): fenced
        ones ended but still hold their blocks; a quarantined writer may still run."""
        return self._table.counts()

    def endpoint_stats(self) -> dict[str, int]:
        """Connections open now, and how many peers were cut off, by reason (replica stats)."""
        with self._lock:
            return {"connections": len(self.connections), **self.refusals}

    def serving_problem(self) -> str | None:
        """Called by the replica's health check: why no transfer can be taken now, or None."""
        return self._problem(accept=self._accept_thread)

    def close(self) -> None:
        """Called once at replica shutdown: aborts open transfers (releasing their blocks),
        stops threads, closes sockets and frees shared memory. Idempotent."""
        if not self._begin_close():
            return
        self._table.wait_unfenced(1.0)  # writers that answer quickly are let finish
        with contextlib.suppress(OSError):
            self._landing.listener.close()
        self._end_close(self._accept_thread)
        self._landing.close()
        for record in self._table.records(lambda r: r.fenced):
            self._table.unfence(record.request_id)

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        """End a transfer here (abort, expiry, failure): tell its sender, fence its blocks."""
        if not self._table.finish(request_id, state, error, fence_if_bound=True):
            return
        record = self._table.get(request_id)
        if record is not None and isinstance(conn := record.peer, Connection):
            conn.send_abort(request_id, state, error)
            if self._writer_gone(record):  # the connection died already
                self._table.unfence(request_id, conn)

    def _housekeeping(self) -> None:
        """Reaper: time out fences, release quarantined blocks whose writer is gone."""
        self._table.sweep(self._on_fence_timeout)
        for record in self._table.records(lambda r: r.quarantined):
            if self._writer_gone(record):
                self._table.unfence(record.request_id)

    def _on_fence_timeout(self, record: TransferRecord) -> bool:
        """A writer did not confirm it stopped in time: True releases the blocks now."""
        if self._landing.remote_writer:
            # Closing the connection would not stop a stopped sender's copy: keep it open
            # for a late ABORT_ACK, release only once the sender is gone.
            return self._writer_gone(record)
        if isinstance(record.peer, Connection):
            record.peer.fs.close()  # our reader thread stops landing; _drop cleans up
        return True  # the release waits for the layer being landed (write_lock, fence)

    def _writer_gone(self, record: TransferRecord) -> bool:
        """Whether `record`'s connection is closed and nothing can write through it."""
        conn = record.peer
        if not isinstance(conn, Connection):
            return True
        if conn.alive and not conn.fs.closed:
            return False
        return not self._landing.writer_running(conn)

    def _accept_loop(self) -> None:
        while not self.closed:
            self._close_idle_connections()
            try:
                sock, _ = self._landing.listener.accept()
                self._admit(sock)
            except TimeoutError:
                continue
            except Exception as exc:  # e.g. out of file descriptors: this peer only is lost
                if self.closed:
                    return
                self._count("accept_failed")
                logger.warning("accepting a sender connection failed: %s", exc)
                self._stopped.wait(0.1)

    def _admit(self, sock: socket.socket) -> None:
        """Accept thread: take a new connection (within `max_connections`), start its reader."""
        try:
            conn = Connection(FrameSocket(sock, self.options.io_timeout_s), str(sock.fileno()))
        except BaseException:
            sock.close()
            raise
        with self._lock:
            if self.closed or len(self.connections) >= self.options.max_connections:
                self.refusals["over_connection_limit"] += not self.closed
                return conn.fs.close()
            self.connections.add(conn)
        try:
            conn.thread = self._start("recv", self._run_connection, conn, self._receive, self._drop)
        except BaseException:
            with self._lock:
                self.connections.discard(conn)
            conn.fs.close()
            raise

    def _close_idle_connections(self) -> None:
        """Accept thread: cut idle connections without transfers (readers then drop them)."""
        now = time.monotonic()
        if now < self._next_idle_check:
            return
        self._next_idle_check = now + min(0.5, self.options.idle_timeout_s / 4)
        with self._lock:
            connections = list(self.connections)
        for conn in connections:
            idle = now - conn.last_used > self.options.idle_timeout_s
            if idle and not conn.fs.closed and not self._table.bound_to(conn):
                self._count("idle_timeout")
                conn.fs.close()

    def _receive(self, conn: Connection) -> None:
        """A connection's thread: `auth.receiver_handshake`, then its frames in order; a
        refused sender is counted and logged."""
        facts = {"epoch": self.epoch, "num_blocks": self.spec.num_blocks}
        refusal = auth.receiver_handshake(
            conn.fs,
            conn.name,
            self.layout,
            self.options.secret,
            self.options.handshake_timeout_s,
            lambda: facts | self._landing.welcome(conn),
        )
        if refusal is not None:
            logger.warning("refusing the sender on connection %s: %s", conn.name, refusal[1])
            return self._count(refusal[0])
        conn.last_used = time.monotonic()
        self._landing.connected(conn)
        self._read(conn, self._dispatch)

    def _drop(self, conn: Connection) -> None:
        """The connection's thread ends (`_run_connection`): tear its data path down first
        (nccl: abort the communicator, so that no fence waits on a receive a dead sender
        will never match), then fail its transfers, fenced until the writer is known to
        have stopped."""
        conn.fs.close()  # the sender sees EOF before our data path is torn down
        peer_closed = conn.state.get("peer_closed") is True
        try:
            self._landing.disconnected(conn)
        finally:
            for record in self._table.bound_to(conn):
                lost = PeerLostError(
                    f"sender connection lost after {record.num_layers_done} layers"
                )
                self._table.finish(
                    record.request_id, TransferState.FAILED, lost, fence_if_bound=True
                )
                # shm: a sender ends its connection only once no copy into our blocks is in
                # flight (under their write_lock), so its EOF is its word, unless the fence
                # already timed out; a connection we closed proves nothing while its process
                # runs. Otherwise the writer was this connection's reader, which just stopped.
                if (
                    not self._landing.remote_writer
                    or (peer_closed and not record.quarantined)
                    or self._writer_gone(record)
                ):
                    self._table.unfence(record.request_id, conn)

    def _dispatch(self, conn: Connection, header: Header) -> None:
        kind, rid = header.kind, header.request_id
        if kind is not Kind.LAYER and header.nbytes > MAX_CONTROL_BYTES:
            raise ProtocolError(f"{kind.name} frame with a payload of {header.nbytes} bytes")
        record = self._table.get(rid)
        if kind is Kind.LAYER:
            return self._on_layer(conn, header, record)
        body = conn.fs.recv_json(header) if kind is Kind.ABORT else {}
        if kind is not Kind.ABORT:
            conn.fs.discard(header.nbytes)
        if kind is Kind.BEGIN:
            self._on_begin(conn, header, record)
        elif kind is Kind.FINISH and record is not None and record.peer is conn:
            self._on_finish(conn, header, record)
        elif kind is Kind.ABORT and record is not None:
            if record.peer is conn or (record.peer is None and header.epoch == self.epoch):
                state = TransferState.from_code(header.layer)
                self._table.finish(rid, state, error_from_wire(body, "sender"))
                self._table.unfence(rid, conn)  # the sender stopped before telling us
        elif kind is Kind.ABORT_ACK:
            self._table.unfence(rid, conn)
        elif kind not in (Kind.FINISH, Kind.ABORT, Kind.PING):  # a PING only keeps it open
            logger.warning("unexpected %s frame from sender; ignored", kind.name)

    def _on_begin(self, conn: Connection, header: Header, record: TransferRecord | None) -> None:
        rid, state = header.request_id, TransferState.FAILED
        error: KVTransferError | None = None
        if header.epoch != self.epoch:
            error = StaleEpochError(
                f"ticket epoch {header.epoch} was issued by an earlier incarnation of this "
                f"receiver (now epoch {self.epoch}); refusing the transfer of {rid!r}"
            )
        elif record is None:
            error = UnknownTransferError(f"no open ticket for request {rid!r}")
        elif not self._table.bind(record, conn):
            state = record.state if record.state.is_terminal else TransferState.FAILED
            error = record.error or KVTransferError(f"transfer of {rid!r} is {record.state.value}")
        if error is None:
            conn.fs.send(Kind.ACCEPT, rid)
        else:
            conn.fs.send_json(Kind.REJECT, rid, error_to_wire(error), layer=state.code)

    def _on_layer(self, conn: Connection, header: Header, record: TransferRecord | None) -> None:
        # The payload's size follows from the layout and the ticket's block count: checked
        # before a byte is read (an unknown request: at most a whole cache layer).
        num_blocks = self.spec.num_blocks if record is None else len(record.block_ids)
        expected = self._landing.payload_bytes(num_blocks)
        if header.nbytes != expected and (record is not None or header.nbytes > expected):
            raise ProtocolError(
                f"LAYER frame of {header.request_id!r} with {header.nbytes} payload bytes, "
                f"expected {expected}"
            )
        if (
            record is None
            or record.peer is not conn
            or record.state is not TransferState.TRANSFERRING
            or header.epoch != self.epoch
            or not 0 <= header.layer < self.spec.num_layers
        ):
            return self._landing.skip(conn, header, record)
        try:
            self._landing.land(conn, record, header)
        except PeerLostError:
            raise
        except KVTransferError as exc:
            return self._terminate(record.request_id, TransferState.FAILED, exc)
        self._table.mark_layer(record, header.layer)

    def _on_finish(self, conn: Connection, header: Header, record: TransferRecord) -> None:
        if not record.state.is_terminal:
            num_layers = self.spec.num_layers
            missing = [i for i in range(num_layers) if not record.layers_mask >> i & 1]
            if header.layer != num_layers or missing:
                error = KVTransferError(f"finished without layers {missing}")
                return self._terminate(record.request_id, TransferState.FAILED, error)
            if not self._landing.fence(record):  # queued unpacks land before DONE
                raise PeerLostError("the sender went silent before its last layer landed")
            self._table.finish(record.request_id, TransferState.DONE)
        if record.state is TransferState.DONE:
            conn.fs.send(Kind.RESULT, record.request_id, layer=TransferState.DONE.code)
