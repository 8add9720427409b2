"""Receiver side of the socket-based backends (`shm`, `tcp`, `nccl`).

Threads: one accepts connections (at most `max_connections`; it closes those with no
transfer bound and no frame for `idle_timeout_s`); one per connection reads frames in
order (the handshake within `handshake_timeout_s`):

    accept ──▶ CHALLENGE(nonce)
    HELLO ──secret's proof (`auth`), then version, layout──▶ WELCOME (or REFUSE + close)
    BEGIN(rid, epoch) ──epoch, ticket open?──▶ ACCEPT (rid now bound to this connection) | REJECT
    LAYER(rid, l) ──backend `_receive_layer`──▶ layer l marked
    FINISH(rid, L) ──all L layers?──▶ DONE + RESULT   (else FAILED)
    ABORT(rid) from the sender ──▶ ABORTED/EXPIRED/FAILED, blocks released at once
    ABORT_ACK(rid) ──▶ fence lifted, blocks released

Ending a transfer here (abort, expiry, bad checksum) sends ABORT to its sender, and the
blocks of a transfer bound to a connection stay *fenced* until the sender's ABORT_ACK is
read: the sender stopped writing (shm), and, frames being read in order, any layer this
thread was landing (tcp, nccl) is complete. A dead connection lifts the fence too. After
`fence_timeout_s` without either, the backend decides (`_on_fence_timeout`): where this
process does the landing (tcp, nccl) the connection is cut and the blocks are released
once the layer being landed is complete or skipped; where another process writes (shm),
the blocks stay *quarantined* until its ABORT_ACK or its death (`_writer_gone`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import Counter

import numpy as np
import torch

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
    TransferOptions,
    TransferState,
    UnknownTransferError,
    error_from_wire,
    error_to_wire,
)
from kvtransfer.connections import SenderConnection
from kvtransfer.core import TableReceiver
from kvtransfer.table import TransferRecord
from kvtransfer.wire import MAX_CONTROL_BYTES, PROTOCOL_VERSION, FrameSocket, Header, Kind

logger = logging.getLogger(__name__)


class StreamReceiver(TableReceiver):
    """Control channel and frame dispatch; subclasses implement `_receive_layer`."""

    def __init__(
        self,
        spec: KVCacheSpec,
        kv_cache: KVCache | None,
        *,
        model_id: str,
        release: ReleaseFn,
        options: TransferOptions,
        listener: socket.socket,
        epoch: int | None = None,
    ) -> None:
        """Takes over `listener` (closed here if construction fails) and starts accepting."""
        try:
            super().__init__(
                spec, kv_cache, model_id=model_id, release=release, options=options, epoch=epoch
            )
        except BaseException:
            listener.close()
            raise
        # [layers, 2, blocks, bytes_per_block]: byte rows of the whole cache (CPU backends)
        self._rows: np.ndarray | None = None
        if self.kv_cache.flat.device.type == "cpu":
            self._rows = (
                self.kv_cache.flat.view(torch.uint8)
                .reshape(spec.num_layers, 2, spec.num_blocks, -1)
                .numpy()
            )
        self._listener = listener
        self._listener.settimeout(0.2)
        self._connections: set[SenderConnection] = set()
        self._connections_lock = threading.Lock()
        self._refusals: Counter[str] = Counter()  # why peers were cut off (`endpoint_stats`)
        self._next_sweep = 0.0
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-{self.backend}-accept", daemon=True
        )
        self._accept_thread.start()

    def serving_problem(self) -> str | None:
        problem = super().serving_problem()
        if problem is None and not self._accept_thread.is_alive():
            return "receiver accept thread died: no sender can connect"
        return problem

    # -- backend hooks ---------------------------------------------------------------------

    def _receive_layer(
        self, conn: SenderConnection, record: TransferRecord, header: Header
    ) -> None:
        """Consume one LAYER frame's payload and land it; raise KVTransferError to fail it."""
        raise NotImplementedError

    def _layer_payload_bytes(self, num_blocks: int) -> int:
        """The exact payload size of a LAYER frame for a transfer of `num_blocks` blocks."""
        return 0

    def _welcome_extra(self, conn: SenderConnection) -> dict[str, object]:
        """Backend facts the sender needs (segment name, ...)."""
        return {}

    def _on_connected(self, conn: SenderConnection, hello: dict[str, object]) -> None:
        """After WELCOME, before the first frame (nccl: join the communicator)."""

    def _before_done(self, conn: SenderConnection, record: TransferRecord) -> None:
        """Called on FINISH before DONE (nccl: wait for the side stream)."""

    def _on_disconnected(self, conn: SenderConnection) -> None:
        """Connection gone (nccl: abort its communicator)."""

    # -- connections -----------------------------------------------------------------------

    def endpoint_stats(self) -> dict[str, int]:
        """Connections open now, and how many peers were cut off, by reason."""
        with self._connections_lock:
            return {"connections": len(self._connections), **self._refusals}

    def _count(self, reason: str) -> None:
        with self._connections_lock:
            self._refusals[reason] += 1

    def _accept_loop(self) -> None:
        while not self._closed:
            self._close_silent_connections()
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn = SenderConnection(
                FrameSocket(sock, self.options.io_timeout_s), str(sock.fileno())
            )
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
        """Called by the accept thread: cut connections idle with no transfer bound to them
        (their reader threads then drop them). Handshakes time out on their own reads."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(0.5, self.options.idle_timeout_s / 4)
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            if now - conn.last_frame_at <= self.options.idle_timeout_s or conn.fs.closed:
                continue
            if not self._table.records_bound_to(conn):
                self._count("idle_timeout")
                conn.fs.close()

    def _serve(self, conn: SenderConnection) -> None:
        try:
            if self._handshake(conn):
                while (header := conn.fs.recv_header()) is not None:
                    conn.last_frame_at = time.monotonic()
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

    def _handshake(self, conn: SenderConnection) -> bool:
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
            self._count("auth_failed")
            logger.warning("refusing a sender on connection %s: %s", conn.name, auth.AUTH_FAILED)
            conn.fs.send_json(Kind.REFUSE, "", error_to_wire(AuthenticationError(auth.AUTH_FAILED)))
            return False
        # Authenticated from here on (or no secret configured): refusals may say why.
        if hello.get("version") != PROTOCOL_VERSION:
            error: KVTransferError = KVTransferError(
                f"protocol version {hello.get('version')} != {PROTOCOL_VERSION}"
            )
            self._count("refused")
            conn.fs.send_json(Kind.REFUSE, "", error_to_wire(error))
            return False
        remote = _layout(hello.get("layout"))
        diffs = self.layout.differences(remote)
        if diffs:
            mismatch = KVLayoutMismatchError(diffs, "receiver", "sender")
            logger.warning("refusing a sender: %s", mismatch)
            # the field names and the sender's own values; ours are not the peer's business
            withheld: dict[str, tuple[object, object]] = {
                k: ("(not disclosed)", theirs) for k, (_, theirs) in diffs.items()
            }
            self._count("refused")
            error = KVLayoutMismatchError(withheld, "receiver", "sender")
            conn.fs.send_json(Kind.REFUSE, "", error_to_wire(error))
            return False
        welcome: dict[str, object] = {
            "layout": self.layout.to_dict(),
            "epoch": self.epoch,
            "num_blocks": self.spec.num_blocks,
        }
        welcome.update(self._welcome_extra(conn))
        if secret is not None:
            welcome["mac"] = auth.welcome_mac(secret, nonce, peer_nonce, welcome)
        conn.fs.send_json(Kind.WELCOME, "", welcome)
        conn.authenticated = True
        conn.last_frame_at = time.monotonic()
        self._on_connected(conn, hello)
        return True

    def _drop(self, conn: SenderConnection) -> None:
        conn.alive = False
        conn.fs.close()
        with self._connections_lock:
            self._connections.discard(conn)
        for record in self._table.records_bound_to(conn):
            self._table.finish(
                record.request_id,
                TransferState.FAILED,
                PeerLostError(f"sender connection lost after {record.num_layers_done} layers"),
            )
            if self._writer_stopped(record, conn.state.get("peer_closed") is True):
                self._table.unfence(record.request_id, conn)
        self._on_disconnected(conn)

    def _writer_stopped(self, record: TransferRecord, peer_closed: bool) -> bool:
        """Called when `record`'s connection ended (`peer_closed`: the sender closed it, not
        us): whether no write into its blocks can happen any more. Here the writer is this
        connection's reader thread, which just stopped (tcp; nccl's barrier runs later)."""
        return True

    # -- frames ----------------------------------------------------------------------------

    def _dispatch(self, conn: SenderConnection, header: Header) -> None:
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

    def _on_begin(self, conn: SenderConnection, header: Header) -> None:
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

    def _on_layer(self, conn: SenderConnection, header: Header) -> None:
        record = self._table.get(header.request_id)
        # The payload's size follows from the layout and the ticket's block count: checked
        # before a byte is read (an unknown request: at most a whole cache layer).
        num_blocks = self.spec.num_blocks if record is None else len(record.block_ids)
        expected = self._layer_payload_bytes(num_blocks)
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
            self._skip_layer(conn, header)
            return
        try:
            self._receive_layer(conn, record, header)
        except PeerLostError:
            raise
        except KVTransferError as exc:
            self._terminate(record.request_id, TransferState.FAILED, exc)
            return
        self._table.mark_layer(record, header.layer)

    def _skip_layer(self, conn: SenderConnection, header: Header) -> None:
        """Drop a LAYER frame of a transfer that ended (or never bound here)."""
        conn.fs.discard(header.nbytes)

    def _on_finish(self, conn: SenderConnection, header: Header) -> None:
        rid = header.request_id
        conn.fs.discard(header.nbytes)
        record = self._table.get(rid)
        if record is None or record.peer is not conn:
            return
        if not record.state.is_terminal:
            if header.layer != self.spec.num_layers or not self._all_layers_landed(record):
                self._terminate(rid, TransferState.FAILED, self._missing_layers_error(record))
                return
            self._before_done(conn, record)
            self._table.finish(rid, TransferState.DONE)
        if record.state is TransferState.DONE:
            conn.fs.send(Kind.RESULT, rid, layer=TransferState.DONE.code)

    # -- ending transfers from this side ---------------------------------------------------

    def _terminate(self, request_id: str, state: TransferState, error: KVTransferError) -> None:
        if not self._table.finish(request_id, state, error, fence_if_bound=True):
            return
        record = self._table.get(request_id)
        conn = record.peer if record is not None else None
        if not isinstance(conn, SenderConnection):
            return
        with contextlib.suppress(PeerLostError):
            conn.fs.send_json(Kind.ABORT, request_id, error_to_wire(error), layer=state.code)
        if (not conn.alive or conn.fs.closed) and record is not None and self._writer_gone(record):
            self._table.unfence(request_id, conn)

    def _on_fence_timeout(self, record: TransferRecord) -> bool:
        """Cut the connection: this process's reader thread is the writer (tcp, nccl), and
        the release that follows waits for the layer it is landing (write_lock, barrier)."""
        if isinstance(record.peer, SenderConnection):
            record.peer.fs.close()  # its reader thread stops writing; _drop cleans up
        return True

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        self._accept_thread.join(timeout=5.0)
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            conn.fs.close()
        for conn in connections:
            if conn.thread is not None:
                conn.thread.join(timeout=5.0)


def _layout(obj: object) -> KVLayout:
    """The layout a HELLO claims; a malformed one is a protocol error."""
    if not isinstance(obj, dict):
        raise ProtocolError("malformed handshake")
    try:
        return KVLayout.from_dict(obj)
    except TypeError:
        raise ProtocolError("malformed layout in the handshake") from None
