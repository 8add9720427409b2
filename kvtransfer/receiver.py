"""The decode side: a `Receiver` owns the destination cache and takes transfers into it.

It holds the `TransferTable` and one `Landing`, the backend's data path (shm, tcp, nccl).
Threads: one accepts connections (at most `max_connections`; it closes those with no
transfer bound and no frame for `idle_timeout_s`); one per connection reads frames in
order (the handshake within `handshake_timeout_s`):

    accept ──▶ CHALLENGE(nonce)
    HELLO ──secret's proof (`auth`), then version, layout──▶ WELCOME (or REFUSE + close)
    BEGIN(rid, epoch) ──epoch, ticket open?──▶ ACCEPT (rid now bound to this connection) | REJECT
    LAYER(rid, l) ──`Landing.land`──▶ layer l marked
    FINISH(rid, L) ──all L layers? `Landing.fence`──▶ DONE + RESULT   (else FAILED)
    ABORT(rid) from the sender ──▶ ABORTED/EXPIRED/FAILED, blocks released at once
    ABORT_ACK(rid) ──▶ fence lifted, blocks released

Ending a transfer here (abort, expiry, bad checksum) sends ABORT to its sender, and the
blocks of a transfer bound to a connection stay *fenced* until the sender's ABORT_ACK is
read: the sender stopped writing (shm), and, frames being read in order, any layer this
process was landing (tcp, nccl) is complete. A dead connection lifts the fence too. After
`fence_timeout_s` without either: where this process lands the bytes (tcp, nccl) the
connection is cut and the blocks go once the layer being landed is complete; where another
process writes them (shm, `Landing.remote_writer`) the blocks stay *quarantined* until its
ABORT_ACK or its death (`Landing.writer_running`). Before any blocks return to the pool,
`Landing.fence` waits for writes still queued (nccl: the unpack stream).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import auth
from kvtransfer.base import (
    AuthenticationError,
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
    UnknownTransferError,
    error_from_wire,
    error_to_wire,
    new_epoch,
)
from kvtransfer.table import Reaper, TransferRecord, TransferTable
from kvtransfer.wire import (
    MAX_CONTROL_BYTES,
    PROTOCOL_VERSION,
    Connection,
    FrameSocket,
    Header,
    Kind,
)

logger = logging.getLogger(__name__)


class Landing(Protocol):
    """A backend's receiving data path, held by one `Receiver` (which calls every method)."""

    backend: str
    kv_cache: KVCache  # the destination cache
    endpoint: str  # the address tickets name
    listener: socket.socket  # the control socket senders connect to
    remote_writer: bool  # another process writes our memory (shm): fences may quarantine

    def welcome(self, conn: Connection) -> dict[str, object]:
        """During the handshake: backend facts for the sender's WELCOME."""

    def connected(self, conn: Connection) -> None:
        """After WELCOME was sent, on the connection's thread (nccl: join the communicator)."""

    def payload_bytes(self, num_blocks: int) -> int:
        """The exact payload size of a LAYER frame for a transfer of `num_blocks` blocks."""

    def land(self, conn: Connection, record: TransferRecord, header: Header) -> None:
        """Consume a LAYER frame's payload (size already checked) and land the layer in the
        record's blocks under its write_lock; raise KVTransferError to fail the transfer."""

    def skip(self, conn: Connection, header: Header, record: TransferRecord | None) -> None:
        """Consume a LAYER frame of a transfer that ended or is not bound here (`record`:
        the request's record, if any)."""

    def fence(self) -> None:
        """Wait until no write queued by `land` is still in flight (before DONE, and before
        blocks return to the pool)."""

    def writer_running(self, conn: Connection) -> bool:
        """Whether the process writing through `conn` may still write (shm: the sender)."""

    def disconnected(self, conn: Connection) -> None:
        """The connection is gone: free its state (nccl: abort its communicator)."""

    def close(self) -> None:
        """At receiver close, after every connection ended: free the cache's resources."""


class Receiver:
    """Decode side of every backend; thread-safe.

    `release(request_id)` is called exactly once per ticket that ends in FAILED, ABORTED or
    EXPIRED (possibly from an internal thread; it must not block long). DONE blocks stay
    with the decode request.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        landing: Landing,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions = TransferOptions(),
        epoch: int | None = None,
    ) -> None:
        """Called by `create_receiver` once per decode replica; starts the threads."""
        if landing.kv_cache.spec != spec:
            raise ValueError(f"kv_cache spec {landing.kv_cache.spec} != receiver spec {spec}")
        self.backend = landing.backend
        self.spec = spec
        self.layout = KVLayout.from_spec(spec, model_id)
        self.options = options
        self.epoch = new_epoch() if epoch is None else epoch
        self._landing = landing
        self._table = TransferTable(
            release,
            release_on_done=False,
            fence_timeout_s=options.fence_timeout_s,
            tombstone_ttl_s=options.tombstone_ttl_s,
            fence=landing.fence,
        )
        self._closed = False
        self._close_lock = threading.Lock()
        self._connections: set[Connection] = set()
        self._connections_lock = threading.Lock()
        self._refusals: Counter[str] = Counter()  # why peers were cut off (`endpoint_stats`)
        self._next_sweep = 0.0
        self._reaper = Reaper(f"kv-{self.backend}-recv-reaper", options.reap_interval_s, self._reap)
        landing.listener.settimeout(0.2)
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-{self.backend}-accept", daemon=True
        )
        self._accept_thread.start()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def kv_cache(self) -> KVCache:
        """The destination cache (for `shm`, it lives in shared memory the receiver owns)."""
        return self._landing.kv_cache

    @property
    def endpoint(self) -> str:
        """Address senders connect to; copied into every ticket."""
        return self._landing.endpoint

    # -- called by decode -------------------------------------------------------------------

    def open_ticket(self, request_id: str, block_ids: Sequence[int], deadline_s: float) -> Ticket:
        """Called by decode after it reserved `block_ids` for a request.

        The transfer starts PENDING and expires `deadline_s` seconds from now. Frees nothing;
        from now on the blocks are returned through `release` unless the transfer ends DONE.
        """
        if self._closed:
            raise RuntimeError("receiver is closed")
        ids = tuple(int(b) for b in block_ids)
        if not ids:
            raise ValueError("a ticket needs at least one block")
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate destination block ids for {request_id!r}")
        if min(ids) < 0 or max(ids) >= self.spec.num_blocks:
            raise ValueError(f"block ids out of range [0, {self.spec.num_blocks})")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        ticket = Ticket(request_id, self.endpoint, ids, self.layout, self.epoch, deadline_s)
        self._table.add(TransferRecord(request_id, ids, ticket.expires_at))
        return ticket

    def poll(self, request_id: str) -> TransferState:
        """Called by decode when a prefill call returns, and between engine steps for a
        reservation whose lease expired; never blocks, frees nothing."""
        return self._table.require(request_id).state

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        """Block up to `timeout_s` for a terminal state (tests, benchmarks); frees nothing."""
        return self._table.wait(request_id, timeout_s)

    def error(self, request_id: str) -> KVTransferError | None:
        """Why a transfer ended FAILED/ABORTED/EXPIRED (None otherwise)."""
        return self._table.require(request_id).error

    def num_layers_received(self, request_id: str) -> int:
        """How many layers have landed so far (progress in tests and benchmarks)."""
        return self._table.require(request_id).num_layers_done

    def abort(self, request_id: str) -> None:
        """Called by decode on client disconnect, preemption or prefill failure; idempotent.

        Ends the transfer ABORTED (no-op if already terminal) and tells the sender. The
        destination blocks are released once no sender can write them any more.
        """
        self._terminate(
            request_id, TransferState.ABORTED, TransferAbortedError("aborted by decode")
        )

    def transfer_counts(self) -> dict[str, int]:
        """`num_open`, `num_fenced` and `num_quarantined` transfers (replica stats); never
        blocks. Fenced and quarantined transfers ended but still hold their blocks: a
        quarantined writer did not confirm it stopped and may still run (a stopped process)."""
        return self._table.counts()

    def endpoint_stats(self) -> dict[str, int]:
        """Connections open now, and how many peers were cut off, by reason (replica stats)."""
        with self._connections_lock:
            return {"connections": len(self._connections), **self._refusals}

    def serving_problem(self) -> str | None:
        """Called by the replica's health check: why no transfer can be taken now, or None."""
        if self._closed:
            return "receiver closed"
        if not self._reaper.is_alive:
            return "receiver reaper thread died"
        if not self._accept_thread.is_alive():
            return "receiver accept thread died: no sender can connect"
        return None

    def close(self) -> None:
        """Called once at replica shutdown: aborts open transfers (releasing their blocks),
        stops threads, closes sockets and frees shared memory. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for record in self._table.open_records():
            error = TransferAbortedError("receiver closed")
            self._terminate(record.request_id, TransferState.ABORTED, error)
        self._table.wait_unfenced(1.0)  # writers that answer quickly are let finish
        self._reaper.stop()
        with contextlib.suppress(OSError):
            self._landing.listener.close()
        self._accept_thread.join(timeout=5.0)
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            conn.fs.close()
        for conn in connections:
            if conn.thread is not None:
                conn.thread.join(timeout=5.0)
        self._landing.close()
        for record in self._table.fenced_records():
            self._table.unfence(record.request_id)

    # -- ending transfers from this side ---------------------------------------------------

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        """End a transfer here (abort, expiry, failure): tell its sender, fence its blocks."""
        if not self._table.finish(request_id, state, error, fence_if_bound=True):
            return
        record = self._table.get(request_id)
        conn = record.peer if record is not None else None
        if not isinstance(conn, Connection):
            return
        with contextlib.suppress(PeerLostError):
            conn.fs.send_json(Kind.ABORT, request_id, error_to_wire(error), layer=state.code)
        if (not conn.alive or conn.fs.closed) and record is not None and self._writer_gone(record):
            self._table.unfence(request_id, conn)

    def _reap(self) -> None:
        """Reaper thread: expire overdue transfers, time out fences, and release quarantined
        blocks whose writer is proven gone."""
        for request_id in self._table.overdue(time.monotonic()):
            expired = TransferExpiredError("ticket deadline passed")
            self._terminate(request_id, TransferState.EXPIRED, expired)
        self._table.sweep(self._on_fence_timeout)
        for record in self._table.quarantined_records():
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

    # -- connections -----------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        with self._connections_lock:
            self._refusals[reason] += 1

    def _accept_loop(self) -> None:
        while not self._closed:
            self._close_silent_connections()
            try:
                sock, _ = self._landing.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn = Connection(FrameSocket(sock, self.options.io_timeout_s), str(sock.fileno()))
            with self._connections_lock:
                if self._closed:
                    conn.fs.close()
                    return
                if len(self._connections) >= self.options.max_connections:
                    self._refusals["over_connection_limit"] += 1
                    conn.fs.close()
                    continue
                self._connections.add(conn)
            conn.thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"kv-{self.backend}-recv", daemon=True
            )
            conn.thread.start()

    def _close_silent_connections(self) -> None:
        """Accept thread: cut connections idle with no transfer bound to them (their reader
        threads then drop them). Handshakes time out on their own reads."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(0.5, self.options.idle_timeout_s / 4)
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            if now - conn.last_used <= self.options.idle_timeout_s or conn.fs.closed:
                continue
            if not self._table.records_bound_to(conn):
                self._count("idle_timeout")
                conn.fs.close()

    def _serve(self, conn: Connection) -> None:
        try:
            if self._handshake(conn):
                while (header := conn.fs.recv_header()) is not None:
                    conn.last_used = time.monotonic()
                    self._dispatch(conn, header)
                conn.state["peer_closed"] = not conn.fs.closed  # an EOF we did not cause
        except ProtocolError as exc:
            self._count("protocol_error")
            logger.warning("closing sender connection %s: %s", conn.name, exc)
            for record in self._table.records_bound_to(conn):
                self._terminate(record.request_id, TransferState.FAILED, exc)
        except PeerTimeoutError as exc:
            self._count("handshake_timeout")
            logger.debug("sender connection %s: %s", conn.name, exc)
        except PeerLostError as exc:
            logger.debug("sender connection %s lost: %s", conn.name, exc)
        except Exception:
            logger.exception("sender connection %s failed", conn.name)
        finally:
            self._drop(conn)

    def _refuse(self, conn: Connection, reason: str, error: KVTransferError) -> bool:
        self._count(reason)
        conn.fs.send_json(Kind.REFUSE, "", error_to_wire(error))
        return False

    def _handshake(self, conn: Connection) -> bool:
        """CHALLENGE, then HELLO: authenticate, then check version and layout; WELCOME."""
        secret = self.options.secret
        nonce = auth.new_nonce()
        conn.fs.limit_reads(self.options.handshake_timeout_s)
        challenge = {"version": PROTOCOL_VERSION, "nonce": nonce, "auth": secret is not None}
        conn.fs.send_json(Kind.CHALLENGE, "", challenge)
        header = conn.fs.recv_header()
        if header is None:
            return False
        if header.kind is not Kind.HELLO:
            raise ProtocolError(f"expected HELLO, got {header.kind.name}")
        hello = conn.fs.recv_json(header)
        conn.fs.limit_reads(None)
        peer_nonce = hello.get("nonce")
        if not isinstance(peer_nonce, str):
            raise ProtocolError("HELLO without a nonce")
        if secret is not None and not auth.verify(
            auth.hello_mac(secret, nonce, peer_nonce, hello), hello
        ):
            logger.warning("refusing a sender on connection %s: %s", conn.name, auth.AUTH_FAILED)
            return self._refuse(conn, "auth_failed", AuthenticationError(auth.AUTH_FAILED))
        # Authenticated from here on (or no secret configured): refusals may say why.
        if hello.get("version") != PROTOCOL_VERSION:
            error = KVTransferError(
                f"protocol version {hello.get('version')} != {PROTOCOL_VERSION}"
            )
            return self._refuse(conn, "refused", error)
        diffs = self.layout.differences(_layout(hello.get("layout")))
        if diffs:
            logger.warning(
                "refusing a sender: %s", KVLayoutMismatchError(diffs, "receiver", "sender")
            )
            # the field names and the sender's own values; ours are not the peer's business
            withheld: dict[str, tuple[object, object]] = {
                k: ("(not disclosed)", theirs) for k, (_, theirs) in diffs.items()
            }
            return self._refuse(
                conn, "refused", KVLayoutMismatchError(withheld, "receiver", "sender")
            )
        welcome: dict[str, object] = {
            "layout": self.layout.to_dict(),
            "epoch": self.epoch,
            "num_blocks": self.spec.num_blocks,
            **self._landing.welcome(conn),
        }
        if secret is not None:
            welcome["mac"] = auth.welcome_mac(secret, nonce, peer_nonce, welcome)
        conn.fs.send_json(Kind.WELCOME, "", welcome)
        conn.last_used = time.monotonic()
        self._landing.connected(conn)
        return True

    def _drop(self, conn: Connection) -> None:
        """The connection's thread ends: fail its transfers, lift fences where the writer
        stopped, forget it."""
        conn.alive = False
        conn.fs.close()
        with self._connections_lock:
            self._connections.discard(conn)
        peer_closed = conn.state.get("peer_closed") is True
        for record in self._table.records_bound_to(conn):
            lost = PeerLostError(f"sender connection lost after {record.num_layers_done} layers")
            self._table.finish(record.request_id, TransferState.FAILED, lost)
            # shm: the sender closes only after finishing its transfers (under their
            # write_lock), so its EOF is its word, unless the fence already timed out; a
            # connection we closed proves nothing while its process runs. Otherwise the
            # writer was this connection's reader thread, which just stopped.
            if (
                not self._landing.remote_writer
                or (peer_closed and not record.quarantined)
                or self._writer_gone(record)
            ):
                self._table.unfence(record.request_id, conn)
        self._landing.disconnected(conn)

    # -- frames ----------------------------------------------------------------------------

    def _dispatch(self, conn: Connection, header: Header) -> None:
        kind, rid = header.kind, header.request_id
        if kind is not Kind.LAYER and header.nbytes > MAX_CONTROL_BYTES:
            raise ProtocolError(f"{kind.name} frame with a payload of {header.nbytes} bytes")
        if kind is Kind.BEGIN:
            self._on_begin(conn, header)
        elif kind is Kind.LAYER:
            self._on_layer(conn, header)
        elif kind is Kind.FINISH:
            self._on_finish(conn, header)
        elif kind is Kind.ABORT:
            body = conn.fs.recv_json(header)
            record = self._table.get(rid)
            unbound = record is not None and record.peer is None and header.epoch == self.epoch
            if record is not None and (record.peer is conn or unbound):
                state = TransferState.from_code(header.layer)
                self._table.finish(rid, state, error_from_wire(body, "sender"))
                self._table.unfence(rid, conn)  # the sender stopped before telling us
        elif kind is Kind.ABORT_ACK:
            conn.fs.discard(header.nbytes)
            self._table.unfence(rid, conn)
        else:
            logger.warning("unexpected %s frame from sender; ignored", kind.name)
            conn.fs.discard(header.nbytes)

    def _on_begin(self, conn: Connection, header: Header) -> None:
        rid = header.request_id
        conn.fs.discard(header.nbytes)
        record = self._table.get(rid)
        error: KVTransferError | None = None
        state = TransferState.FAILED
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

    def _on_layer(self, conn: Connection, header: Header) -> None:
        record = self._table.get(header.request_id)
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
            self._landing.skip(conn, header, record)
            return
        try:
            self._landing.land(conn, record, header)
        except PeerLostError:
            raise
        except KVTransferError as exc:
            self._terminate(record.request_id, TransferState.FAILED, exc)
            return
        self._table.mark_layer(record, header.layer)

    def _on_finish(self, conn: Connection, header: Header) -> None:
        rid = header.request_id
        conn.fs.discard(header.nbytes)
        record = self._table.get(rid)
        if record is None or record.peer is not conn:
            return
        if not record.state.is_terminal:
            num_layers = self.spec.num_layers
            missing = [i for i in range(num_layers) if not record.layers_mask >> i & 1]
            if header.layer != num_layers or missing:
                error = KVTransferError(f"finished without layers {missing}")
                self._terminate(rid, TransferState.FAILED, error)
                return
            self._landing.fence()  # every queued unpack landed before the blocks are read
            self._table.finish(rid, TransferState.DONE)
        if record.state is TransferState.DONE:
            conn.fs.send(Kind.RESULT, rid, layer=TransferState.DONE.code)


def _layout(obj: object) -> KVLayout:
    """The layout a HELLO claims; a malformed one is a protocol error."""
    if not isinstance(obj, dict):
        raise ProtocolError("malformed handshake")
    try:
        return KVLayout.from_dict(obj)
    except TypeError:
        raise ProtocolError("malformed layout in the handshake") from None
