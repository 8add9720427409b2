"""Mutual authentication of a KV control connection with the application's shared secret.

The receiver speaks first (`CHALLENGE` with its nonce); the sender answers `HELLO` with its
own nonce and `hello_mac`; the receiver checks it before looking at anything else and
answers `WELCOME` with `welcome_mac`, which the sender checks before it writes a byte:

    receiver ── CHALLENGE {version, nonce_r, auth} ─────────────────────▶ sender
    receiver ◀── HELLO {version, layout, nonce_s, mac=H("hello", r, s, hello)} ── sender
    receiver ── WELCOME {layout, epoch, ..., mac=H("welcome", r, s, welcome)} ─▶ sender

H is HMAC-SHA256 keyed with the secret over a label, both nonces and the frame's other
fields as canonical JSON. The labels keep one side's proof from being replayed as the
other's; fresh nonces on both sides keep a recorded proof from being replayed later. A
receiver without a secret says `auth: false`, and a sender holding one refuses it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from collections.abc import Callable

from kvtransfer.base import (
    AuthenticationError,
    KVLayout,
    KVLayoutMismatchError,
    KVTransferError,
    PeerLostError,
    ProtocolError,
    error_from_wire,
    error_to_wire,
)
from kvtransfer.wire import PROTOCOL_VERSION, FrameSocket, Kind

AUTH_FAILED = "authentication failed"  # the whole refusal an unauthenticated peer gets

logger = logging.getLogger(__name__)


def new_nonce() -> str:
    return secrets.token_hex(32)


def hello_mac(secret: str, nonce_r: str, nonce_s: str, hello: dict[str, object]) -> str:
    """The sender's proof: binds both nonces and the HELLO's fields (less `mac`)."""
    return _mac(secret, b"pdserve-kv-hello/v2", nonce_r, nonce_s, hello)


def welcome_mac(secret: str, nonce_r: str, nonce_s: str, welcome: dict[str, object]) -> str:
    """The receiver's proof: binds both nonces and the WELCOME's fields (less `mac`)."""
    return _mac(secret, b"pdserve-kv-welcome/v2", nonce_r, nonce_s, welcome)


def _verify(expected: str, frame: dict[str, object]) -> bool:
    """Whether `frame["mac"]` equals `expected` (constant time)."""
    got = frame.get("mac")
    return isinstance(got, str) and hmac.compare_digest(got.encode(), expected.encode())


def sender_handshake(
    fs: FrameSocket, endpoint: str, layout: KVLayout, secret: str | None
) -> dict[str, object]:
    """Called by a sender on a fresh connection: read CHALLENGE, send HELLO with our proof,
    and return the WELCOME once the receiver proved itself (with `secret`).

    Raises the receiver's refusal (AuthenticationError, KVLayoutMismatchError, ...),
    AuthenticationError for a receiver without a secret or a wrong proof, ProtocolError or
    PeerLostError for anything else.
    """
    _, challenge = expect(fs, (Kind.CHALLENGE,), endpoint)
    if challenge.get("version") != PROTOCOL_VERSION:
        raise KVTransferError(
            f"receiver at {endpoint} speaks protocol version {challenge.get('version')}, "
            f"we speak {PROTOCOL_VERSION}"
        )
    nonce_r = challenge.get("nonce")
    if not isinstance(nonce_r, str):
        raise ProtocolError(f"CHALLENGE from {endpoint} without a nonce")
    if secret is not None and challenge.get("auth") is not True:
        raise AuthenticationError(
            f"receiver at {endpoint} does not authenticate (it has no shared secret)"
        )
    nonce_s = new_nonce()
    hello: dict[str, object] = {"version": PROTOCOL_VERSION, "layout": layout.to_dict()}
    hello["nonce"] = nonce_s
    if secret is not None:
        hello["mac"] = hello_mac(secret, nonce_r, nonce_s, hello)
    fs.send_json(Kind.HELLO, "", hello)
    kind, body = expect(fs, (Kind.WELCOME, Kind.REFUSE), endpoint)
    if kind is Kind.REFUSE:
        raise error_from_wire(body, f"receiver at {endpoint}")
    if secret is not None and not _verify(welcome_mac(secret, nonce_r, nonce_s, body), body):
        raise AuthenticationError(
            f"receiver at {endpoint} could not prove it holds the shared secret"
        )
    return body


def receiver_handshake(
    fs: FrameSocket,
    peer: str,
    layout: KVLayout,
    secret: str | None,
    timeout_s: float,
    welcome_facts: Callable[[], dict[str, object]],
) -> tuple[str, KVTransferError] | None:
    """Called by a receiver on an accepted connection: send CHALLENGE, wait up to
    `timeout_s` for the HELLO, check it (proof of `secret` first, then version and
    `layout`), and answer WELCOME with `welcome_facts()` (asked only once the sender is
    accepted: they may name what only it may know) and our proof. A refused sender is sent
    REFUSE; returns why, as `(refusal counter, error)`, or None once WELCOME is sent."""
    nonce = new_nonce()
    fs.limit_reads(timeout_s)
    challenge = {"version": PROTOCOL_VERSION, "nonce": nonce, "auth": secret is not None}
    fs.send_json(Kind.CHALLENGE, "", challenge)
    _, hello = expect(fs, (Kind.HELLO,), f"sender {peer}")
    fs.limit_reads(None)
    if not isinstance(nonce_s := hello.get("nonce"), str):
        raise ProtocolError("HELLO without a nonce")
    version = hello.get("version")
    refusal: tuple[str, KVTransferError] | None = None
    if secret is not None and not _verify(hello_mac(secret, nonce, nonce_s, hello), hello):
        refusal = ("auth_failed", AuthenticationError(AUTH_FAILED))
    # Authenticated from here on (or no secret configured): refusals may say why.
    elif version != PROTOCOL_VERSION:
        refusal = ("refused", KVTransferError(f"protocol {version} != {PROTOCOL_VERSION}"))
    elif diffs := layout.differences(KVLayout.from_dict(hello.get("layout"))):
        logger.warning("sender %s: %s", peer, KVLayoutMismatchError(diffs, "receiver"))
        # the field names and the sender's own values; ours are not the peer's business
        withheld: dict[str, tuple[object, object]] = {
            k: ("(not disclosed)", b) for k, (_, b) in diffs.items()
        }
        refusal = ("refused", KVLayoutMismatchError(withheld, "receiver", "sender"))
    if refusal is not None:
        fs.send_json(Kind.REFUSE, "", error_to_wire(refusal[1]))
        return refusal
    welcome: dict[str, object] = {"layout": layout.to_dict(), **welcome_facts()}
    if secret is not None:
        welcome["mac"] = welcome_mac(secret, nonce, nonce_s, welcome)
    fs.send_json(Kind.WELCOME, "", welcome)
    return None


def expect(fs: FrameSocket, kinds: tuple[Kind, ...], peer: str) -> tuple[Kind, dict[str, object]]:
    """During a handshake: the kind and JSON payload of the next frame, which must be of
    one of `kinds` (else ProtocolError; PeerLostError at EOF)."""
    if (header := fs.recv_header()) is None:
        raise PeerLostError(f"{peer} closed the connection during the handshake")
    if header.kind not in kinds:
        raise ProtocolError(f"expected {kinds[0].name} from {peer}, got {header.kind.name}")
    return header.kind, fs.recv_json(header)


def _mac(secret: str, label: bytes, nonce_r: str, nonce_s: str, body: dict[str, object]) -> str:
    fields = {k: v for k, v in body.items() if k != "mac"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    message = b"\0".join((label, nonce_r.encode(), nonce_s.encode(), canonical))
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
