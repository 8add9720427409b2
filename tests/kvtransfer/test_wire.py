"""Frames over a socket pair: headers, payloads, checksum flag, EOF handling."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from kvtransfer.base import PeerLostError, TransferAbortedError, TransferState
from kvtransfer.wire import Connection, FrameSocket, Kind


@pytest.fixture
def pair() -> tuple[FrameSocket, FrameSocket]:
    a, b = socket.socketpair()
    return FrameSocket(a, 5.0), FrameSocket(b, 5.0)


def test_header_payload_and_json_roundtrip(pair: tuple[FrameSocket, FrameSocket]) -> None:
    left, right = pair
    payload = np.arange(3 * 100_000, dtype=np.uint8).reshape(3, -1) % 251
    sender = threading.Thread(
        target=lambda: (
            left.send(
                Kind.LAYER,
                "req-é",
                epoch=2**63 + 5,
                layer=7,
                crc=0xDEADBEEF,
                payload=[payload.data],
            ),
            left.send_json(Kind.WELCOME, "", {"epoch": 3}),
        )
    )
    sender.start()  # the payload exceeds the socket buffer: send and receive concurrently
    header = right.recv_header()
    assert header is not None
    assert (header.kind, header.request_id, header.epoch, header.layer) == (
        Kind.LAYER,
        "req-é",
        2**63 + 5,
        7,
    )
    assert header.has_crc and header.crc == 0xDEADBEEF and header.nbytes == payload.nbytes
    got = np.empty(payload.nbytes, dtype=np.uint8)
    right.recv_into(got.data)
    assert np.array_equal(got, payload.reshape(-1))
    welcome = right.recv_header()
    assert welcome is not None and not welcome.has_crc
    assert right.recv_json(welcome) == {"epoch": 3}
    sender.join()


def test_discard_skips_a_payload(pair: tuple[FrameSocket, FrameSocket]) -> None:
    left, right = pair
    left.send(Kind.LAYER, "a", payload=[b"x" * 1000])
    left.send(Kind.FINISH, "b", layer=4)
    first = right.recv_header()
    assert first is not None
    right.discard(first.nbytes)
    second = right.recv_header()
    assert second is not None and (second.kind, second.request_id, second.layer) == (
        Kind.FINISH,
        "b",
        4,
    )


def test_clean_eof_between_frames_and_mid_frame(pair: tuple[FrameSocket, FrameSocket]) -> None:
    left, right = pair
    left.close()
    assert right.recv_header() is None
    a, b = socket.socketpair()
    a.sendall(b"\x00" * 10)  # a truncated header
    a.close()
    with pytest.raises(PeerLostError):
        FrameSocket(b, 5.0).recv_header()


def test_garbage_is_rejected() -> None:
    a, b = socket.socketpair()
    a.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 32)
    with pytest.raises(PeerLostError, match="magic"):
        FrameSocket(b, 5.0).recv_header()
    a.close()


def test_send_after_close_raises_peer_lost(pair: tuple[FrameSocket, FrameSocket]) -> None:
    left, right = pair
    right.close()
    with pytest.raises(PeerLostError):
        for _ in range(100):  # the first sends may still fit in the buffer
            left.send(Kind.LAYER, "x", payload=[b"y" * 65536])


def test_stop_wakes_our_reader_but_the_peer_sees_the_end_only_at_close(
    pair: tuple[FrameSocket, FrameSocket],
) -> None:
    """After a failed send the reader thread must drop the connection, but the peer (a
    receiver whose memory we may still be copying into) must not see EOF before `close`."""
    left, right = pair
    seen: list[object] = []
    reader = threading.Thread(target=lambda: seen.append(left.recv_header()))
    reader.start()
    left.stop()
    reader.join(5.0)
    assert seen == [None] and left.closed
    right.sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        right.sock.recv(1)
    left.close()
    assert right.recv_header() is None


def test_send_soon_never_blocks_and_keeps_frames_whole(
    pair: tuple[FrameSocket, FrameSocket],
) -> None:
    """Far more than the socket buffers hold, nobody reading: every `send_soon` returns at
    once (what does not fit goes out from a thread), and the reader later gets each frame
    whole, none spliced into another."""
    left, right = pair
    pad = "x" * 60_000
    calls = threading.Thread(
        target=lambda: [
            left.send_soon(Kind.ABORT, f"r{i}", {"i": i, "pad": pad}, epoch=7, layer=4)
            for i in range(200)
        ]
    )
    calls.start()
    calls.join(10.0)
    assert not calls.is_alive(), "send_soon blocked on a peer that does not read"
    seen = set()
    for _ in range(200):
        header = right.recv_header()
        assert header is not None and header.kind is Kind.ABORT
        assert (header.epoch, header.layer) == (7, 4)
        body = right.recv_json(header)
        assert body["pad"] == pad and header.request_id == f"r{body['i']}"
        seen.add(body["i"])
    assert seen == set(range(200))


def test_a_stopped_socket_sends_nothing_more(pair: tuple[FrameSocket, FrameSocket]) -> None:
    left, right = pair
    left.stop()
    with pytest.raises(PeerLostError):
        left.send(Kind.PING)
    with pytest.raises(PeerLostError):
        left.send_soon(Kind.ABORT, "r", {}, epoch=0, layer=0)
    left.close()
    assert right.recv_header() is None  # not a byte went out after stop


def test_an_abort_on_a_socket_closed_under_it_raises_nothing(
    pair: tuple[FrameSocket, FrameSocket],
) -> None:
    """Another thread closed the socket between the checks (its fd is -1 now): send_soon
    says the peer is lost, and an abort, which must never raise, says nothing."""
    left, _ = pair
    left.sock.close()
    with pytest.raises(PeerLostError):
        left.send_soon(Kind.ABORT, "r", {}, epoch=0, layer=0)
    Connection(left, "gone").send_abort("r", TransferState.ABORTED, TransferAbortedError("test"))


def test_many_buffers_out_and_scattered_in(pair: tuple[FrameSocket, FrameSocket]) -> None:
    left, right = pair
    rng = np.random.default_rng(1)
    data = rng.integers(0, 255, size=600_000, dtype=np.uint8)
    cuts = np.sort(rng.choice(np.arange(1, data.size), size=2500, replace=False))
    parts = [p.data for p in np.split(data, cuts)]  # > IOV_MAX buffers, uneven sizes
    sender = threading.Thread(target=lambda: left.send(Kind.LAYER, "v", payload=parts))
    sender.start()
    header = right.recv_header()
    assert header is not None and header.nbytes == data.nbytes
    out = np.zeros_like(data)
    cuts_in = np.sort(rng.choice(np.arange(1, data.size), size=1700, replace=False))
    right.recv_into(*[p.data for p in np.split(out, cuts_in)])
    sender.join()
    assert np.array_equal(out, data)
