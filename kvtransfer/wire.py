"""Length-prefixed frames over a stream socket: the control channel (and tcp's data path).

Every frame is a fixed 32-byte little-endian header, the request id (utf-8), then
`nbytes` of payload:

    magic u32 | kind u8 | flags u8 | rid_len u16 | layer u32 | epoch u64 | nbytes u64 | crc u32

`layer` doubles as a state code for ABORT/RESULT frames. Control payloads are small JSON
objects (at most `MAX_CONTROL_BYTES`); LAYER payloads are raw block bytes (tcp) or absent
(shm, nccl: the data moves out of band), and the receiver checks their size against the
ticket before reading a byte. A frame that breaks these rules is a `ProtocolError`.
Frames are written whole under a per-socket lock, so threads may interleave frames but
never bytes; payloads are read with `recv_into` into caller-owned buffers.
"""

from __future__ import annotations

import contextlib
import enum
import json
import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvtransfer.base import PeerLostError, PeerTimeoutError, ProtocolError

MAGIC = 0x564B4450  # b"PDKV" little-endian
PROTOCOL_VERSION = 2
MAX_CONTROL_BYTES = 64 * 1024  # any payload but a LAYER's: JSON objects, request ids
_HEADER = struct.Struct("<IBBHIQQI")
HEADER_SIZE = _HEADER.size
FLAG_CRC = 0x1
_SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
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
    ABORT = 9  # either way, `layer` = terminal state code, JSON error: rid ended
    ABORT_ACK = 10  # sender -> receiver: no more writes to rid's blocks will happen
    RESULT = 11  # receiver -> sender, `layer` = terminal state code: rid's outcome
    CHALLENGE = 12  # receiver -> sender, JSON {version, nonce, auth}: first frame (see auth)


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
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER_BYTES)
        sock.settimeout(io_timeout_s)
        self._io_timeout_s = io_timeout_s
        self._send_lock = threading.Lock()
        self._header = bytearray(HEADER_SIZE)
        self._scratch = bytearray(1 << 16)
        self._closed = False
        self._give_up_at: float | None = None  # monotonic; None: wait as long as it takes

    @property
    def closed(self) -> bool:
        return self._closed

    def limit_reads(self, timeout_s: float | None) -> None:
        """Make reads fail after `timeout_s` from now (handshakes); None lifts the limit."""
        self._give_up_at = None if timeout_s is None else time.monotonic() + timeout_s
        self.sock.settimeout(self._io_timeout_s if timeout_s is None else max(0.01, timeout_s))

    # -- sending ---------------------------------------------------------------------------

    def send(
        self,
        kind: Kind,
        request_id: str = "",
        *,
        epoch: int = 0,
        layer: int = 0,
        crc: int | None = None,
        payload: Sequence[memoryview | bytes] = (),
        nbytes: int | None = None,
    ) -> None:
        """Write one whole frame (header, id, payload buffers); raises PeerLostError."""
        rid = request_id.encode()
        parts = [_flat_bytes(p) for p in payload]
        size = sum(p.nbytes for p in parts) if nbytes is None else nbytes
        flags = 0 if crc is None else FLAG_CRC
        head = _HEADER.pack(MAGIC, kind, flags, len(rid), layer, epoch, size, crc or 0) + rid
        try:
            with self._send_lock:
                if len(parts) == 1 and parts[0].nbytes < 65536:
                    self.sock.sendall(head + parts[0].tobytes())
                elif len(parts) <= 2:
                    self.sock.sendall(head)
                    for part in parts:
                        self.sock.sendall(part)
                else:  # many blocks: gather-write them straight from the cache
                    self._sendmsg_all([memoryview(head), *parts])
        except OSError as exc:
            self.close()
            raise PeerLostError(f"send failed: {exc}") from exc

    def _sendmsg_all(self, views: list[memoryview]) -> None:
        i = 0
        while i < len(views):
            sent = self.sock.sendmsg(views[i : i + IOV_MAX])
            i = _advance(views, i, sent)

    def send_json(self, kind: Kind, request_id: str = "", obj: object = None, **kw: int) -> None:
        body = json.dumps({} if obj is None else obj).encode()
        self.send(kind, request_id, payload=(body,), **kw)  # type: ignore[arg-type]

    # -- receiving -------------------------------------------------------------------------

    def recv_header(self) -> Header | None:
        """Next frame's header and request id; None on a clean close between frames."""
        view = memoryview(self._header)
        if not self._recv_exact(view, allow_eof=True):
            return None
        magic, kind, flags, rid_len, layer, epoch, nbytes, crc = _HEADER.unpack(self._header)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic:#x}: not a pdserve KV peer")
        if kind not in _KINDS:
            raise ProtocolError(f"unknown frame kind {kind}")
        rid = b""
        if rid_len:  # u16: at most 64 KiB
            raw = bytearray(rid_len)
            self._recv_exact(memoryview(raw))
            rid = bytes(raw)
        try:
            request_id = rid.decode()
        except UnicodeDecodeError:
            raise ProtocolError("request id is not utf-8") from None
        return Header(Kind(kind), flags, request_id, layer, epoch, nbytes, crc)

    def recv_into(self, view: memoryview) -> None:
        """Fill `view` completely from the socket (a frame's payload)."""
        self._recv_exact(view)

    def recv_views(self, views: Sequence[memoryview]) -> None:
        """Fill every view in order (a payload scattered straight into cache blocks)."""
        views = list(views)
        i = 0
        while i < len(views):
            try:
                got = self.sock.recvmsg_into(views[i : i + IOV_MAX])[0]
            except TimeoutError:
                if self._closed:
                    raise PeerLostError("connection closed") from None
                continue
            except OSError as exc:
                raise PeerLostError(f"receive failed: {exc}") from exc
            if got == 0:
                raise PeerLostError("peer closed the connection mid-frame")
            i = _advance(views, i, got)

    def recv_json(self, header: Header) -> dict[str, object]:
        """A control frame's JSON object payload; larger than `MAX_CONTROL_BYTES`: refused."""
        if header.nbytes > MAX_CONTROL_BYTES:
            raise ProtocolError(
                f"{header.kind.name} payload of {header.nbytes} bytes exceeds the "
                f"{MAX_CONTROL_BYTES}-byte limit of control frames"
            )
        raw = bytearray(header.nbytes)
        self._recv_exact(memoryview(raw))
        try:
            obj = json.loads(raw) if raw else {}
        except (ValueError, RecursionError):
            raise ProtocolError(f"{header.kind.name} payload is not JSON") from None
        if not isinstance(obj, dict):
            raise ProtocolError("control payload is not a JSON object")
        return obj

    def discard(self, nbytes: int) -> None:
        """Read and drop `nbytes` of payload (a frame for a transfer that already ended)."""
        scratch = memoryview(self._scratch)
        while nbytes > 0:
            k = min(nbytes, len(scratch))
            self._recv_exact(scratch[:k])
            nbytes -= k

    def _recv_exact(self, view: memoryview, allow_eof: bool = False) -> bool:
        got = 0
        total = view.nbytes
        while got < total:
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                if self._closed:
                    raise PeerLostError("connection closed") from None
                n = -1  # idle between frames (or a slow peer): liveness is the deadline's job
            except OSError as exc:
                raise PeerLostError(f"receive failed: {exc}") from exc
            # checked after data too: a peer trickling bytes must not outlast the limit
            if self._give_up_at is not None and time.monotonic() >= self._give_up_at:
                raise PeerTimeoutError("peer did not answer in time")
            if n == 0:
                if got == 0 and allow_eof:
                    return False
                raise PeerLostError("peer closed the connection mid-frame")
            got += max(n, 0)
        return True

    def close(self) -> None:
        """Idempotent; wakes a thread blocked in recv (it then sees EOF)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Connection:
    """One control connection, as either end holds it: the socket, liveness, and the data
    path's per-connection state (the shm mapping, the NCCL communicator and staging)."""

    def __init__(self, fs: FrameSocket, name: str) -> None:
        self.fs = fs
        self.name = name  # the receiver's endpoint (sender side) or the socket's fd
        self.alive = True
        self.last_used = time.monotonic()  # last frame read (receiver) or use (sender)
        self.thread: threading.Thread | None = None  # reads this connection's frames
        self.state: dict[str, object] = {}  # data path's per-connection state
        # Sender side: the receiver's WELCOME, its incarnation and cache size, and BEGINs
        # awaiting an answer.
        self.welcome: dict[str, object] = {}
        self.epoch = 0
        self.num_blocks = 0
        self.pending: dict[str, Future[None]] = {}


_KINDS = frozenset(int(k) for k in Kind)


def _advance(views: list[memoryview], i: int, nbytes: int) -> int:
    """Consume `nbytes` from `views[i:]` (trimming a partly used view); the next index."""
    while nbytes:
        size = views[i].nbytes
        if nbytes >= size:
            nbytes -= size
            i += 1
        else:
            views[i] = views[i][nbytes:]
            nbytes = 0
    while i < len(views) and views[i].nbytes == 0:
        i += 1
    return i


def _flat_bytes(buffer: memoryview | bytes) -> memoryview:
    """A 1-D unsigned-byte view of a C-contiguous buffer (numpy rows, tensors' memory)."""
    view = memoryview(buffer)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")
