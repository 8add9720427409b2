"""Length-prefixed frames over a stream socket: the control channel (and tcp's data path).

A frame is a 32-byte little-endian header, the request id (utf-8), then `nbytes` of payload:

    magic u32 | kind u8 | flags u8 | rid_len u16 | layer u32 | epoch u64 | nbytes u64 | crc u32

`layer` is a state code in ABORT/REJECT/RESULT frames. Control payloads are JSON objects of
at most `MAX_CONTROL_BYTES`; LAYER payloads are block bytes (tcp), a byte count (nccl) or
none (shm), their size checked before a byte is read. A frame breaking these rules is a
`ProtocolError`. Frames are written whole under a lock: threads interleave frames, not bytes.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvtransfer.base import (
    KVLayout,
    KVTransferError,
    PeerLostError,
    PeerTimeoutError,
    ProtocolError,
    Ticket,
    TransferState,
    error_to_wire,
)

logger = logging.getLogger(__name__)
MAGIC = 0x564B4450  # b"PDKV" little-endian
PROTOCOL_VERSION = 3  # 3: PING
MAX_CONTROL_BYTES = 64 * 1024  # any payload but a LAYER's: JSON objects, request ids
_HEADER = struct.Struct("<IBBHIQQI")
HEADER_SIZE = _HEADER.size
FLAG_CRC = 0x1
IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux's limit)


class Kind(enum.IntEnum):
    HELLO = 1  # sender -> receiver, JSON {version, layout, nonce, mac}: answers CHALLENGE
    WELCOME = 2  # receiver -> sender, JSON {layout, epoch, ...backend extras, mac}
    REFUSE = 3  # receiver -> sender, JSON error; the receiver then closes the connection
    BEGIN = 4  # sender -> receiver: start the transfer of rid (ticket epoch in `epoch`)
    ACCEPT = 5  # receiver -> sender: rid bound to this connection, write away
    REJECT = 6  # receiver -> sender, JSON error: rid refused (stale epoch, unknown, ended)
    LAYER = 7  # sender -> receiver: layer `layer` of rid written (payload for tcp)
    FINISH = 8  # sender -> receiver: all `layer` layers sent
    ABORT = 9  # either way, JSON error: rid ended
    ABORT_ACK = 10  # sender -> receiver: no more writes to rid's blocks will happen
    RESULT = 11  # receiver -> sender: rid's outcome
    CHALLENGE = 12  # receiver -> sender, JSON {version, nonce, auth}: first frame (see auth)
    PING = 13  # sender -> receiver: keepalive of an unused connection (no payload)


@dataclass(slots=True)
class Header:
    kind: Kind
    flags: int
    request_id: str
    layer: int
    epoch: int
    nbytes: int
    crc: int

    @property
    def has_crc(self) -> bool:
        return bool(self.flags & FLAG_CRC)


class FrameSocket:
    """A connected stream socket speaking frames. Sends are thread-safe; one thread reads."""

    def __init__(self, sock: socket.socket, io_timeout_s: float) -> None:
        self.sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
        sock.settimeout(io_timeout_s)
        self._io_timeout_s = io_timeout_s
        self._send_lock = threading.Lock()
        self._fd_lock = threading.Lock()  # `send_soon`'s write vs `close`: the fd is not reused
        self._scratch = bytearray(1 << 16)
        self.closed = False
        self._give_up_at: float | None = None  # monotonic; None: wait as long as it takes

    def limit_reads(self, timeout_s: float | None) -> None:
        """Make reads fail after `timeout_s` from now (handshakes); None lifts the limit."""
        self._give_up_at = None if timeout_s is None else time.monotonic() + timeout_s
        self.sock.settimeout(self._io_timeout_s if timeout_s is None else max(0.01, timeout_s))

    def send(
        self,
        kind: Kind,
        request_id: str = "",
        *,
        epoch: int = 0,
        layer: int = 0,
        crc: int | None = None,
        payload: Sequence[memoryview | bytes] = (),
    ) -> None:
        """Write one whole frame (header, id, payload buffers); PeerLostError once the
        connection is stopped or the write fails."""
        views = _frame(kind, request_id, epoch, layer, crc, payload)
        with self._send_lock:
            self._write(views)

    def send_soon(
        self, kind: Kind, request_id: str, obj: object, *, epoch: int, layer: int
    ) -> None:
        """Write a small JSON frame without blocking the caller (prefill aborts on its event
        loop): at once if the socket is free and takes it whole, else from a thread of its
        own that holds the send lock until the frame is out (frames never interleave).
        PeerLostError if the connection is stopped already."""
        frame = b"".join(_frame(kind, request_id, epoch, layer, None, (json.dumps(obj).encode(),)))
        locked, sent = self._send_lock.acquire(blocking=False), 0
        try:
            if locked:
                # The fd is non-blocking (the socket has a timeout): os.write takes what
                # fits now, where socket.send would wait for room.
                with self._fd_lock, contextlib.suppress(BlockingIOError):
                    if self.closed:
                        raise PeerLostError("connection stopped")
                    sent = os.write(self.sock.fileno(), frame)
                if sent == len(frame):
                    return self._send_lock.release()
            rest = memoryview(frame)[sent:]
            threading.Thread(
                target=self._send_later, args=(rest, locked), name="kv-send", daemon=True
            ).start()
        except BaseException as exc:
            if sent or isinstance(exc, OSError):
                self.stop()  # a broken socket, or half a frame out: nothing may follow
            if locked:
                self._send_lock.release()
            if isinstance(exc, OSError | ValueError | RuntimeError):  # closed meanwhile; no thread
                raise PeerLostError(f"send failed: {exc}") from exc
            raise

    def _send_later(self, rest: memoryview, locked: bool) -> None:
        if not locked:
            self._send_lock.acquire()
        try:
            with contextlib.suppress(PeerLostError):
                self._write([rest])
        finally:
            self._send_lock.release()

    def _write(self, views: list[memoryview]) -> None:
        """With the send lock held: write `views` whole, or stop the connection."""
        if self.closed:
            raise PeerLostError("connection stopped")
        try:
            if sum(v.nbytes for v in views) < 65536:
                self.sock.sendall(b"".join(views))
            else:  # gather-write the payload straight from the cache
                i = 0
                while i < len(views):
                    i = _advance(views, i, self.sock.sendmsg(views[i : i + IOV_MAX]))
        except OSError as exc:
            self.stop()
            raise PeerLostError(f"send failed: {exc}") from exc

    def send_json(self, kind: Kind, request_id: str = "", obj: object = None, **kw: int) -> None:
        body = json.dumps({} if obj is None else obj).encode()
        self.send(kind, request_id, payload=(body,), **kw)  # type: ignore[arg-type]

    def recv_header(self) -> Header | None:
        """Next frame's header and request id; None on a clean close between frames."""
        raw = bytearray(HEADER_SIZE)
        if not self.recv_into(memoryview(raw), allow_eof=True):
            return None
        magic, kind, flags, rid_len, layer, epoch, nbytes, crc = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic:#x}: not a pdserve KV peer")
        if kind not in list(Kind):
            raise ProtocolError(f"unknown frame kind {kind}")
        rid = bytearray(rid_len)  # u16: at most 64 KiB
        self.recv_into(memoryview(rid))
        try:
            return Header(Kind(kind), flags, rid.decode(), layer, epoch, nbytes, crc)
        except UnicodeDecodeError:
            raise ProtocolError("request id is not utf-8") from None

    def recv_json(self, header: Header) -> dict[str, object]:
        """A control frame's JSON object payload; larger than `MAX_CONTROL_BYTES`: refused."""
        if header.nbytes > MAX_CONTROL_BYTES:
            raise ProtocolError(
                f"{header.kind.name} payload of {header.nbytes} bytes exceeds the "
                f"{MAX_CONTROL_BYTES}-byte limit of control frames"
            )
        raw = bytearray(header.nbytes)
        self.recv_into(memoryview(raw))
        try:
            obj = json.loads(raw) if raw else {}
        except (ValueError, RecursionError):
            raise ProtocolError(f"{header.kind.name} payload is not JSON") from None
        if not isinstance(obj, dict):
            raise ProtocolError("control payload is not a JSON object")
        return obj

    def discard(self, nbytes: int) -> None:
        """Read and drop `nbytes` of payload (a frame for a transfer that already ended)."""
        while nbytes > 0:
            k = min(nbytes, len(self._scratch))
            self.recv_into(memoryview(self._scratch)[:k])
            nbytes -= k

    def recv_into(self, *buffers: memoryview, allow_eof: bool = False) -> bool:
        """Fill every 1-D byte view in order (a payload scattered straight into cache
        blocks); with `allow_eof`, False on a clean close before the first byte."""
        views = list(buffers)
        i, started = _advance(views, 0, 0), False
        while i < len(views):
            try:
                n = self.sock.recvmsg_into(views[i : i + IOV_MAX])[0]
            except TimeoutError:
                if self.closed:
                    raise PeerLostError("connection closed") from None
                n = -1  # idle between frames (or a slow peer): liveness is the deadline's job
            except OSError as exc:
                raise PeerLostError(f"receive failed: {exc}") from exc
            # checked after data too: a peer trickling bytes must not outlast the limit
            if self._give_up_at is not None and time.monotonic() >= self._give_up_at:
                raise PeerTimeoutError("peer did not answer in time")
            if n == 0:
                if allow_eof and not started:
                    return False
                raise PeerLostError("peer closed the connection mid-frame")
            if n > 0:
                i, started = _advance(views, i, n), True
        return True

    def stop(self) -> None:
        """No more frames (a send failed): wakes our reader to EOF, but the peer sees the
        connection end only at `close`, which the reader's thread calls once what ran on
        this connection is over (a sender's copies into the peer's memory)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RD)

    def close(self) -> None:
        """Idempotent; wakes a thread blocked in recv (it then sees EOF)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with self._fd_lock:
            self.sock.close()


class Connection:
    """One control connection, as either end holds it: the socket, liveness, and the data
    path's per-connection state (the shm mapping, the NCCL communicator and staging)."""

    def __init__(self, fs: FrameSocket, name: str) -> None:
        # `name`: the receiver's endpoint (sender side) or the socket's fd
        self.fs, self.name, self.alive = fs, name, True
        self.last_used = time.monotonic()  # last frame read, or (sender) use or PING
        self.thread: threading.Thread | None = None  # reads this connection's frames
        self.state: dict[str, object] = {}  # data path's per-connection state
        # Sender side: the receiver's WELCOME, its layout, incarnation and cache size, and
        # BEGINs awaiting an answer.
        self.welcome: dict[str, object] = {}
        self.layout: KVLayout | None = None
        self.epoch, self.num_blocks = 0, 0
        self.pending: dict[str, Future[None]] = {}

    def send_layer(
        self,
        ticket: Ticket,
        layer: int,
        crc: int | None,
        payload: Sequence[memoryview | bytes] = (),
    ) -> None:
        """Called by a `Writing`: layer `layer` of `ticket` is written (or is `payload`)."""
        rid, epoch = ticket.request_id, ticket.epoch
        self.fs.send(Kind.LAYER, rid, epoch=epoch, layer=layer, crc=crc, payload=payload)

    def send_abort(
        self, rid: str, state: TransferState, error: KVTransferError, epoch: int = 0
    ) -> None:
        """Tell the peer `rid` ended, without waiting (`FrameSocket.send_soon`: a stalled
        peer or a layer going out must not hold up an abort); best effort: a lost peer
        needs no telling."""
        try:
            self.fs.send_soon(Kind.ABORT, rid, error_to_wire(error), epoch=epoch, layer=state.code)
        except PeerLostError:
            pass
        except Exception:  # an abort path must not raise: the peer learns it from the deadline
            logger.exception("telling the peer %r ended failed", rid)


def _advance(views: list[memoryview], i: int, nbytes: int) -> int:
    """Consume `nbytes` from `views[i:]` (trimming a partly used view); the next index."""
    while nbytes:
        size = views[i].nbytes
        if nbytes < size:
            views[i] = views[i][nbytes:]
            break
        nbytes, i = nbytes - size, i + 1
    while i < len(views) and views[i].nbytes == 0:
        i += 1
    return i


def _frame(
    kind: Kind,
    request_id: str,
    epoch: int,
    layer: int,
    crc: int | None,
    payload: Sequence[memoryview | bytes],
) -> list[memoryview]:
    """A frame as buffers to write in order: header and request id, then the payload."""
    rid, parts = request_id.encode(), [_flat_bytes(p) for p in payload]
    size, flags = sum(p.nbytes for p in parts), 0 if crc is None else FLAG_CRC
    head = _HEADER.pack(MAGIC, kind, flags, len(rid), layer, epoch, size, crc or 0) + rid
    return [memoryview(head), *parts]


def _flat_bytes(buffer: memoryview | bytes) -> memoryview:
    """A 1-D unsigned-byte view of a C-contiguous buffer (numpy rows, tensors' memory)."""
    view = memoryview(buffer)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")
