"""KV endpoints trust no one: hostile peers over real sockets and processes.

A raw peer speaks the wire protocol by hand (or sends bytes that are not the protocol at
all) to a live receiver; real transfers run from the spawned prefill process (`peer`).
After each attack the receiver must still serve a good transfer byte for byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from kvt_peers import (
    FAST,
    Peer,
    Released,
    SendJob,
    assert_landed,
    eventually,
    make_receiver,
    spec,
)

from engine.kv_cache import KVCacheSpec
from kvtransfer import (
    PeerLostError,
    Receiver,
    TransferOptions,
    TransferState,
    auth,
    create_receiver,
    create_sender,
)
from kvtransfer.base import AuthenticationError, KVLayout, ProtocolError, Ticket
from kvtransfer.shm import SHM_DIR, map_segment
from kvtransfer.tcp import parse_endpoint
from kvtransfer.wire import MAGIC, MAX_CONTROL_BYTES, PROTOCOL_VERSION, FrameSocket, Header, Kind

pytestmark = pytest.mark.timeout(90)

SECRET = "0123456789abcdef" * 4
AUTHED = dataclasses.replace(FAST, secret=SECRET)
_HEADER = struct.Struct("<IBBHIQQI")


def receiver_with(
    backend: str, s: KVCacheSpec, released: Released, options: TransferOptions
) -> Receiver:
    receiver = create_receiver(backend, s, model_id="test-model", release=released, options=options)
    assert isinstance(receiver, Receiver)
    return receiver


def connect_raw(endpoint: str) -> socket.socket:
    """A plain socket to a receiver's control endpoint."""
    if endpoint.startswith("shm://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(f"\0{endpoint.removeprefix('shm://')}.ctl")
    else:
        sock = socket.create_connection(parse_endpoint(endpoint))
    sock.settimeout(10.0)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """Read until EOF (True) or 10 s of silence (False), dropping whatever arrives."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


class RawSender:
    """A sender written by hand on top of `FrameSocket`, to misbehave at will."""

    def __init__(self, endpoint: str, layout: KVLayout) -> None:
        self.layout = layout
        self.fs = FrameSocket(connect_raw(endpoint), 10.0)
        self.fs.limit_reads(10.0)
        self.challenge = self.expect(Kind.CHALLENGE)

    def expect(self, kind: Kind) -> dict[str, object]:
        header = self.fs.recv_header()
        assert header is not None and header.kind is kind, header
        return self.fs.recv_json(header)

    def hello(self, secret: str | None) -> tuple[Header, dict[str, object]]:
        """Send HELLO (with a proof made from `secret`); the receiver's answer."""
        nonce_r, nonce_s = str(self.challenge["nonce"]), auth.new_nonce()
        body: dict[str, object] = {
            "version": PROTOCOL_VERSION,
            "layout": self.layout.to_dict(),
            "nonce": nonce_s,
        }
        if secret is not None:
            body["mac"] = auth.hello_mac(secret, nonce_r, nonce_s, body)
        self.fs.send_json(Kind.HELLO, "", body)
        header = self.fs.recv_header()
        assert header is not None
        return header, self.fs.recv_json(header)


def raw_sender(receiver: Receiver) -> RawSender:
    return RawSender(receiver.endpoint, receiver.layout)


def send_bad_layer(endpoint: str, layout: dict[str, object], ticket: dict[str, int]) -> None:
    """Run in a child process: authenticate, BEGIN the ticket, send a LAYER frame of
    `ticket["nbytes"]` payload bytes, then wait to be cut off."""
    raw = RawSender(endpoint, KVLayout.from_dict(layout))
    header, _ = raw.hello(SECRET)
    assert header.kind is Kind.WELCOME
    rid, epoch = "w", ticket["epoch"]
    raw.fs.send(Kind.BEGIN, rid, epoch=epoch)
    header = raw.fs.recv_header()
    assert header is not None and header.kind is Kind.ACCEPT, header
    frame = _HEADER.pack(MAGIC, Kind.LAYER, 0, len(rid), 0, epoch, ticket["nbytes"], 0)
    raw.fs.sock.sendall(frame + rid.encode() + b"\0" * 8)
    assert closed_by_peer(raw.fs.sock)


def good_transfer(peer: Peer, backend: str, receiver: Receiver, rid: str) -> None:
    """The receiver still serves: a real transfer lands byte for byte."""
    s = receiver.spec
    ticket = receiver.open_ticket(rid, (5, 0, 9), 20.0)
    options = receiver.options if isinstance(receiver, Receiver) else FAST
    result = peer.run(SendJob(backend, s, ((ticket, (3, 4, 1)),), options=options))
    assert result["states"] == {rid: "done"}
    assert receiver.wait(rid, 5.0) is TransferState.DONE
    assert_landed(receiver, s, 0, (5, 0, 9), (3, 4, 1))


# -- frame sizes and garbage ------------------------------------------------------------


def test_oversized_hello_is_cut_off_and_the_receiver_keeps_serving(
    peer: Peer, backend: str
) -> None:
    released = Released()
    with receiver_with(backend, spec(2), released, AUTHED) as receiver:
        raw = raw_sender(receiver)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # a HELLO header announcing 8 GiB of JSON: nothing is allocated for it
        raw.fs.sock.sendall(_HEADER.pack(MAGIC, Kind.HELLO, 0, 0, 0, 0, 8 << 30, 0))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            raw.fs.sock.sendall(b"{" * 4096)  # the receiver may have cut us off already
        assert closed_by_peer(raw.fs.sock)
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib
        assert grown_kib < 1 << 20  # the receiver (this process) never touched a GiB more
        assert receiver.endpoint_stats()["protocol_error"] == 1
        good_transfer(peer, backend, receiver, "after-oversized")
    assert released.ids == []


def test_garbage_bytes_are_cut_off_and_the_receiver_keeps_serving(peer: Peer, backend: str) -> None:
    released = Released()
    with receiver_with(backend, spec(2), released, AUTHED) as receiver:
        for junk in (
            b"GET / HTTP/1.1\r\nHost: decode\r\n\r\n",
            np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        ):
            sock = connect_raw(receiver.endpoint)
            sock.sendall(junk)
            assert closed_by_peer(sock)
            sock.close()
        assert receiver.endpoint_stats()["protocol_error"] == 2
        good_transfer(peer, backend, receiver, "after-garbage")


def test_control_frame_over_the_limit_is_cut_off(backend: str) -> None:
    with receiver_with(backend, spec(2), Released(), AUTHED) as receiver:
        raw = raw_sender(receiver)
        header, _ = raw.hello(SECRET)
        assert header.kind is Kind.WELCOME
        raw.fs.sock.sendall(_HEADER.pack(MAGIC, Kind.ABORT, 0, 1, 0, 0, 1 << 20, 0) + b"x")
        assert closed_by_peer(raw.fs.sock)
        assert receiver.endpoint_stats()["protocol_error"] == 1


def test_frame_socket_refuses_oversized_and_malformed_control_frames() -> None:
    a, b = socket.socketpair()
    reader = FrameSocket(b, 5.0)
    a.sendall(_HEADER.pack(MAGIC, Kind.WELCOME, 0, 0, 0, 0, MAX_CONTROL_BYTES + 1, 0))
    header = reader.recv_header()
    assert header is not None
    with pytest.raises(ProtocolError, match="exceeds"):
        reader.recv_json(header)
    for frame in (
        _HEADER.pack(MAGIC, 99, 0, 0, 0, 0, 0, 0),  # no such kind
        _HEADER.pack(MAGIC, Kind.BEGIN, 0, 2, 0, 0, 0, 0) + b"\xff\xfe",  # id not utf-8
    ):
        x, y = socket.socketpair()
        x.sendall(frame)
        with pytest.raises(ProtocolError):
            FrameSocket(y, 5.0).recv_header()
        x.close()
        y.close()
    x, y = socket.socketpair()
    x.sendall(_HEADER.pack(MAGIC, Kind.HELLO, 0, 0, 0, 0, 9, 0) + b"[1, 2, 3]")
    fs = FrameSocket(y, 5.0)
    header = fs.recv_header()
    assert header is not None
    with pytest.raises(ProtocolError, match="not a JSON object"):
        fs.recv_json(header)
    for sock in (a, b, x, y):
        sock.close()


def test_layer_frame_of_the_wrong_size_fails_the_transfer_and_releases(backend: str) -> None:
    released = Released()
    s = spec(3)
    with receiver_with(backend, s, released, AUTHED) as receiver:
        # long enough for a child python (torch import) to start on a busy machine
        ticket = receiver.open_ticket("w", (1, 2, 3), 120.0)
        # shm LAYER frames carry no payload, tcp ones exactly 2 * 3 blocks of one layer
        wrong = 8 if backend == "shm" else 2 * 3 * s.bytes_per_block_per_layer + 1
        # from another process: an shm writer's blocks are quarantined until it is gone
        args = [
            receiver.endpoint,
            receiver.layout.to_dict(),
            {"epoch": ticket.epoch, "nbytes": wrong},
        ]
        code = "import sys, json; from test_endpoint_security import send_bad_layer as f; "
        code += "f(*json.loads(sys.argv[1]))"
        child = subprocess.run(
            [sys.executable, "-c", code, json.dumps(args)],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr
        assert receiver.wait("w", 10.0) is TransferState.FAILED
        error = receiver.error("w")
        assert type(error).__name__ == "ProtocolError" and "payload bytes" in str(error)
        assert released.wait_for("w")
    assert released.ids == ["w"]


# -- authentication ---------------------------------------------------------------------


def test_wrong_secret_is_refused_with_nothing_but_authentication_failed(
    peer: Peer, backend: str
) -> None:
    released = Released()
    with receiver_with(backend, spec(2), released, AUTHED) as receiver:
        ticket = receiver.open_ticket("x", (1, 2), 20.0)
        wrong = dataclasses.replace(FAST, secret="f" * 64)
        result = peer.run(
            SendJob(backend, spec(2), ((ticket, (0, 1)),), options=wrong, connect_first=True)
        )
        kind, message = result["connect_error"]
        assert kind == "AuthenticationError" and message.endswith(": authentication failed")
        assert result["states"] == {"x": "failed"} and result["released"] == ["x"]
        for no_proof in (None, "0" * 64):  # no secret at all, a wrong one
            raw = raw_sender(receiver)
            header, body = raw.hello(no_proof)
            assert header.kind is Kind.REFUSE
            assert body == {"error": "AuthenticationError", "message": "authentication failed"}
            assert closed_by_peer(raw.fs.sock)
        # the prefill's refusal is counted on its connection's thread after the REFUSE went
        # out; the raw senders' before their connection closed
        assert eventually(lambda: receiver.endpoint_stats()["auth_failed"] == 3, 10.0)
        assert receiver.poll("x") is TransferState.PENDING  # nothing was written
        assert not receiver.kv_cache.flat.any()
        good_transfer(peer, backend, receiver, "after-wrong-secret")


def test_right_secret_transfers_byte_for_byte(peer: Peer, backend: str) -> None:
    with receiver_with(backend, spec(4), Released(), AUTHED) as receiver:
        good_transfer(peer, backend, receiver, "ok")
        assert receiver.endpoint_stats().get("auth_failed", 0) == 0


def test_sender_with_a_secret_refuses_a_receiver_without_one(peer: Peer, backend: str) -> None:
    with make_receiver(backend, spec(2), Released()) as receiver:
        ticket = receiver.open_ticket("n", (1, 2), 20.0)
        result = peer.run(
            SendJob(backend, spec(2), ((ticket, (0, 1)),), options=AUTHED, connect_first=True)
        )
        kind, message = result["connect_error"]
        assert kind == "AuthenticationError" and "does not authenticate" in message
        assert receiver.poll("n") is TransferState.PENDING


@pytest.fixture
def fake_receiver() -> Iterator[tuple[socket.socket, list[str]]]:
    """A tcp listener whose accepted connections `serve_fake` answers; what it heard."""
    listener = socket.create_server(("127.0.0.1", 0))
    heard: list[str] = []
    yield listener, heard
    listener.close()


def serve_fake(
    listener: socket.socket,
    heard: list[str],
    welcome: dict[str, object],
    *,
    auth_flag: bool,
) -> threading.Thread:
    """Accept one connection: CHALLENGE, read HELLO, WELCOME with `welcome`, then record
    every frame kind that arrives until the sender hangs up."""

    def run() -> None:
        sock, _ = listener.accept()
        fs = FrameSocket(sock, 10.0)
        fs.limit_reads(10.0)
        fs.send_json(
            Kind.CHALLENGE, "", {"version": PROTOCOL_VERSION, "nonce": "n" * 64, "auth": auth_flag}
        )
        try:
            while (header := fs.recv_header()) is not None:
                heard.append(header.kind.name)
                fs.discard(header.nbytes)
                if header.kind is Kind.HELLO:
                    fs.send_json(Kind.WELCOME, "", welcome)
        except PeerLostError:
            pass
        fs.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_sender_never_writes_to_a_receiver_that_cannot_prove_the_secret(
    fake_receiver: tuple[socket.socket, list[str]],
) -> None:
    listener, heard = fake_receiver
    s = spec(2)
    layout = KVLayout.from_spec(s, "test-model")
    welcome: dict[str, object] = {
        "layout": layout.to_dict(),
        "epoch": 7,
        "num_blocks": s.num_blocks,
        "mac": "0" * 64,
    }
    thread = serve_fake(listener, heard, welcome, auth_flag=True)
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    ticket = Ticket("f", endpoint, (1, 2), layout, 7, 20.0)
    released = Released()
    with create_sender("tcp", s, model_id="test-model", release=released, options=AUTHED) as snd:
        with pytest.raises(AuthenticationError, match="could not prove"):
            snd.connect(ticket, 5.0)
        assert snd.poll("f") is TransferState.FAILED
        assert released.wait_for("f")
    thread.join(10.0)
    assert heard == ["HELLO"]  # no BEGIN, no LAYER ever reached it


# -- connection limits and timeouts -----------------------------------------------------


def test_connections_beyond_the_limit_are_closed_at_once(backend: str) -> None:
    options = dataclasses.replace(AUTHED, max_connections=2, handshake_timeout_s=60.0)
    with receiver_with(backend, spec(2), Released(), options) as receiver:
        held = [raw_sender(receiver), raw_sender(receiver)]  # both got their CHALLENGE
        extra = connect_raw(receiver.endpoint)
        assert closed_by_peer(extra)  # EOF, not a CHALLENGE
        assert receiver.endpoint_stats()["over_connection_limit"] == 1
        held.pop().fs.close()
        assert eventually(lambda: receiver.endpoint_stats()["connections"] == 1, 10.0)
        held.append(raw_sender(receiver))  # a free slot takes a new peer again
        assert receiver.endpoint_stats()["connections"] == 2


def test_a_peer_silent_in_the_handshake_is_closed(backend: str) -> None:
    options = dataclasses.replace(AUTHED, handshake_timeout_s=0.5)
    with receiver_with(backend, spec(2), Released(), options) as receiver:
        silent = raw_sender(receiver)
        assert closed_by_peer(silent.fs.sock)
        trickle = raw_sender(receiver)  # a HELLO dribbled a byte at a time never completes
        trickle.fs.sock.sendall(_HEADER.pack(MAGIC, Kind.HELLO, 0, 0, 0, 0, 100, 0))
        trickle.fs.sock.settimeout(0.2)
        gone = False
        for _ in range(200):
            try:
                trickle.fs.sock.sendall(b" ")
                if trickle.fs.sock.recv(1) == b"":
                    gone = True
                    break
            except TimeoutError:
                continue
            except OSError:
                gone = True
                break
        assert gone
        assert receiver.endpoint_stats()["handshake_timeout"] == 2
        assert eventually(lambda: receiver.endpoint_stats()["connections"] == 0, 10.0)


def test_an_idle_connection_without_transfers_is_closed(peer: Peer, backend: str) -> None:
    options = dataclasses.replace(AUTHED, idle_timeout_s=0.5)
    with receiver_with(backend, spec(2), Released(), options) as receiver:
        raw = raw_sender(receiver)
        header, _ = raw.hello(SECRET)
        assert header.kind is Kind.WELCOME
        assert closed_by_peer(raw.fs.sock)
        assert receiver.endpoint_stats()["idle_timeout"] == 1
        good_transfer(peer, backend, receiver, "after-idle")


# -- shm segments -----------------------------------------------------------------------


def test_map_segment_never_creates_a_segment() -> None:
    name = f"pdkv-ghost-{os.getpid()}"
    path = os.path.join(SHM_DIR, name)
    with pytest.raises(FileNotFoundError):
        map_segment(name, 4096)
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="not a pdserve KV segment"):
        map_segment("../../tmp/x", 4096)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(ValueError, match="holds 4096 bytes, expected 8192"):
            map_segment(name, 8192)
        flat = map_segment(name, 4096)
        flat[:3] = 7
        assert os.pread(fd, 3, 0) == b"\x07\x07\x07"
    finally:
        os.close(fd)
        os.unlink(path)


def test_shm_sender_to_a_missing_segment_fails_and_creates_nothing() -> None:
    s = spec(2)
    name = f"pdkv-ghost-{os.getpid()}-ctl"
    layout = KVLayout.from_spec(s, "test-model")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"\0{name}.ctl")  # a receiver's control socket with no segment behind it
    listener.listen(1)
    heard: list[str] = []
    welcome: dict[str, object] = {
        "layout": layout.to_dict(),
        "epoch": 3,
        "num_blocks": s.num_blocks,
        "segment": name,
        "total_bytes": s.total_bytes,
    }
    thread = serve_fake(listener, heard, welcome, auth_flag=False)
    ticket = Ticket("g", f"shm://{name}", (1, 2), layout, 3, 20.0)
    released = Released()
    try:
        with create_sender("shm", s, model_id="test-model", release=released, options=FAST) as snd:
            with pytest.raises(PeerLostError, match="no shm segment"):
                snd.connect(ticket, 5.0)
            assert released.wait_for("g")
        thread.join(10.0)
        assert heard == ["HELLO"]
        assert not os.path.exists(os.path.join(SHM_DIR, name))
    finally:
        listener.close()
